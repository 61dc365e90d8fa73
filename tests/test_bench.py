"""Smoke test of the benchmark (launch/bench.py): it runs end to end on a tiny config and writes valid outputs.

Speed lives in the benchmark, not here: nothing below is timed. What is checked is that the run completes,
that the JSON, markdown and PNG are well formed, and that the collectives the bench counts for syncbn_dist
are the designed ones (one all_reduce of (2C+1) float64 per layer forward, one of 2C float64 backward).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch"))

import bench  # noqa: E402  (launch/ is not a package; the bench runs as a script)

WIDTH = 4
LAYERS = 2

TINY_SCENARIO = {
    "name": "tiny",
    "world_sizes": [2],
    "variants": ["bn", "syncbn_dist", "syncbn_dist_dedicated", "naive", "torch_syncbn"],
    "width": WIDTH,
    "num_layers": LAYERS,
    "image_size": 4,
    "batch_size": 4,
    "warmup_steps": 1,
    "rounds": 2,
    "steps_per_round": 1,
    "floor_repeats": 2,
    "memory_steps": 1,
    "profile": True,
    "profile_top": 3,
    "timeout_s": 60,
}
TINY_BENCH = {
    "scenarios": ["tiny.yaml"],
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
    config = tmp_path / "bench.yaml"
    config.write_text(yaml.safe_dump({**TINY_BENCH, "output_dir": str(tmp_path / "out")}))
    return config


@pytest.mark.distributed
@pytest.mark.slow
def test_bench_runs_end_to_end_and_writes_json_markdown_png(tmp_path: Path) -> None:
    config = _write_configs(tmp_path)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "bench.py"), "--config", str(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"

    summary = json.loads((out / "bench.json").read_text())
    assert [t["id"] for t in summary["targets"]] == ["P1", "P2", "P3", "P4", "P5", "P6"]
    (run,) = summary["scenarios"]["tiny"]["runs"]
    assert run["world_size"] == 2 and run["backend"] == "gloo"
    # torch.nn.SyncBatchNorm refuses CPU tensors, so it must be skipped (not crash) on the gloo run.
    assert run["skipped_variants"] == ["torch_syncbn"]
    for name in ("bn", "syncbn_dist", "syncbn_dist_dedicated", "naive"):
        entry = run["variants"][name]
        assert entry["rounds"] == TINY_SCENARIO["rounds"]
        assert entry["median_ms"] > 0 and entry["memory"]["rss_peak_mib"] > 0

    # The design's payload, computed here from the model's shape rather than taken from the bench.
    for name in ("syncbn_dist", "syncbn_dist_dedicated"):
        counted = run["variants"][name]["collectives"]
        assert counted["forward"] == {
            "count": LAYERS,
            "bytes": [(2 * WIDTH + 1) * 8],
            "ops": ["all_reduce"],
            "dtypes": ["float64"],
            "groups": ["world" if name == "syncbn_dist" else "other"],
        }
        assert counted["backward"]["count"] == LAYERS and counted["backward"]["bytes"] == [2 * WIDTH * 8]
        assert counted["all_gather_calls"] == 0
        assert run["variants"][name]["collectives_match_expected"] is True
    # Plain BatchNorm sends nothing through Python collectives; the naive reference sends 2C float32 each way.
    assert run["variants"]["bn"]["collectives"]["forward"]["count"] == 0
    assert run["variants"]["bn"]["collectives"]["backward"]["count"] == 0
    assert run["variants"]["naive"]["collectives"]["forward"]["bytes"] == [2 * WIDTH * 4]
    # The floor probes one all_reduce per payload size that (b) sends, as often as it sends it per step.
    assert sorted((p["bytes"], p["per_step"]) for p in run["floor_detail"]) == [
        (2 * WIDTH * 8, LAYERS),
        ((2 * WIDTH + 1) * 8, LAYERS),
    ]
    assert run["floor_ms"] > 0

    micro = summary["micro"]
    cases = {(tuple(c["shape"]), c["memory_format"]) for c in micro["cases"]}
    # channels_last only exists for the 4D shape.
    assert cases == {((4, 3, 4, 4), "contiguous"), ((4, 3, 4, 4), "channels_last"), ((6, 5), "contiguous")}
    assert all(c["ratio"] > 0 for c in micro["cases"])

    table = (out / "bench.md").read_text()
    assert "| config | W | backend |" in table and "| P6 |" in table
    assert table in proc.stdout  # the table is printed too
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["scenario_configs"][0]["width"] == WIDTH


def test_config_rejects_unknown_keys_and_wrong_types(tmp_path: Path) -> None:
    config = _write_configs(tmp_path)
    with pytest.raises(KeyError, match="micro.repeets"):
        bench.load_config(str(config), ["micro.repeets=3"])
    with pytest.raises(KeyError, match="tiny.yaml:widht"):
        bench.load_config(str(config), ["scenario.widht=3"])
    with pytest.raises(TypeError, match="rounds"):
        bench.load_config(str(config), ["scenario.rounds=many"])
    with pytest.raises(ValueError, match="unknown variant 'apex'"):
        bench.load_config(str(config), ["scenario.variants=[bn, apex]"])


def test_config_overrides_apply_to_top_level_and_every_scenario(tmp_path: Path) -> None:
    config = _write_configs(tmp_path)
    cfg, scenarios = bench.load_config(str(config), ["micro.repeats=7", "scenario.rounds=9", "plot=false"])
    assert cfg.micro.repeats == 7 and cfg.plot is False
    assert [s.rounds for s in scenarios] == [9]
    assert scenarios[0].width == WIDTH  # from the file; unset keys keep their typed defaults
    assert scenarios[0].in_channels == bench.ScenarioConfig().in_channels


def test_shipped_configs_load() -> None:
    cfg, scenarios = bench.load_config(str(ROOT / "configs" / "bench.yaml"))
    assert {s.name for s in scenarios} == {"latency", "compute"}
    assert cfg.compute_scenario in {s.name for s in scenarios}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_microbenchmark_on_cuda_includes_torch_syncbatchnorm_function(tmp_path: Path) -> None:
    config = _write_configs(tmp_path)
    out = tmp_path / "out_cuda"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "launch" / "bench.py"),
            "--config",
            str(config),
            "scenarios=[]",
            "micro.device=cuda",
            "micro.dtypes=[float32, bfloat16]",
            f"output_dir={out}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    micro = json.loads((out / "bench.json").read_text())["micro"]
    assert micro["backend"] == "nccl" and micro["device"] != "cpu"
    for case in micro["cases"]:
        # torch's SyncBatchNorm autograd function at world size 1 is timed, or its failure is reported.
        assert "torch SyncBatchNorm fn" in case["median_ms"] or "torch SyncBatchNorm fn" in case["errors"]
