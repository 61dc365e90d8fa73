"""Smoke test of the benchmark (launch/bench/): it runs end to end on tiny configs and writes valid outputs.

Speed lives in the benchmark, not here: nothing below is timed. What is checked is that the run completes,
that the JSON, markdown and PNG are well formed, that the collectives the bench counts for syncbn_dist are the
designed ones (one all_reduce of (2C+1) float64 per layer forward, one of 2C float64 backward, on the conv-BN
net and the ResNet-style net), and that the in-step floor variant sends exactly those collectives, counted. The
config: overrides reach the bench file and every scenario file, and every bad config exits 2 naming its key
before any process starts.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from launch.bench import run as bench
from launch.bench.config import ResolvedBenchConfig, ScenarioConfig, load_bench
from launch.common.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]

WIDTH = 4
LAYERS = 2
RESNET_WIDTH = 2
# ResNet-18 topology: the stem, 8 BasicBlocks of two BNs, a BN in the 3 downsampling shortcuts; per-layer channels.
RESNET_CHANNELS = [2] + [2] * 4 + [4] * 5 + [8] * 5 + [16] * 5

_COMMON = {
    "world_sizes": [2],
    "warmup_steps": 1,
    "rounds": 2,
    "min_rounds": 1,
    "steps_per_round": 1,
    "floor_repeats": 2,
    "memory_steps": 1,
    "profile": True,
    "profile_top": 3,
    "timeout_s": 120,
    # aot_eager: the compiled variants trace and run the same graphs as with inductor, in seconds instead of
    # minutes of C++ compilation (the bench's default, inductor, is what make bench measures).
    "compile_backend": "aot_eager",
}
TINY_SCENARIO = {
    **_COMMON,
    "name": "tiny",
    "variants": [
        "bn",
        "syncbn_dist",
        "syncbn_dist_dedicated",
        "floor",
        "naive",
        "torch_syncbn",
        "bn_compiled",
        "syncbn_dist_compiled",
    ],
    "width": WIDTH,
    "num_layers": LAYERS,
    "image_size": 4,
    "batch_size": 4,
}
TINY_RESNET = {
    **_COMMON,
    "name": "tiny_resnet",
    "model": "resnet18",
    "variants": ["bn", "syncbn_dist", "floor", "naive"],
    "width": RESNET_WIDTH,
    "image_size": 8,
    "batch_size": 2,
    "profile": False,
}
TINY_BENCH = {
    "scenarios": ["tiny.yaml", "tiny_resnet.yaml"],
    "compute_scenario": "tiny",
    "micro": {
        "shapes": [[4, 3, 4, 4], [6, 5]],
        "dtypes": ["float32"],
        "memory_formats": ["contiguous", "channels_last"],
        "warmup": 1,
        "repeats": 2,
        "profile_top": 3,
        "timeout_s": 60,
    },
}


def _write_configs(tmp_path: Path) -> Path:
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY_SCENARIO))
    (tmp_path / "tiny_resnet.yaml").write_text(yaml.safe_dump(TINY_RESNET))
    config = tmp_path / "bench.yaml"
    config.write_text(yaml.safe_dump({**TINY_BENCH, "output_dir": str(tmp_path / "out")}))
    return config


def _design(channels: list[int]) -> dict[str, tuple[int, list[int]]]:
    """syncbn_dist's collectives, from the network's shape: per BN layer (2C+1) float64 forward, 2C backward."""
    return {
        "forward": (len(channels), sorted({(2 * c + 1) * 8 for c in channels})),
        "backward": (len(channels), sorted({2 * c * 8 for c in channels})),
    }


@pytest.mark.distributed
@pytest.mark.slow
def test_bench_runs_end_to_end_and_writes_json_markdown_png(tmp_path: Path) -> None:
    config = _write_configs(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "launch.bench.run", "--config", str(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"

    summary = json.loads((out / "performance.json").read_text())
    assert [t["id"] for t in summary["targets"]] == ["P1", "P2", "P3", "P4", "P5", "P6", "P7"]
    assert summary["config"]["scenario_configs"][0]["width"] == WIDTH  # the resolved config is kept
    assert summary["command"] == f"python -m launch.bench.run --config {config}"
    # ... and written as YAML beside it, which loads back to the same config.
    resolved = load_config(ResolvedBenchConfig, out / "performance_config.yaml")
    assert dataclasses.asdict(resolved) == summary["config"]
    (run,) = summary["scenarios"]["tiny"]["runs"]
    assert run["world_size"] == 2 and run["backend"] == "gloo"
    # torch.nn.SyncBatchNorm refuses CPU tensors, so it must be skipped (not crash) on the gloo run.
    assert run["skipped_variants"] == ["torch_syncbn"]
    for name in ("bn", "syncbn_dist", "syncbn_dist_dedicated", "floor", "naive", "bn_compiled"):
        entry = run["variants"][name]
        assert entry["rounds"] == TINY_SCENARIO["rounds"]
        assert entry["median_ms"] > 0 and entry["memory"]["rss_peak_mib"] > 0
        assert entry["ops_per_step"] > 0

    # The design's payload, computed here from the model's shape rather than taken from the bench.
    for name in ("syncbn_dist", "syncbn_dist_dedicated", "syncbn_dist_compiled"):
        counted = run["variants"][name]["collectives"]
        assert counted["forward"] == {
            "count": LAYERS,
            "bytes": [(2 * WIDTH + 1) * 8],
            "ops": ["all_reduce"],
            "dtypes": ["float64"],
            "groups": ["world" if name != "syncbn_dist_dedicated" else "other"],
        }
        assert counted["backward"]["count"] == LAYERS and counted["backward"]["bytes"] == [2 * WIDTH * 8]
        assert counted["all_gather_calls"] == 0
        assert run["variants"][name]["collectives_match_expected"] is True
    # Plain BatchNorm sends nothing through Python collectives; the naive reference sends 2C float32 each way.
    for name in ("bn", "bn_compiled"):
        assert run["variants"][name]["collectives"]["forward"]["count"] == 0
        assert run["variants"][name]["collectives"]["backward"]["count"] == 0
    assert run["variants"]["naive"]["collectives"]["forward"]["bytes"] == [2 * WIDTH * 4]
    # Compiling adds no graph break for syncbn_dist beyond those DDP causes with plain BatchNorm. bn_compiled is
    # compiled first and meets DDP's own breaks; dynamo does not count a frame it has already handled, so the
    # synchronized variant counts only breaks in code new to it: its layers (one per layer if they broke).
    assert run["variants"]["bn_compiled"]["graph_breaks"] > 0
    assert run["variants"]["syncbn_dist_compiled"]["graph_breaks"] == 0
    assert run["variants"]["syncbn_dist_compiled"]["compile_seconds"] > 0
    # The back-to-back probe: one all_reduce per payload size that (b) sends, as often as it sends it per step.
    assert sorted((p["bytes"], p["per_step"]) for p in run["floor_detail"]) == [
        (2 * WIDTH * 8, LAYERS),
        ((2 * WIDTH + 1) * 8, LAYERS),
    ]
    assert run["floor_ms"] > 0
    assert run["in_step_floor_ms"] == pytest.approx(
        run["variants"]["floor"]["median_ms"] - run["variants"]["bn"]["median_ms"]
    )

    # The floor variant sends exactly the collectives syncbn_dist sends: same phase, op, bytes, dtype and group,
    # call by call, on both networks; and both send the design's payloads.
    (resnet,) = summary["scenarios"]["tiny_resnet"]["runs"]
    for which, channels in ((run, [WIDTH] * LAYERS), (resnet, RESNET_CHANNELS)):
        floor, ours = which["variants"]["floor"]["collectives"], which["variants"]["syncbn_dist"]["collectives"]
        assert floor["sequence"] == ours["sequence"] and len(ours["sequence"]) == 2 * len(channels)
        for phase in ("forward", "backward"):
            assert floor[phase] == ours[phase]
            assert (ours[phase]["count"], ours[phase]["bytes"]) == _design(channels)[phase]
            assert ours[phase]["dtypes"] == ["float64"] and ours[phase]["groups"] == ["world"]
        assert which["variants"]["floor"]["collectives_match_expected"] is True

    micro = summary["micro"]
    cases = {(tuple(c["shape"]), c["memory_format"]) for c in micro["cases"]}
    # channels_last only exists for the 4D shape.
    assert cases == {((4, 3, 4, 4), "contiguous"), ((4, 3, 4, 4), "channels_last"), ((6, 5), "contiguous")}
    assert all(c["ratio"] > 0 for c in micro["cases"])
    # syncbn_dist sends its two collectives (c10d ops) and more per-channel work than F.batch_norm.
    assert all(c["ops"]["syncbn_dist"] > c["ops"]["F.batch_norm"] > 0 for c in micro["cases"])

    table = (out / "performance.md").read_text()
    assert "| config | W | backend | (a) | (b) | (f) |" in table and "| P6 |" in table and "| P7 |" in table
    assert table in proc.stdout  # the table is printed too
    assert (out / "performance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_config_rejects_unknown_keys_and_wrong_types(tmp_path: Path) -> None:
    config = str(_write_configs(tmp_path))
    with pytest.raises(ConfigError, match="unknown config key 'micro.repeets'"):
        load_bench(config, ["micro.repeets=3"])
    with pytest.raises(ConfigError, match="unknown config key 'scenario.widht'"):
        load_bench(config, ["scenario.widht=3"])
    with pytest.raises(ConfigError, match="'scenario.rounds': expected int"):
        load_bench(config, ["scenario.rounds=many"])
    with pytest.raises(ConfigError, match="'scenario.variants': expected a value listing only .*'apex'"):
        load_bench(config, ["scenario.variants=[bn, apex]"])
    # A mistake inside a scenario file names the file and the key.
    (tmp_path / "tiny_resnet.yaml").write_text(yaml.safe_dump({**TINY_RESNET, "widht": 3}))
    with pytest.raises(ConfigError, match="tiny_resnet.yaml: unknown config key 'widht'"):
        load_bench(config)


def test_config_overrides_apply_to_top_level_and_every_scenario(tmp_path: Path) -> None:
    config = _write_configs(tmp_path)
    cfg, scenarios = load_bench(str(config), ["micro.repeats=7", "scenario.rounds=9", "plot=false"])
    assert cfg.micro.repeats == 7 and cfg.plot is False
    assert [s.rounds for s in scenarios] == [9, 9]
    assert scenarios[0].width == WIDTH  # from the file; unset keys keep their typed defaults
    assert scenarios[0].in_channels == ScenarioConfig().in_channels


def test_shipped_configs_load() -> None:
    cfg, scenarios = load_bench(str(ROOT / "configs" / "bench.yaml"))
    assert {"latency", "compute", "resnet_b4", "resnet_b32"} <= {s.name for s in scenarios}
    assert cfg.compute_scenario in {s.name for s in scenarios}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("micro.repeets=3", "unknown config key 'micro.repeets'"),  # a bad key
        ("plot=maybe", "config key 'plot': expected bool"),  # a wrong type
        ("micro.repeats=0", "config key 'micro.repeats': expected a value > 0 (got 0)"),  # out of range
        ("scenario.rounds=-1", "config key 'scenario.rounds': expected a value > 0 (got -1)"),
        ("scenario.bucket_cap_mb=0", "config key 'scenario.bucket_cap_mb': expected a value null or > 0"),
        ("scenario.variants=[bn,apex]", "config key 'scenario.variants': expected a value listing only"),  # unknown
        ("scenario.model=vgg", "config key 'scenario.model': expected a value one of 'convbn' | 'resnet18'"),
        ("micro.dtypes=[float32,int8]", "config key 'micro.dtypes'"),
        ("scenarios=[missing.yaml]", "config key 'scenarios': scenario file missing.yaml not found"),
        ("scenarios=[tiny.yaml,tiny.yaml]", "config key 'scenarios': expected files of distinct scenario names"),
        ("rounds", "expected KEY=VALUE"),
    ],
)
def test_main_exits_2_on_a_bad_config_naming_the_key_before_launching(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], override: str, message: str
) -> None:
    config = _write_configs(tmp_path)

    def no_launch(*args: object, **kwargs: object) -> None:
        raise AssertionError("a process was launched for a bad config")

    monkeypatch.setattr(bench, "launch", no_launch)
    assert bench.main(["--config", str(config), override]) == 2
    (line,) = capsys.readouterr().err.splitlines()  # one line, no traceback
    assert "error: " in line and message in line
    assert not (tmp_path / "out").exists()  # nothing written


def test_main_exits_2_on_a_missing_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--config", str(tmp_path / "nope.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_microbenchmark_on_cuda_includes_torch_syncbatchnorm_function(tmp_path: Path) -> None:
    config = _write_configs(tmp_path)
    out = tmp_path / "out_cuda"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.bench.run",
            "--config",
            str(config),
            "scenarios=[]",
            "micro.device=cuda",
            "micro.dtypes=[float32]",
            f"output_dir={out}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    micro = json.loads((out / "performance.json").read_text())["micro"]
    assert micro["backend"] == "nccl" and micro["device"] != "cpu"
    for case in micro["cases"]:
        # torch's SyncBatchNorm autograd function runs on CUDA at world size 1 for every case here: it must be
        # timed beside ours (an error recorded instead would hide that the comparison did not happen).
        assert case["errors"] == {}, case["errors"]
        assert set(case["median_ms"]) == {"F.batch_norm", "syncbn_dist", "torch SyncBatchNorm fn"}
        assert case["ops"]["torch SyncBatchNorm fn"] > 0


def test_device_override_reaches_every_scenario_and_the_microbenchmark(tmp_path: Path) -> None:
    config = str(_write_configs(tmp_path))
    cfg, scenarios = load_bench(config, ["device=cuda"])
    assert cfg.micro.device == "cuda" and [s.device for s in scenarios] == ["cuda", "cuda"]
    with pytest.raises(ConfigError, match=re.escape("config key 'device': expected a value one of 'auto' | 'cpu' |")):
        load_bench(config, ["device=tpu"])
    with pytest.raises(ConfigError, match="config key 'scenario.model'.*got 'vgg'"):
        load_bench(config, ["scenario.model=vgg"])
    # tiny has syncbn_dist_compiled: dynamo's DDP optimizer needs buckets of at least 1 MiB.
    with pytest.raises(ConfigError, match="tiny.yaml: config key 'bucket_cap_mb': compiled variants"):
        load_bench(config, ["scenario.bucket_cap_mb=0.5"])
