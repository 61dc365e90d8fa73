"""Tests of launch/compare.py: the step-by-step equivalence check, the batch schedule, the config, and the report.

The equivalence check is a correctness test of the library on a training loop: train.py's DDP model with
syncbn_dist on 2 gloo ranks x 2 images must follow plain ``nn.BatchNorm`` in one process on the 4 images
step by step, to float32 rounding, while the same harness with plain per-rank BatchNorm must not. The report
is built from a real (tiny) ``make compare`` run, never from hard-coded numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
import torch
from launch_scripts import load_script
from launcher import run_distributed
from torch.utils.data import DistributedSampler

ROOT = Path(__file__).resolve().parents[1]


train = load_script("train.py")
compare = load_script("compare.py")


# ---------------------------------------------------------------------------------------------------------
# The step-by-step equivalence on real gloo ranks.
# ---------------------------------------------------------------------------------------------------------


def _equivalence_worker(rank: int, world_size: int, steps: int) -> dict[str, dict] | None:
    # Random data, the same on every rank (the worker draws it from a fixed seed): 2 images per rank and step.
    gen = torch.Generator().manual_seed(7)
    train_set = (torch.randn(16, 1, 8, 8, generator=gen) * 3 + 1, torch.randint(0, 10, (16,), generator=gen))
    test_set = (torch.randn(8, 1, 8, 8, generator=gen) * 3 + 1, torch.randint(0, 10, (8,), generator=gen))
    runtime = train.Runtime(rank, world_size, torch.device("cpu"), distributed=True)
    results = {}
    for sync_bn, dtype in ((True, torch.float64), (True, torch.float32), (False, torch.float64)):
        cfg = train.load_config(
            None,
            [
                "device=cpu",
                "data.batch_size=2",
                "model.width=4",
                "model.dropout=0",  # per-rank dropout masks could not match one process's
                f"model.sync_bn={str(sync_bn).lower()}",
            ],
        )
        name = f"{'sync' if sync_bn else 'plain'} {dtype}"
        results[name] = compare.equivalence_steps(cfg, runtime, train_set, test_set, steps, dtype)
    return results if rank == 0 else None


def _assert_all_below(values: list[float], bound: float, what: str) -> None:
    assert len(values) > 0
    torch.testing.assert_close(
        torch.tensor(values, dtype=torch.float64),
        torch.zeros(len(values), dtype=torch.float64),
        atol=bound,
        rtol=0,
        msg=lambda m: f"{what}: {m}",
    )


@pytest.mark.distributed
def test_syncbn_on_ranks_trains_like_batchnorm_on_the_global_batch() -> None:
    steps = 3
    results = run_distributed(_equivalence_worker, 2, steps)[0]
    f64, f32, plain = results["sync torch.float64"], results["sync torch.float32"], results["plain torch.float64"]
    assert (f64["world_size"], f64["batch_size"], f64["steps"], f64["dtype"]) == (2, 2, steps, "float64")
    for eq in (f64, f32):
        assert len(eq["loss"]) == len(eq["params"]) == len(eq["running_stats"]) == steps
        assert all(eq["num_batches_tracked_equal"])
        assert eq["test_acc_ranks"] == eq["test_acc_single"]
    # float64: the statistics and gradients are summed in another order on 2 ranks than in one process, a few ulp
    # (2e-16) of values up to ~10 per step, carried over 3 SGD steps at lr 0.1: 1e-12 leaves room for that growth
    # (measured ~1e-15) and is 1e-11 of what plain per-rank BatchNorm gives below.
    for key in ("loss", "params", "running_stats"):
        _assert_all_below(f64[key], 1e-12, f"float64 {key}")
    _assert_all_below([f64["test_logits"]], 1e-12, "float64 test logits")
    # float32, as train.py trains: the same rounding at 1.2e-7 per operation; BatchNorm over 4 random images is
    # ill-conditioned, so 3 steps grow it to ~1e-5 (measured 6e-6; the one-process model fed the same batches in
    # reverse order drifts as far, 7e-6, see control_params). 1e-4 is still 1e-3 of plain BatchNorm's difference.
    for key in ("loss", "params", "running_stats"):
        _assert_all_below(f32[key], 1e-4, f"float32 {key}")
    _assert_all_below([f32["test_logits"]], 1e-3, "float32 test logits (logits up to ~10: 1e-4 relative)")
    # The harness can tell: plain BatchNorm normalizes each rank's 2 images by their own statistics, so the
    # parameters and running statistics leave the one-process model's at the first step, and the loss follows.
    assert plain["params"][0] > 1e-2 and plain["running_stats"][0] > 1e-2 and max(plain["loss"]) > 1e-2


# ---------------------------------------------------------------------------------------------------------
# The batch schedule.
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("num_samples", "world_size", "batch_size"), [(37, 4, 3), (20, 2, 5), (9, 1, 4)])
def test_global_batches_are_what_one_process_draws_at_world_size_times_batch(
    num_samples: int, world_size: int, batch_size: int
) -> None:
    per_epoch = (num_samples // world_size) // batch_size
    steps = 2 * per_epoch + 1  # into a third epoch
    batches = compare.global_batches(num_samples, world_size, batch_size, steps, seed=3)
    assert len(batches) == steps
    global_batch = world_size * batch_size
    for step, parts in enumerate(batches):
        epoch, k = divmod(step, per_epoch)
        assert [len(p) for p in parts] == [batch_size] * world_size
        # Rank r's batch is what train.py's DistributedSampler gives rank r at that step...
        for rank, part in enumerate(parts):
            sampler = DistributedSampler(range(num_samples), world_size, rank, shuffle=True, seed=3, drop_last=True)
            sampler.set_epoch(epoch + 1)
            assert part.tolist() == list(sampler)[k * batch_size : (k + 1) * batch_size]
        # ...and their union is one process's batch of world_size * batch_size from a one-replica sampler.
        single = DistributedSampler(range(num_samples), 1, 0, shuffle=True, seed=3, drop_last=True)
        single.set_epoch(epoch + 1)
        expected = list(single)[k * global_batch : (k + 1) * global_batch]
        assert sorted(torch.cat(parts).tolist()) == sorted(expected)


def test_same_global_batches_compares_train_py_loaders() -> None:
    cfg = compare.load_config(ROOT / "configs" / "compare.yaml", ["nproc=2", "batch_size=64"])
    overrides = compare.run_overrides(cfg, "single_bn")
    single = train.load_config(cfg.train_config, overrides)
    assert compare.same_global_batches(single, single, 1)  # one process against itself
    reseeded = train.load_config(cfg.train_config, [*overrides, "seed=1"])
    assert not compare.same_global_batches(single, reseeded, 1)  # another shuffle: other batches
    halved = train.load_config(cfg.train_config, [*overrides, "data.batch_size=64"])
    assert not compare.same_global_batches(single, halved, 1)  # other batch sizes
    # Two ranks x 64 against one process x 128: exactly when train.py shards one process as a one-replica
    # DistributedSampler would (see compare.global_batches); the answer must follow train.py's loaders.
    ranks = train.load_config(cfg.train_config, compare.run_overrides(cfg, "sync_bn"))
    loaders = [train.build_loaders(ranks, train.Runtime(r, 2, torch.device("cpu"), False), 1) for r in (0, 1)]
    single_loader, _, single_sampler = train.build_loaders(single, train.Runtime(0, 1, torch.device("cpu"), False), 1)
    expected = True
    for epoch in (1, 2):
        for _, _, sampler in [*loaders, (None, None, single_sampler)]:
            if sampler is not None:
                sampler.set_epoch(epoch)
        labels = [
            sorted(torch.cat([b[1] for b in batches]).tolist())
            for batches in zip(*(loader for loader, _, _ in loaders))
        ]
        expected &= labels == [sorted(b[1].tolist()) for b in single_loader]
    assert compare.same_global_batches(ranks, single, 2) == expected


# ---------------------------------------------------------------------------------------------------------
# Config.
# ---------------------------------------------------------------------------------------------------------


def test_shipped_config_loads_and_documents_its_command() -> None:
    path = ROOT / "configs" / "compare.yaml"
    cfg = compare.load_config(path)
    assert (cfg.nproc, cfg.batch_size, cfg.dropout) == (4, 4, 0.0)  # tiny per-rank batches, comparable runs
    header = path.read_text().split("\n\n")[0]
    assert all(line.startswith("#") for line in header.splitlines())
    assert "python launch/compare.py --config configs/compare.yaml" in header and "--set " in header
    overrides = {run: compare.run_overrides(cfg, run) for run in compare.RUNS}
    resolved = {run: train.load_config(cfg.train_config, o) for run, o in overrides.items()}
    assert [resolved[r].data.batch_size * compare.run_nproc(cfg, r) for r in compare.RUNS] == [16, 16, 16]
    assert [resolved[r].model.sync_bn for r in compare.RUNS] == [False, True, False]
    for field in ("seed", "train", "device"):  # everything else is the same in the three runs
        assert len({repr(getattr(c, field)) for c in resolved.values()}) == 1, field


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("epoch=3", "unknown config key 'epoch'"),
        ("nproc=0", "config key 'nproc': expected a value > 0"),
        ("dropout=1", "config key 'dropout'"),
        ("device=tpu", "config key 'device'"),
    ],
)
def test_bad_config_fails_before_anything_runs(tmp_path: Path, override: str, message: str, capsys) -> None:
    args = ["--config", str(ROOT / "configs" / "compare.yaml"), "--set", override]
    assert compare.main([*args, "--set", f"output_dir={tmp_path / 'out'}"]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------
# The whole command, tiny.
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.distributed
def test_compare_writes_figure_summary_and_numbers_from_real_runs(tmp_path: Path) -> None:
    out, report = tmp_path / "out", tmp_path / "report"
    args = ["--config", "configs/compare.yaml", "--set", "nproc=2", "--set", "batch_size=32", "--set", "epochs=1"]
    args += ["--set", "equivalence_steps=3", "--set", f"output_dir={out}", "--set", f"report_dir={report}"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, "launch/compare.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280
    )
    assert proc.returncode == 0, f"compare failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    assert sorted(p.name for p in report.iterdir()) == ["compare.json", "compare.md", "compare.png"]

    result = json.loads((report / "compare.json").read_text())
    for run in compare.RUNS:  # the report's numbers are the runs' own
        metrics = json.loads((out / run / "metrics.json").read_text())
        assert result["runs"][run]["final_test_acc"] == metrics["final_test_acc"]
        assert result["runs"][run]["global_batch_size"] == 64
    assert result["runs"]["sync_bn"]["bn_transport"] == ["distributed"]
    assert result["runs"]["plain_bn"]["bn_transport"] == []  # plain BatchNorm: no synchronized layer
    assert sorted(result["equivalence"]) == ["float32", "float64"]
    for dtype, bound in (("float32", 1e-5), ("float64", 1e-12)):
        eq = result["equivalence"][dtype]
        assert (eq["world_size"], eq["batch_size"], eq["steps"], eq["dtype"]) == (2, 32, 3, dtype)
        # Rounding only, over 3 steps (see test_syncbn_on_ranks_trains_like_batchnorm_on_the_global_batch).
        assert max(eq["loss"]) < bound and max(eq["params"]) < bound and max(eq["running_stats"]) < 100 * bound

    image = matplotlib.image.imread(report / "compare.png")
    assert image.ndim == 3 and image.shape[0] > 500 and image.shape[1] > 800
    assert image[..., :3].std() > 0.05  # not a blank canvas

    text = (report / "compare.md").read_text()
    assert "![compare](compare.png)" in text
    for run in compare.RUNS:
        assert f"{100 * result['runs'][run]['final_test_acc']:.2f} %" in text
    assert f"parameters {max(result['equivalence']['float64']['params']):.1g}" in text
