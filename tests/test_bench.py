"""Smoke test of the benchmark (launch/bench/): it runs end to end on tiny configs and writes valid outputs.

Speed lives in the benchmark, not here: nothing below is timed. What is checked is that the run completes,
that the JSON, markdown and PNG are well formed, that the collectives the bench counts for syncbn_dist are the
designed ones (one all_reduce of 2C + 6 float64 values per layer in each direction, on the conv-BN
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
from torch import nn

from launch.bench import resnet50_step
from launch.bench import run as bench
from launch.bench.config import README_SECTION, ResolvedBenchConfig, ScenarioConfig, load_bench
from launch.bench.kernel_profile import CUDA_VARIANTS
from launch.bench.models import ResNet50
from launch.bench.report import readme_tables
from launch.common.config import ConfigError, load_config
from launch.common.readme import read_section

# Left out of make test-quick (docs/testing.md, "The quick tier"): the benchmark recipes (make bench, make bench-gpu).
pytestmark = pytest.mark.plumbing

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
    # What the assertions read on the ResNet: the floor against syncbn_dist, bn the report's baseline (the naive
    # reference runs on tiny).
    "variants": ["bn", "syncbn_dist", "floor"],
    "width": RESNET_WIDTH,
    "image_size": 8,
    "batch_size": 2,
    "profile": False,
}
TINY_BENCH = {
    "scenarios": ["tiny.yaml", "tiny_resnet.yaml"],
    "compute_scenario": "tiny",
    "micro": {
        # (4, 3, 1, 1) views as (N, C, 1), channels innermost, in either memory format, as (6, 5) does: the three
        # cases share the compiled regions' signature, compiled once where (4, 3, 4, 4)'s two layouts compiled two
        # more (issue 35; the kernels' layouts are tests/test_kernels.py's).
        "shapes": [[4, 3, 1, 1], [6, 5]],
        "dtypes": ["float32"],
        "memory_formats": ["contiguous", "channels_last"],
        "warmup": 1,
        "repeats": 2,
        "profile_top": 3,
        "timeout_s": 60,
        "compile_cost": False,  # two more processes that compile: make bench measures it
        "kernel_bytes": False,  # a fresh compilation per case; test_kernels holds the same count to its budget
    },
}


def _write_configs(tmp_path: Path) -> Path:
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY_SCENARIO))
    (tmp_path / "tiny_resnet.yaml").write_text(yaml.safe_dump(TINY_RESNET))
    config = tmp_path / "bench.yaml"
    config.write_text(yaml.safe_dump({**TINY_BENCH, "output_dir": str(tmp_path / "out")}))
    return config


def _design(channels: list[int]) -> dict[str, tuple[int, list[int]]]:
    """syncbn_dist's collectives, from the network's shape: per BN layer 2C + 6 float64 values each way (the
    statistics and the collective's tag)."""
    sizes = sorted({(2 * c + 6) * 8 for c in channels})
    return {"forward": (len(channels), sizes), "backward": (len(channels), sizes)}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.over_budget("make bench's command end to end, its ranks spawned afresh as the benchmark does")
def test_bench_runs_end_to_end_and_writes_json_markdown_png(tmp_path: Path) -> None:
    """``python -m launch.bench.run`` on tiny scenarios writes its JSON, Markdown, figure and README table.

    Over 30 s: the benchmark's own command in a subprocess, whose ranks are fresh processes at each world size (as the
    benchmark measures them, never pooled), with compiled variants: the run end to end is the assertion."""
    config = _write_configs(tmp_path)
    readme = tmp_path / "README.md"  # the run rewrites this file's performance table
    readme.write_text(
        "intro\n<!-- performance table: generated by make bench -->\nold\n<!-- end performance table -->\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "launch.bench.run", "--config", str(config), f"readme={readme}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"

    summary = json.loads((out / "performance.json").read_text())
    targets = ["P1", "P2", "P3", "P4", "P5", "P6", "P7", "P8", "K1", "K2", "K3"]
    assert [t["id"] for t in summary["targets"]] == targets
    assert summary["config"]["scenario_configs"][0]["width"] == WIDTH  # the resolved config is kept
    assert summary["command"] == f"python -m launch.bench.run --config {config} readme={readme}"
    assert read_section(readme, README_SECTION) == readme_tables(summary)  # the README's table is the report's
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
        # Compiled variants are not counted: a step under the counter (a dispatch mode) would leave them eager.
        assert entry["ops_per_step"] is None if name.endswith("_compiled") else entry["ops_per_step"] > 0

    # The design's payload, computed here from the model's shape rather than taken from the bench.
    for name in ("syncbn_dist", "syncbn_dist_dedicated", "syncbn_dist_compiled"):
        counted = run["variants"][name]["collectives"]
        assert counted["forward"] == {
            "count": LAYERS,
            "bytes": [(2 * WIDTH + 6) * 8],  # the statistics, the count and the collective's tag
            "ops": ["all_reduce"],
            "dtypes": ["float64"],
            # The compiled variant's collectives are functional ones in its graph, whose group the profiler does
            # not record (launch.common.counting.CollectiveCounter).
            "groups": [{"syncbn_dist": "world", "syncbn_dist_dedicated": "other"}.get(name, "in-graph")],
        }
        assert counted["backward"]["count"] == LAYERS and counted["backward"]["bytes"] == [(2 * WIDTH + 6) * 8]
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
    # The back-to-back probe: one all_reduce per payload size that (b) sends, as often as it sends it per step (forward
    # and backward payloads have one size).
    assert sorted((p["bytes"], p["per_step"]) for p in run["floor_detail"]) == [((2 * WIDTH + 6) * 8, 2 * LAYERS)]
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
    assert cases == {((4, 3, 1, 1), "contiguous"), ((4, 3, 1, 1), "channels_last"), ((6, 5), "contiguous")}
    assert all(c["ratio"] > 0 for c in micro["cases"])
    # syncbn_dist sends its two collectives (c10d ops) and more per-channel work than F.batch_norm.
    assert all(c["ops"]["syncbn_dist"] > c["ops"]["F.batch_norm"] > 0 for c in micro["cases"])
    # Bytes per element: F.batch_norm reads and writes each element a handful of times (float32: at least x, y in
    # forward and dy, x, dx in backward); the CUDA model is the constant 8 accesses.
    for c in micro["cases"]:
        moved = c["bytes_per_element"]
        assert moved["syncbn_dist"] >= moved["F.batch_norm"] >= 20.0, moved
        assert moved["torch SyncBatchNorm CUDA (model)"] == 32.0, moved
        assert "syncbn_dist compiled" not in moved  # kernel_bytes is off
        assert c["compiled_ratio"] > 0

    table = (out / "performance.md").read_text()
    assert "| config | W | backend | (a) | (b) | (f) |" in table and "| P6 |" in table and "| P8 |" in table
    assert "| K1 |" in table and "| K3 |" in table
    # Where the compiled layer's time goes: every case has the two breakdown variants, and the table has a row each.
    breakdown = ("syncbn_dist compiled, no collective", "syncbn_dist compiled, regions replayed")
    assert all(c["median_ms"][name] > 0 for c in micro["cases"] for name in breakdown)
    assert table.count("| (4, 3, 1, 1) | float32 | contiguous |") == 3  # the case table, K1, the breakdown
    assert next(t for t in summary["targets"] if t["id"] == "K3")["detail"] == "not measured"
    assert "syncbn_dist B/elem" in table
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
        pytest.param(
            "micro.device=cuda",
            "config key 'micro.device': 'cuda' was asked for but CUDA is not available",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal needs a machine without CUDA"),
        ),
    ],
)
def test_main_exits_2_on_a_bad_config_naming_the_key_before_launching(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], override: str, message: str
) -> None:
    config = _write_configs(tmp_path)

    def no_launch(*args: object, **kwargs: object) -> None:
        raise AssertionError("a process was launched for a bad config")

    monkeypatch.setattr(bench, "run_distributed", no_launch)
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
        assert set(case["median_ms"]) == {
            "F.batch_norm", "F.batch_norm + collectives", "syncbn_dist", "syncbn_dist compiled",
            "syncbn_dist compiled, no collective", "syncbn_dist compiled, regions replayed", "torch SyncBatchNorm fn",
        }
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


def _run_module(module: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m module args...`` from the repository root, its output captured."""
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_kernel_profile_times_every_kernel_of_the_traced_layer_beside_torchs() -> None:
    """launch.bench.kernel_profile compiles the layer (a user's torch.compile, synchronization forced) with inductor's
    kernel profiling and reports each generated kernel (statistics, normalize, backward reductions, grad_input: four
    over a process group) and torch's two."""
    proc = _run_module("launch.bench.kernel_profile", "shape=[4,3,4,4]", "steps=2", "warmup=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert sum(" graph_" in line for line in lines) == 4, proc.stdout
    assert any(line.endswith("aten::native_batch_norm") for line in lines), proc.stdout
    assert any(line.endswith("aten::native_batch_norm_backward") for line in lines), proc.stdout
    assert re.search(r"^generated kernels [\d.]+ µs, torch's [\d.]+ µs, ratio [\d.]+$", lines[-1]), proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_profile_on_cuda_sums_each_variants_device_kernels() -> None:
    """device=cuda: each variant's CUDA kernels and their total; the traced layer's are Triton's."""
    proc = _run_module("launch.bench.kernel_profile", "device=cuda", "shape=[8,16,7,5]", "steps=2", "warmup=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    totals = re.findall(r"^(.+): ([\d.]+) device µs per forward\+backward$", proc.stdout, re.MULTILINE)
    assert [name for name, _ in totals] == list(CUDA_VARIANTS), proc.stdout
    assert all(float(micros) > 0 for _, micros in totals), proc.stdout
    compiled = proc.stdout.split("\n" + CUDA_VARIANTS[1] + ":")[0]
    assert " triton_" in compiled, proc.stdout


# The ResNet-50 step at toy size on CPU: the rows, counts and checks launch.bench.resnet50_step reports.
RESNET50_TOY = [
    # 64x64: the last stage is 2x2, so the compiled kernels meet one signature (image_size=32's 1x1 last stage is a
    # second one, L = 1: twice the compiled graphs, 4 more C++ kernels) for a few ms more of eager compute.
    "device=cpu", "width=8", "image_size=64", "batch_size=4", "steps=2", "warmup=2", "rounds=1",
    # eager: the torch.compile rows trace the model with Dynamo (graph breaks, the collectives in the graph) without
    # AOT autograd's 10 s here or minutes of C++ compilation.
    "compile_backend=eager", "dtypes=[float32]", "compile_dtypes=[float32]",
]


@pytest.mark.slow
@pytest.mark.over_budget("the script compiles the converted ResNet-50 topology, as make bench-gpu runs it")
def test_resnet50_step_on_cpu_reports_every_variant_forced_onto_the_group(tmp_path: Path) -> None:
    """launch.bench.resnet50_step at toy size (ResNet-50 topology at width 8, 64x64, batch 4, float32): every CPU
    variant timed and counted, the CUDA-only ones skipped with their reason, and every synchronized variant sending
    its two collectives per BatchNorm layer per step over a one-member group, where it computes plain BatchNorm.

    About 30 s from an empty inductor cache (30-31 CPU s; 29-36 s wall on 2 cores, as loaded; 22 s warm), most of it
    compiling, which the script does as make bench-gpu runs it: Dynamo traces the converted model's 53 synchronized
    layers in 8 s (plain's in 1 s), and the compiled kernels' first build takes 3 s warm, 10 s cold.
    """
    report = tmp_path / "resnet50_step.md"
    proc = _run_module("launch.bench.resnet50_step", *RESNET50_TOY, f"output={report}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = resnet50_step.read_report(report)
    assert report.read_text().split("```json")[0].strip() in proc.stdout  # the table is printed too

    cpu_variants = [v for v in resnet50_step.VARIANTS if v not in resnet50_step.CUDA_ONLY]
    rows = {row["variant"]: row for row in record["rows"]}
    assert [(row["variant"], row["dtype"]) for row in record["rows"]] == [(v, "float32") for v in cpu_variants]
    for name, row in rows.items():
        assert len(row["times_ms"]) == 2 and min(row["times_ms"]) > 0 and row["median_ms"] > 0, name
        assert row["ratio"] > 0, name
        assert row["cuda_kernels"] is None and row["device_ms"] is None, name  # counted on cuda only
    # torch's function and CUDA graphs cannot run on CPU: each is reported skipped with its reason, not dropped.
    assert set(record["skipped"]) == {"torch_function", "plain_reduce_overhead", "syncbn_dist_reduce_overhead"}
    assert all("CUDA" in reason for reason in record["skipped"].values()), record["skipped"]
    for name in record["skipped"]:
        assert f"- `{name}`: " in proc.stdout

    # Forced synchronization: one all_reduce per layer and direction, counted from the model's own BatchNorm layers.
    layers = sum(isinstance(m, nn.BatchNorm2d) for m in ResNet50(width=8).modules())
    assert layers == 53  # torchvision's resnet50
    for name in ("naive", "syncbn_dist_native", "syncbn_dist_compiled", "syncbn_dist_compile"):
        assert rows[name]["collectives"] == 2 * layers, name
    assert rows["plain"]["collectives"] == rows["plain_compile"]["collectives"] == 0
    # aten ops: where the counter sees them as they run; the synchronized layer dispatches more than plain's.
    assert rows["syncbn_dist_native"]["aten_ops"] > rows["plain"]["aten_ops"] > 0
    assert rows["syncbn_dist_compiled"]["aten_ops"] is None and rows["syncbn_dist_compile"]["aten_ops"] is None
    assert rows["syncbn_dist_compile"]["graph_breaks"] == 0

    # Over a group of one the synchronized layers compute plain BatchNorm: the same logits at the first step, the same
    # loss at the first two (the second after one SGD step, so backward counts too). Plain BN's statistics are float32,
    # syncbn_dist's float64, so each of the 53 layers' outputs differs by float32 rounding (1e-7 of O(1) values), which
    # the depth carries to the O(1) logits: measured 1.5e-6, allowed 1e-4; the losses (about 7.2 and 5.8) 1e-7 relative,
    # allowed 1e-5. A wrong variance (unbiased for biased: 16/15 at the last stage's 16 values per channel, 3e-2 in the
    # logits, measured) or a wrong gradient changes them by orders of magnitude more.
    plain = rows["plain"]
    for name in ("syncbn_dist_native", "syncbn_dist_compiled", "syncbn_dist_compile", "plain_compile"):
        assert rows[name]["max_abs_logit_diff"] <= 1e-4, (name, rows[name]["max_abs_logit_diff"])
        torch.testing.assert_close(rows[name]["losses"], plain["losses"], rtol=1e-5, atol=0.0, msg=name)

    targets = {(t["id"], t["numerator"]): t for t in record["targets"]}
    assert targets[("G2", "syncbn_dist_compile")]["ratio"] > 0
    # Without torch's function and CUDA graphs, G1 and G3 are not measured (and say so).
    assert targets[("G1", "syncbn_dist_native")]["met"] is None
    assert targets[("G3", "syncbn_dist_reduce_overhead")]["ratio"] is None
    assert record["config"]["width"] == 8 and record["command"].endswith(f"output={report}")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("device=cuda", "config key 'device': 'cuda' was asked for but CUDA is not available"),
        ("variants=[plain,apex]", "config key 'variants': expected a value listing distinct variants"),
        ("warmup=1", "config key 'warmup': expected a value >= 2 (got 1)"),
        ("image_size=16", "config key 'image_size': expected a value >= 32 (got 16)"),
        ("widht=8", "unknown config key 'widht'"),
    ],
)
def test_resnet50_step_exits_2_on_a_bad_config_naming_the_key(
    override: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if override == "device=cuda" and torch.cuda.is_available():
        pytest.skip("the refusal needs a machine without CUDA")
    assert resnet50_step.main([override]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "error: " in line and message in line


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_resnet50_step_on_cuda_forces_torchs_function_and_counts_kernels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """device=cuda at toy size, the eager variants (the torch.compile ones are make bench-gpu's: minutes of inductor):
    torch's SyncBatchNorm function runs forced, with its two collectives per layer (forward all_gather, backward
    all_reduce) like the others, every row counts its CUDA kernels, and over a group of one the synchronized variants
    give plain BatchNorm's logits and losses in float32."""
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")  # float32 convolutions (cuDNN's default is TF32), as on CPU
    report = tmp_path / "resnet50_step.md"
    eager = ["plain", "torch_function", "naive", "syncbn_dist_native"]
    toy = [arg for arg in RESNET50_TOY if not arg.startswith(("device=", "dtypes=", "compile_"))]
    proc = _run_module(
        "launch.bench.resnet50_step", "device=cuda", *toy, f"variants=[{','.join(eager)}]", f"output={report}"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = resnet50_step.read_report(report)
    assert record["skipped"] == {} and record["device"] != "cpu"
    rows = {(row["variant"], row["dtype"]): row for row in record["rows"]}
    assert set(rows) == {(v, dtype) for v in eager for dtype in ("bfloat16", "float32")}
    for (name, dtype), row in rows.items():
        assert row["median_ms"] > 0 and row["cuda_kernels"] > 0 and row["aten_ops"] > 0, (name, dtype)
        # The device's busy time is in ms, within the step's (twice it at most: kernels on two streams may overlap).
        assert 0 < row["device_ms"] <= 2 * max(row["times_ms"]), (name, dtype)
        assert row["collectives"] == (0 if name == "plain" else 106), (name, dtype)  # 53 BatchNorm2d layers
    plain = rows[("plain", "float32")]
    for name in ("torch_function", "syncbn_dist_native"):
        row = rows[(name, "float32")]
        # As on CPU (test_resnet50_step_on_cpu_...): float32 rounding of each layer's statistics, carried by the depth.
        assert row["max_abs_logit_diff"] <= 1e-4, (name, row["max_abs_logit_diff"])
        torch.testing.assert_close(row["losses"], plain["losses"], rtol=1e-5, atol=0.0, msg=name)
    assert all(t["ratio"] > 0 for t in record["targets"] if t["numerator"] == "syncbn_dist_native")


def test_each_fast_path_is_one_line_of_the_package_and_its_copy_retires_it(tmp_path: Path) -> None:
    from launch.bench import fast_paths

    package = Path(fast_paths.syncbn_dist.__file__).parent
    for path, (relative, keep, retire, _) in fast_paths.FAST_PATHS.items():
        assert (package / relative).read_text().count(keep) == 1, f"{path}: the line it names is gone"
        name = fast_paths._retired_copy(path, str(tmp_path))
        text = (tmp_path / name / relative).read_text()
        assert keep not in text and text.count(retire) >= 1
        # the copy differs from the package in that one file only
        changed = [p.relative_to(tmp_path / name) for p in (tmp_path / name).rglob("*.py")
                   if p.read_text() != (package / p.relative_to(tmp_path / name)).read_text()]
        assert changed == [Path(relative)]
    assert fast_paths.main(["paths=[no_such_path]"]) == 2
