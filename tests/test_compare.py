"""Tests of launch.compare: the step-by-step equivalence check, the batch schedule, the config, and the report.

The equivalence check is a correctness test of the library on a training loop: the digits job's DDP model with
syncbn_dist on 2 gloo ranks x 2 images must follow plain ``nn.BatchNorm`` in one process on the 4 images
step by step, to float32 rounding, while the same harness with plain per-rank BatchNorm must not. The report
is built from a real (tiny) ``make compare`` run, never from hard-coded numbers.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
import torch
import yaml
from config_headers import header_commands
from torch.utils.data import DistributedSampler

from launch.common.config import argument_parser
from launch.common.readme import read_section
from launch.common.spawn import run_distributed
from launch.common.torchrun import env_outside_torchrun
from launch.compare import run
from launch.compare.config import MODES, README_SECTION, learning_rate, load_compare_config, run_nproc, run_overrides
from launch.compare.equivalence import equivalence_steps, global_batches, same_global_batches
from launch.compare.report import spread
from launch.compare.summary import accuracy_table, mean_pm
from launch.digits.config import DigitsConfig, load_digits_config
from launch.digits.runtime import Runtime

# Left out of make test-quick (docs/testing.md, "The quick tier"): the sweep recipe (make compare).
pytestmark = pytest.mark.plumbing

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------------------
# The step-by-step equivalence on real gloo ranks.
# ---------------------------------------------------------------------------------------------------------


def _equivalence_worker(rank: int, world_size: int, steps: int) -> dict[str, dict] | None:
    # Random data, the same on every rank (the worker draws it from a fixed seed): 2 images per rank and step.
    gen = torch.Generator().manual_seed(7)
    train_set = (torch.randn(16, 1, 8, 8, generator=gen) * 3 + 1, torch.randint(0, 10, (16,), generator=gen))
    test_set = (torch.randn(8, 1, 8, 8, generator=gen) * 3 + 1, torch.randint(0, 10, (8,), generator=gen))
    runtime = Runtime(rank, world_size, torch.device("cpu"), distributed=True)
    results = {}
    for sync_bn, dtype in ((True, torch.float64), (True, torch.float32), (False, torch.float64)):
        cfg = load_digits_config(
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
        results[name] = equivalence_steps(cfg, runtime, train_set, test_set, steps, dtype)
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
    # float32, as the digits job trains: the same rounding at 1.2e-7 per operation; BatchNorm over 4 random images is
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
    batches = global_batches(num_samples, world_size, batch_size, steps, seed=3)
    assert len(batches) == steps
    global_batch = world_size * batch_size
    for step, parts in enumerate(batches):
        epoch, k = divmod(step, per_epoch)
        assert [len(p) for p in parts] == [batch_size] * world_size
        # Rank r's batch is what the digits job's DistributedSampler gives rank r at that step...
        for rank, part in enumerate(parts):
            sampler = DistributedSampler(range(num_samples), world_size, rank, shuffle=True, seed=3, drop_last=True)
            sampler.set_epoch(epoch + 1)
            assert part.tolist() == list(sampler)[k * batch_size : (k + 1) * batch_size]
        # ...and their union is one process's batch of world_size * batch_size from a one-replica sampler.
        single = DistributedSampler(range(num_samples), 1, 0, shuffle=True, seed=3, drop_last=True)
        single.set_epoch(epoch + 1)
        expected = list(single)[k * global_batch : (k + 1) * global_batch]
        assert sorted(torch.cat(parts).tolist()) == sorted(expected)


def test_same_global_batches_compares_the_digits_loaders() -> None:
    cfg = load_compare_config(ROOT / "configs" / "compare.yaml", ["nproc=2"])
    single, ranks, reseeded_ranks = (
        load_digits_config(cfg.train_config, run_overrides(cfg, mode, 64, seed))
        for mode, seed in (("single_bn", 0), ("sync_bn", 0), ("sync_bn", 1))
    )
    assert (single.data.batch_size, ranks.data.batch_size) == (128, 64)
    assert same_global_batches(single, single, 1)  # one process against itself
    reseeded = load_digits_config(cfg.train_config, run_overrides(cfg, "single_bn", 64, 1))
    assert not same_global_batches(single, reseeded, 1)  # another shuffle: other batches
    assert not same_global_batches(single, ranks, 1)  # one process at 128 against one at 64
    # Two ranks x 64 against one process x 128: the same batches. The digits job shards with DistributedSampler, whose
    # permutation depends on (seed, epoch) only and which gives rank r the positions r, r + 2, ... of it, so the
    # union of the ranks' k-th batches is positions 128k .. 128k + 127, one process's k-th batch (see
    # global_batches). A loader that shuffled otherwise in one process would break this.
    assert same_global_batches(ranks, single, 2)
    assert not same_global_batches(reseeded_ranks, single, 2)  # the ranks on another seed


# ---------------------------------------------------------------------------------------------------------
# Config and the learning-rate rule.
# ---------------------------------------------------------------------------------------------------------


def test_shipped_config_sweeps_the_per_rank_batch_at_equal_global_batches() -> None:
    cfg = load_compare_config(ROOT / "configs" / "compare.yaml")
    assert (cfg.nproc, cfg.batch_sizes, cfg.dropout, cfg.head_bn) == (4, [1, 2, 4, 8, 16], 0.0, True)
    assert len(cfg.seeds) >= 3
    # The rule, by hand: 0.1 x sqrt(global batch / 64) at global batches 4, 8, 16, 32, 64.
    expected_lr = {1: 0.025, 2: 0.1 / 8**0.5, 4: 0.05, 8: 0.1 / 2**0.5, 16: 0.1}
    for b in cfg.batch_sizes:
        resolved = {
            mode: load_digits_config(cfg.train_config, run_overrides(cfg, mode, b, cfg.seeds[0])) for mode in MODES
        }
        assert [resolved[m].data.batch_size * run_nproc(cfg, m) for m in MODES] == [4 * b] * 3
        assert [resolved[m].model.sync_bn for m in MODES] == [False, True, False]
        for mode, c in resolved.items():
            assert c.train.lr == pytest.approx(expected_lr[b], rel=1e-12), (b, mode)  # float rounding only
            # BatchNorm1d in the head except at 1 image per rank, where plain BatchNorm1d cannot train.
            assert (c.model.head_bn, c.model.dropout, c.train.epochs, c.seed) == (b > 1, 0.0, cfg.epochs, 0)
        # Everything but the output directory, the split of the batch and the sync is the same in the three runs.
        for c in resolved.values():
            c.output_dir, c.data.batch_size, c.model.sync_bn = "", 0, False
        assert len({repr(c) for c in resolved.values()}) == 1, b


def test_shipped_config_header_commands_run_it(monkeypatch: pytest.MonkeyPatch) -> None:
    path = ROOT / "configs" / "compare.yaml"
    commands = header_commands(path, "launch.compare.run")
    assert len(commands) >= 2, "the header gives no launch command or no override example"
    monkeypatch.chdir(ROOT)  # the commands run from the repository root
    for argv in commands:
        module = argv.index("launch.compare.run")
        assert Path(argv[module - 2]).name.startswith("python") and argv[module - 1] == "-m", argv
        args = argument_parser("compare").parse_args(argv[module + 1 :])  # no --set: KEY=VALUE overrides
        assert args.config == "configs/compare.yaml", argv
        cfg = load_compare_config(args.config, args.overrides)  # valid keys and values
        for key, value in (override.split("=", 1) for override in args.overrides):
            assert getattr(cfg, key) == yaml.safe_load(value), f"{argv}: {key}"  # values are parsed as YAML


@pytest.mark.parametrize(("scaling", "lr"), [("sqrt", 0.05), ("linear", 0.025), ("constant", 0.1)])
def test_learning_rate_rule(scaling: str, lr: float) -> None:
    cfg = load_compare_config(None, ["lr=0.1", "lr_batch=64", f"lr_scaling={scaling}"])
    assert learning_rate(cfg, 16) == pytest.approx(lr, rel=1e-12)  # float rounding only
    assert learning_rate(cfg, 64) == pytest.approx(0.1, rel=1e-12)


def test_spread_over_seeds() -> None:
    s = spread([0.5, 0.9, 0.7])
    assert s["mean"] == pytest.approx(0.7) and s["std"] == pytest.approx(0.2)  # sample std (n - 1) of 0.5, 0.7, 0.9
    assert (s["min"], s["max"], s["n"]) == (0.5, 0.9, 3)
    assert spread([0.4])["std"] == 0.0
    assert mean_pm(s, True) == "70.0 ± 20.0 %"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("epoch=3", "unknown config key 'epoch'"),
        ("nproc=0", "config key 'nproc': expected a value > 0"),
        ("dropout=1", "config key 'dropout'"),
        ("device=tpu", "config key 'device'"),
        ("batch_sizes=[]", "config key 'batch_sizes'"),
        ("batch_sizes=[0, 2]", "config key 'batch_sizes'"),
        ("seeds=[1, 1]", "config key 'seeds'"),
        ("lr_scaling=cubic", "config key 'lr_scaling'"),
        ("head_bn=1", "config key 'head_bn': expected bool"),
        ("train_overrides=[model.sync_bn=true]", "config key 'train_overrides': 'model.sync_bn'"),
        ("train_overrides=[model.widht=8]", "unknown config key 'model.widht'"),  # checked on the digits config
    ],
)
def test_bad_config_fails_before_anything_runs(tmp_path: Path, override: str, message: str, capsys) -> None:
    args = ["--config", str(ROOT / "configs" / "compare.yaml"), override]
    assert run.main([*args, f"output_dir={tmp_path / 'out'}"]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------
# The whole command, tiny.
# ---------------------------------------------------------------------------------------------------------


def _command_config(command: str, world_size: int) -> DigitsConfig:
    """The digits config that a recorded ``python``/``torchrun ... -m launch.digits.train ...`` command builds."""
    words = shlex.split(command)
    launcher = ["python"] if world_size == 1 else ["torchrun", "--standalone", f"--nproc_per_node={world_size}"]
    assert words[: len(launcher) + 2] == [*launcher, "-m", "launch.digits.train"], command
    args = argument_parser("digits").parse_args(words[len(launcher) + 2 :])
    return load_digits_config(args.config, args.overrides)


@pytest.mark.slow
@pytest.mark.distributed
def test_compare_sweep_writes_every_run_figure_and_summary(tmp_path: Path) -> None:
    # The sweep's plumbing on a tiny setting: 2 ranks x 1 and 4 images, 2 seeds, 1 epoch on 179 training images.
    out, report = tmp_path / "out", tmp_path / "report"
    sets = ["nproc=2", "batch_sizes=[1, 4]", "seeds=[0, 1]", "epochs=1", "train_overrides=[data.test_fraction=0.9]"]
    sets += ["equivalence_steps=2", f"output_dir={out}", f"report_dir={report}"]
    readme = tmp_path / "README.md"  # not the repository's: the sweep rewrites this file's compare table
    readme.write_text(
        "intro\n<!-- compare table: generated by make compare -->\nold\n<!-- end compare table -->\nend\n"
    )
    sets.append(f"readme={readme}")
    command = [sys.executable, "-m", "launch.compare.run", "--config", "configs/compare.yaml", *sets]
    env = env_outside_torchrun()
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"compare failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    assert sorted(p.name for p in report.iterdir()) == ["compare.json", "compare.md", "compare.png"]
    progress = ("2 ranks", "1/rank plain_bn seed 0", "4/rank sync_bn seed 1", "1 process", "4/rank single_bn seed 1")
    for postfix in progress:
        assert postfix in proc.stderr  # the progress bars name the run in progress

    result = json.loads((report / "compare.json").read_text())
    text = (report / "compare.md").read_text()
    table = "\n".join(accuracy_table(result)) + "\n"
    assert table in text and read_section(readme, README_SECTION) == table  # the README gets compare.md's table
    assert readme.read_text().startswith("intro\n") and readme.read_text().endswith("\nend\n")
    assert [p["batch_size"] for p in result["points"]] == [1, 4]
    for point in result["points"]:
        b = point["batch_size"]
        lr = 0.1 * (2 * b / 64) ** 0.5  # configs/compare.yaml's rule at global batch 2b
        assert point["global_batch_size"] == 2 * b and point["lr"] == pytest.approx(lr, rel=1e-12)
        assert point["same_global_batches"] is True and point["head_bn"] is (b > 1)
        for mode, world_size, transport in (("plain_bn", 2, []), ("sync_bn", 2, ["distributed"]), ("single_bn", 1, [])):
            runs = point["runs"][mode]
            assert [r["seed"] for r in runs] == [0, 1]
            for r in runs:  # every number is the run's own, as the digits job wrote it
                metrics = json.loads((out / f"b{b}" / mode / f"seed{r['seed']}" / "metrics.json").read_text())
                assert r["final_test_acc"] == metrics["final_test_acc"] == metrics["epochs"][-1]["test_acc"]
                assert r["final_loss"] == metrics["epochs"][-1]["loss"]
                assert (r["world_size"], r["global_batch_size"], r["bn_transport"]) == (world_size, 2 * b, transport)
                assert r["lr"] == pytest.approx(lr, rel=1e-12)  # the same rule for the three modes
                assert r["wall_time_s"] > 0 and f" seed={r['seed']} " in r["command"]
                run_path = out / f"b{b}" / mode / f"seed{r['seed']}" / "config.yaml"
                # The recorded command builds the config the run wrote (its resolved config).
                assert load_digits_config(run_path) == _command_config(r["command"], world_size)
                run_config = yaml.safe_load(run_path.read_text())
                assert run_config["model"]["head_bn"] is (b > 1)  # no BatchNorm1d head at 1 image per rank
            acc = [r["final_test_acc"] for r in runs]
            mean, std = sum(acc) / 2, abs(acc[0] - acc[1]) / 2**0.5  # the sample std of two values
            assert point["final_test_acc"][mode]["mean"] == pytest.approx(mean, abs=1e-12)  # rounding only
            assert point["final_test_acc"][mode]["std"] == pytest.approx(std, abs=1e-12)
        cells = [mean_pm(point["final_test_acc"][m], True) for m in MODES]
        assert f"| {b if b > 1 else '1*'} | " + " | ".join(cells) + " |" in text  # * : no BatchNorm1d head

    assert sorted(result["equivalence"]) == ["float32", "float64"]
    for dtype, bound in (("float32", 1e-5), ("float64", 1e-12)):
        eq = result["equivalence"][dtype]
        assert (eq["world_size"], eq["batch_size"], eq["steps"], eq["dtype"]) == (2, 4, 2, dtype)
        # Rounding only, over 2 steps (see test_syncbn_on_ranks_trains_like_batchnorm_on_the_global_batch).
        assert max(eq["loss"]) < bound and max(eq["params"]) < bound and max(eq["running_stats"]) < 100 * bound
    assert f"parameters {max(result['equivalence']['float64']['params']):.1g}" in text
    assert "![compare](compare.png)" in text

    image = matplotlib.image.imread(report / "compare.png")
    assert image.ndim == 3 and image.shape[0] > 500 and image.shape[1] > 800
    assert image[..., :3].std() > 0.05  # not a blank canvas
