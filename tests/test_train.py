"""Tests of the digits training job, launch.digits.train.

Config validation runs in-process. The job itself runs for one epoch as a real subprocess: under
``torch.distributed.run`` with 2 gloo processes (DDP + synchronized BatchNorm), and in one process through
DataParallelWithCallback with 2 CPU thread replicas. The cross-rank state check runs on a real gloo group
through ``launch/common/spawn.py``.
"""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from config_headers import header_commands
from torch.distributed.run import get_args_parser

from launch.common.config import ConfigError, parse_config
from launch.common.spawn import run_distributed
from launch.common.torchrun import env_outside_torchrun
from launch.digits import train
from launch.digits.config import DigitsConfig, ModelConfig, TrainConfig, check_launch, load_digits_config
from launch.digits.data import load_data
from launch.digits.loop import check_same_on_all_ranks, evaluate, show_progress_bar
from launch.digits.model import DigitsNet

# Left out of make test-quick (docs/testing.md, "The quick tier"): the digits recipe (make train).
pytestmark = pytest.mark.plumbing

ROOT = Path(__file__).resolve().parents[1]
# The digits split the configs use: 1,797 images, a 0.2 test fraction (sklearn rounds the test size up).
NUM_TRAIN = 1797 - math.ceil(0.2 * 1797)


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------------------------------------
# Config.
# ---------------------------------------------------------------------------------------------------------


def _overrides(args: list[str]) -> list[str]:
    """The ``KEY=VALUE`` overrides among a command's arguments (``--config PATH`` is the only flag)."""
    return [arg for i, arg in enumerate(args) if "=" in arg and not arg.startswith("-") and args[i - 1] != "--config"]


@pytest.mark.parametrize(
    ("name", "parallel"), [("digits.yaml", "ddp"), ("digits_dp.yaml", "dataparallel"), ("digits_multinode.yaml", "ddp")]
)
def test_shipped_configs_load_and_their_header_commands_run_them(
    name: str, parallel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = ROOT / "configs" / name
    cfg = load_digits_config(path)
    assert cfg.parallel == parallel
    assert cfg.data.batch_size == 16  # the small per-BatchNorm batch where synchronization matters
    assert cfg.resume is False  # a shipped config never resumes by accident

    # The header's commands, parsed the way torchrun and the job parse them, from the repository root.
    monkeypatch.chdir(ROOT)
    launched = overridden = 0
    for argv in header_commands(path, "launch.digits.train"):
        module = argv.index("launch.digits.train")
        script_args = argv[module + 1 :]
        overrides = _overrides(script_args)
        plain = [arg for arg in script_args if arg not in overrides]
        assert parse_config(DigitsConfig, plain, "") == cfg, argv  # it names this config
        documented = parse_config(DigitsConfig, script_args, "")  # and its overrides are valid keys and values
        for key, value in (arg.split("=", 1) for arg in overrides):
            node = documented
            for part in key.split("."):
                node = getattr(node, part)
            assert node == yaml.safe_load(value), f"{argv}: {key}"  # values are parsed as YAML
            overridden += 1
        runners = [i for i, arg in enumerate(argv[: module - 1]) if Path(arg).name in ("torchrun", "python", "python3")]
        if not runners:  # an override example that elides the launcher ("... -m launch.digits.train")
            continue
        launched += 1
        if Path(argv[runners[-1]]).name != "torchrun":
            assert parallel == "dataparallel", argv  # one process; DDP needs a rank per process
            continue
        assert parallel == "ddp", argv  # the job refuses dataparallel under torchrun
        run = get_args_parser().parse_args(argv[runners[-1] + 1 :])
        assert run.module and run.training_script == "launch.digits.train", argv
        assert run.training_script_args == script_args, argv
        nodes = int(str(run.nnodes).split(":")[-1])
        assert nodes * int(run.nproc_per_node) == 2, argv  # the 2 ranks every shipped DDP config is sized for
        if nodes == 1:
            assert run.standalone, argv  # a private local rendezvous on a free port
        else:
            assert run.rdzv_backend == "c10d" and run.rdzv_endpoint and run.rdzv_id, argv  # where the nodes meet
    assert launched >= 1, "the header gives no launch command"
    assert overridden >= 1, "the header gives no KEY=VALUE override example"


def test_yaml_and_overrides_layer_over_typed_defaults(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "seed: 3\ntrain:\n  lr: 1\n  epochs: 7\n")
    cfg = load_digits_config(path, ["train.epochs=2", "data.batch_size=8", "progress_bar=false"])
    assert (cfg.seed, cfg.train.epochs, cfg.data.batch_size, cfg.progress_bar) == (3, 2, 8, False)
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)  # YAML's 1 accepted for a float key
    assert cfg.train.momentum == TrainConfig().momentum  # untouched keys keep their defaults
    assert load_digits_config(None) == DigitsConfig()


def test_floats_in_exponent_form_read_as_floats(tmp_path: Path) -> None:
    # PyYAML alone reads 1e-3 as a string; OmegaConf's loader and override grammar read it as a float.
    cfg = load_digits_config(_yaml(tmp_path, "train:\n  lr: 1e-3\n"), ["train.weight_decay=5e-4"])
    assert (cfg.train.lr, cfg.train.weight_decay) == (1e-3, 5e-4)


@pytest.mark.parametrize(
    ("text", "overrides", "fragments"),
    [
        ("data:\n  batch_sise: 8\n", [], ["unknown config key 'data.batch_sise'"]),
        ("lr: 0.1\n", [], ["unknown config key 'lr'"]),
        ("", ["train.epoch=1"], ["unknown config key 'train.epoch'"]),
        ("train:\n  epochs: ten\n", [], ["'train.epochs'", "expected int", "str"]),
        ("train:\n  epochs: true\n", [], ["'train.epochs'", "expected int", "bool"]),
        ("parallel: horovod\n", [], ["'parallel'", "'ddp' | 'dataparallel'"]),
        ("data: 16\n", [], ["data", "expected a mapping"]),
        ("data:\n  batch_size: 0\n", [], ["'data.batch_size'", "> 0", "got 0"]),
        ("", ["data.batch_size=-4"], ["'data.batch_size'", "> 0"]),
        ("train:\n  lr: -0.1\n", [], ["'train.lr'", ">= 0", "-0.1"]),
        ("train:\n  epochs: 0\n", [], ["'train.epochs'", "> 0"]),
        ("timeout_s: 0\n", [], ["'timeout_s'", "> 0", "got 0"]),
        ("resume: 1\n", [], ["'resume'", "expected bool", "int"]),
        ("progress_bar: sometimes\n", [], ["'progress_bar'", "true, false or 'auto'", "'sometimes'"]),
        ("progress_bar: 1\n", [], ["'progress_bar'", "expected bool | str", "int"]),
        ("train:\n  checkpoint_every_steps: -1\n", [], ["'train.checkpoint_every_steps'", ">= 0"]),
        ("", ["resume=yes please"], ["'resume'", "expected bool", "str"]),
        ("data:\n  test_fraction: 1.0\n", [], ["'data.test_fraction'", "in (0, 1)"]),
        ("", ["train.epochs"], ["expected KEY=VALUE"]),
        ("- a\n- b\n", [], ["expected a mapping"]),
    ],
)
def test_bad_config_is_rejected_naming_the_key(
    tmp_path: Path, text: str, overrides: list[str], fragments: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        load_digits_config(_yaml(tmp_path, text), overrides)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    "overrides",
    [["parallel=dataparallel"], ["train.checkpoint_every_steps=5"]],
    ids=["dataparallel", "step-checkpoints"],
)
def test_uneven_shards_need_ddp_and_no_checkpoint_inside_the_epoch(overrides: list[str]) -> None:
    cfg = load_digits_config(None, ["data.uneven_shards=true", *overrides])
    with pytest.raises(ConfigError, match="'data.uneven_shards'"):
        check_launch(cfg, env={"WORLD_SIZE": "1"})
    check_launch(load_digits_config(None, overrides), env={"WORLD_SIZE": "1"})  # fine with even shards


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_auto_is_on_only_for_a_terminal() -> None:
    assert DigitsConfig().progress_bar == "auto"
    assert show_progress_bar("auto", _Terminal()) and not show_progress_bar("auto", io.StringIO())
    assert show_progress_bar(True, io.StringIO()) and not show_progress_bar(False, _Terminal())


def test_missing_config_file_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=f"config file not found: {missing}"):
        load_digits_config(missing)


@pytest.mark.parametrize(
    ("text", "extra_args", "world_size", "fragment"),
    [
        ("model:\n  widht: 8\n", [], "1", "'model.widht'"),
        ("train:\n  epochs: 1.5\n", [], "1", "'train.epochs'"),
        ("data:\n  batch_size: 0\n", [], "1", "'data.batch_size'"),
        ("train:\n  lr: -1.0\n", [], "1", "'train.lr'"),
        (None, [], "1", "config file not found"),
        ("parallel: dataparallel\n", [], "2", "'parallel'"),  # one-process mode under a multi-process torchrun
    ],
)
def test_main_fails_fast_before_any_process_group(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    text: str | None,
    extra_args: list[str],
    world_size: str,
    fragment: str,
) -> None:
    # The environment torchrun gives a worker, so main would start a process group if it got that far.
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": world_size}.items():
        monkeypatch.setenv(key, value)

    def no_group(cfg: Any) -> None:
        raise AssertionError("init_distributed was called before the config was rejected")

    monkeypatch.setattr(train, "init_distributed", no_group)
    path = _yaml(tmp_path, text) if text is not None else tmp_path / "missing.yaml"
    monkeypatch.setattr(sys, "argv", ["train.py", "--config", str(path), *extra_args])
    assert train.main() == 2
    assert fragment in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# The model.
# ---------------------------------------------------------------------------------------------------------


def test_head_without_batchnorm_trains_on_one_image() -> None:
    one_image = torch.randn(1, 1, 8, 8)
    with_bn = DigitsNet(load_digits_config(None, ["model.width=4"]).model).train()
    with pytest.raises(ValueError, match="more than 1 value per channel"):  # torch's BatchNorm1d on (1, C)
        with_bn(one_image)
    assert any(isinstance(m, torch.nn.BatchNorm1d) for m in with_bn.modules())
    net = DigitsNet(load_digits_config(None, ["model.width=4", "model.head_bn=false"]).model).train()
    assert not any(isinstance(m, torch.nn.BatchNorm1d) for m in net.modules())
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in net.modules()) == 3  # the conv blocks keep theirs
    hidden = net.head[1]
    assert hidden.bias is not None  # no BatchNorm shift after it: the Linear needs its own bias
    net(one_image).sum().backward()
    assert hidden.weight.grad is not None and hidden.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------------------
# The cross-rank check, on a real gloo group.
# ---------------------------------------------------------------------------------------------------------


def _check_worker(rank: int, world_size: int) -> list[str]:
    torch.manual_seed(0)
    net = DigitsNet(ModelConfig(width=4))
    check_same_on_all_ranks(net)  # identical: passes
    messages = []
    for name in ("features.0.1.running_var", "head.2.num_batches_tracked", "head.5.weight"):
        tensor = net.state_dict()[name]
        saved = tensor.clone()
        if rank == 1:
            tensor.view(-1)[0] += 1  # one element of one tensor differs on one rank
        try:
            check_same_on_all_ranks(net)
        except RuntimeError as error:
            messages.append(str(error))
        else:
            messages.append("no error")
        tensor.copy_(saved)
    check_same_on_all_ranks(net)  # restored: passes again
    return messages


@pytest.mark.distributed
def test_check_same_on_all_ranks_detects_a_differing_running_stat_on_every_rank() -> None:
    results = run_distributed(_check_worker, 2)
    names = ("features.0.1.running_var", "head.2.num_batches_tracked", "head.5.weight")
    for messages in results:  # every rank raises, so no rank is left waiting in a later collective
        for name, message in zip(names, messages):
            assert "differs across ranks" in message and name in message and "rank 1" in message
            assert "1 tensor(s)" in message  # only the changed tensor is reported


# ---------------------------------------------------------------------------------------------------------
# The job, one epoch, as a real subprocess.
# ---------------------------------------------------------------------------------------------------------


def _run_job(
    launcher: list[str], config: str, out: Path, overrides: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    env = env_outside_torchrun(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")  # CPU paths, whatever the machine
    args = ["--config", config, "train.epochs=1", f"output_dir={out}", *overrides]
    proc = subprocess.run(
        [*launcher, "-m", "launch.digits.train", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, f"training failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    # The shipped configs' progress_bar: auto, and stderr is a pipe here as in a cluster's log file: no tqdm frames,
    # the per-epoch log line instead.
    assert load_digits_config(ROOT / config).progress_bar == "auto"
    assert "\r" not in proc.stderr and "it/s" not in proc.stderr, proc.stderr[-2000:]
    assert "epoch 1/1 loss" in proc.stderr, proc.stderr[-2000:]
    return proc


def _check_outputs(out: Path, steps_per_epoch: int, transport: str) -> None:
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pt", "config.yaml", "metrics.json"]  # no temp files

    cfg = load_digits_config(out / "config.yaml")  # the resolved config reloads as a valid config
    assert cfg.train.epochs == 1 and cfg.output_dir == str(out)

    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps_per_epoch"] == steps_per_epoch
    assert metrics["bn_transport"] == [transport]  # BatchNorm really synchronized, and how
    (row,) = metrics["epochs"]
    assert row["epoch"] == 1 and row["epoch_time_s"] > 0
    assert math.isfinite(row["loss"]) and 0 < row["loss"] < math.log(10)  # below a uniform guess's loss
    assert 0 <= row["train_acc"] <= 1
    assert 0.5 < row["test_acc"] <= 1  # chance is 0.1; one epoch of SGD with BatchNorm is far above it
    assert metrics["final_test_acc"] == row["test_acc"]

    checkpoint = torch.load(out / "checkpoint.pt", weights_only=True)
    assert checkpoint["epoch"] == 1 and checkpoint["config"]["train"]["epochs"] == 1
    net = DigitsNet(cfg.model)  # plain BatchNorm: the synchronized layers' state_dict keys are the same
    net.load_state_dict(checkpoint["model"])
    bns = [m for m in net.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert len(bns) == 4
    for bn in bns:
        assert torch.isfinite(bn.running_mean).all() and torch.isfinite(bn.running_var).all()
        assert (bn.running_var > 0).all() and not torch.equal(bn.running_var, torch.ones_like(bn.running_var))
        assert bn.num_batches_tracked.item() == steps_per_epoch  # once per step, on the global batch

    # The checkpoint is the model that was evaluated: it reproduces the logged test accuracy.
    _, test_set = load_data(cfg.data)
    loader = torch.utils.data.DataLoader(test_set, batch_size=512)
    assert evaluate(net, loader, torch.device("cpu")) == row["test_acc"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven-shards"])
def test_ddp_job_one_epoch_under_torchrun(tmp_path: Path, uneven: bool) -> None:
    """With ``data.uneven_shards`` rank 1 runs one step fewer, under Join; the job's own end-of-epoch check that
    every rank holds the same parameters and buffers (check_same_on_all_ranks) passes, so the rank that joined
    kept its running statistics exactly."""
    out = tmp_path / "ddp"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    _run_job(torchrun, "configs/digits.yaml", out, (f"data.uneven_shards={str(uneven).lower()}",))
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["global_batch_size"] == 32
    # DistributedSampler(drop_last=True): disjoint equal shards of floor(1437 / 2); full batches of 16. Rank 0 (which
    # writes the checkpoint) runs all of them with uneven shards too.
    _check_outputs(out, (NUM_TRAIN // 2) // 16, "distributed")
    digests = metrics["state_sha256"]
    assert len(digests) == 2 and digests[0] == digests[1]  # bit-identical parameters and buffers on both ranks


@pytest.mark.slow
def test_dataparallel_job_one_epoch_with_cpu_replicas(tmp_path: Path) -> None:
    out = tmp_path / "dp"
    _run_job([sys.executable], "configs/digits_dp.yaml", out)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 1 and metrics["replicas_per_process"] == 2
    assert metrics["global_batch_size"] == 32
    _check_outputs(out, NUM_TRAIN // 32, "dataparallel")
