"""Reliability of the digits training job, launch.digits.train: checkpoints, stop and resume, a dead rank, multi-node.

In-process: checkpoint contents (``torch.load(weights_only=True)``), refusal of incompatible or unsafe
checkpoints, atomic writes, and a signal at an exact step followed by a resume (one process, and two gloo
ranks through ``launch/common/spawn.py`` with the signal sent to one rank only). As real subprocesses (marked
``slow``): SIGTERM to a 2-process torchrun mid-training then ``resume=true``, SIGKILL of one worker, and two
torchrun "nodes" on loopback against a single-node run.

Reference results always come from an uninterrupted run of the same job with the same seed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from filelock import FileLock

from launch.common.config import parse_config
from launch.common.spawn import run_distributed
from launch.common.torchrun import env_outside_torchrun
from launch.digits import train
from launch.digits.checkpoint import CHECKPOINT_FORMAT, CheckpointError, find_resume_checkpoint
from launch.digits.config import DigitsConfig, load_digits_config
from launch.digits.model import DigitsNet
from launch.digits.runtime import Runtime, launch_id
from launch.digits.stop import StopRequest

# Left out of make test-quick (docs/testing.md, "The quick tier"): the digits recipe's torchrun restarts, SIGTERM and
# multi-node plumbing.
pytestmark = pytest.mark.plumbing

ROOT = Path(__file__).resolve().parents[1]


# Small and quick; the per-BatchNorm batch stays the shipped 16.
QUICK = ["model.width=4", "train.epochs=2", "progress_bar=false"]


def _cfg(out: Path, *overrides: str) -> Any:
    return load_digits_config(ROOT / "configs" / "digits.yaml", [*QUICK, f"output_dir={out}", *overrides])


def _metrics(out: Path) -> dict[str, Any]:
    return json.loads((out / "metrics.json").read_text())


def _checkpoint(out: Path) -> dict[str, Any]:
    return torch.load(out / "checkpoint.pt", weights_only=True)


def _assert_same_training(resumed: Path, reference: Path) -> None:
    """The resumed run's per-epoch metrics and final model equal the uninterrupted run's.

    Same batches, dropout masks and summation order make them bit-identical on CPU; the tolerance is
    float32 rounding, room for a reduction order that differs after a restart (e.g. DDP rebuilding its
    buckets with more than two ranks). A lost or repeated step, or a wrong RNG state, moves the loss and
    the weights by orders of magnitude more.
    """
    got, want = _metrics(resumed), _metrics(reference)
    assert [row["epoch"] for row in got["epochs"]] == [row["epoch"] for row in want["epochs"]]  # none lost/repeated
    for key in ("lr", "loss", "train_acc", "test_acc"):
        torch.testing.assert_close(
            [row[key] for row in got["epochs"]], [row[key] for row in want["epochs"]], rtol=1e-6, atol=1e-7
        )
    assert got["final_test_acc"] == want["final_test_acc"]  # counts of correct test images: exact
    got_state, want_state = _checkpoint(resumed)["model"], _checkpoint(reference)["model"]
    assert got_state.keys() == want_state.keys()
    for name in want_state:
        # num_batches_tracked counts the steps: exact, so a lost or repeated step fails here first.
        torch.testing.assert_close(got_state[name], want_state[name], rtol=1e-6, atol=1e-7, msg=name)


class _Forward:
    """Patches DigitsNet.forward to run ``action()`` during the n-th training-mode forward (1-based)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, n: int, action: Callable[[], None]) -> None:
        self.calls, original = 0, DigitsNet.forward

        def forward(net: Any, x: torch.Tensor) -> torch.Tensor:
            if net.training:
                self.calls += 1
                if self.calls == n:
                    action()
            return original(net, x)

        monkeypatch.setattr(DigitsNet, "forward", forward)


# ---------------------------------------------------------------------------------------------------------
# One process, in-process: checkpoint contents, refusals, and a signal at an exact step.
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Any:
    """One intra-op thread, as under torchrun: on a busy 2-core machine more make these runs ~30x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted one-process run of the quick config; its output_dir."""
    out = tmp_path_factory.mktemp("reference")
    assert train.main(_cfg(out)) == 0
    return out


def test_checkpoint_holds_everything_to_resume_and_loads_weights_only(reference_run: Path) -> None:
    checkpoint = _checkpoint(reference_run)  # weights_only=True: tensors and plain containers only
    cfg = _cfg(reference_run)
    metrics = _metrics(reference_run)
    assert checkpoint["format"] == CHECKPOINT_FORMAT
    assert checkpoint["config"] == dataclasses.asdict(cfg)
    assert (checkpoint["epoch"], checkpoint["step"], checkpoint["sampler_epoch"]) == (2, 0, 3)  # 2 epochs done
    assert checkpoint["world_size"] == 1 and checkpoint["replicas_per_process"] == 1
    rng = checkpoint["rng"]["torch"]
    assert rng.dtype == torch.uint8 and rng.shape == (1, torch.get_rng_state().numel())
    assert checkpoint["epoch_sums"].tolist() == [[0.0, 0.0, 0.0]]  # nothing of epoch 3 yet
    assert checkpoint["metrics"]["epochs"] == metrics["epochs"]
    # The learning rate is a function of the position: the optimizer's groups hold the base (initial_lr) and the
    # cosine's value for the next epoch, 2 of 2 (0 up to rounding).
    (group,) = checkpoint["optimizer"]["param_groups"]
    assert group["initial_lr"] == cfg.train.lr
    assert group["lr"] == cfg.train.lr * (1 + math.cos(math.pi * 2 / cfg.train.epochs)) / 2
    momentum = [s["momentum_buffer"] for s in checkpoint["optimizer"]["state"].values()]
    assert momentum and all(torch.isfinite(m).all() and m.abs().sum() > 0 for m in momentum)
    net = DigitsNet(cfg.model)
    net.load_state_dict(checkpoint["model"])
    steps = metrics["steps_per_epoch"]
    assert all(b.item() == 2 * steps for n, b in net.named_buffers() if n.endswith("num_batches_tracked"))
    # The RNG state is the one after the last dropout draw: restoring it continues the same stream.
    assert not torch.equal(rng[0], torch.manual_seed(cfg.seed).get_state())


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_at_the_next_step_and_resume_equals_the_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference_run: Path, signum: signal.Signals
) -> None:
    steps = _metrics(reference_run)["steps_per_epoch"]
    unhandled: list[int] = []

    def fallback(signum: int, frame: Any) -> None:
        unhandled.append(signum)

    previous = {s: signal.signal(s, fallback) for s in StopRequest.SIGNALS}
    try:
        # The signal arrives during the 8th step of epoch 2; that step completes, then the job stops.
        _Forward(monkeypatch, steps + 8, lambda: os.kill(os.getpid(), signum))
        assert train.main(_cfg(tmp_path)) == 0
        assert signal.getsignal(signum) is fallback  # the job restored the handlers it replaced
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    assert unhandled == []  # the job's handler, not the test's fallback, got the signal

    checkpoint = _checkpoint(tmp_path)
    assert (checkpoint["epoch"], checkpoint["step"], checkpoint["sampler_epoch"]) == (1, 8, 2)
    assert checkpoint["epoch_sums"][0, 2].item() == 8 * 16  # samples seen in epoch 2 so far
    assert _metrics(tmp_path)["stopped_at"] == {"epoch": 1, "step": 8, "signal": signum.name}
    tracked = checkpoint["model"]["head.2.num_batches_tracked"].item()
    assert tracked == steps + 8

    monkeypatch.undo()
    assert train.main(_cfg(tmp_path, "resume=true")) == 0
    _assert_same_training(tmp_path, reference_run)
    resumed = _metrics(tmp_path)
    assert resumed["resumed_from"] == [{"epoch": 1, "step": 8}] and "stopped_at" not in resumed


def test_checkpoint_is_written_atomically_every_epoch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference_run: Path
) -> None:
    # Epoch 1's checkpoint is written; epoch 2's save dies half-way through writing.
    real_save = torch.save
    saves = []

    def save(obj: Any, f: Any) -> None:
        saves.append(obj["epoch"])
        if len(saves) == 2:
            f.write(b"partial")
            raise OSError("disk full")
        real_save(obj, f)

    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(OSError, match="disk full"):
        train.main(_cfg(tmp_path))
    assert saves == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt", "config.yaml", "metrics.json"]  # no temp
    assert _checkpoint(tmp_path)["epoch"] == 1  # the previous checkpoint, intact
    assert [row["epoch"] for row in _metrics(tmp_path)["epochs"]] == [1]


def test_checkpoint_every_steps_writes_mid_epoch_checkpoints_that_resume_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference_run: Path
) -> None:
    steps, every = _metrics(reference_run)["steps_per_epoch"], 30
    real_save, written = train.save_checkpoint, []

    def save(path: Path, *args: Any) -> None:
        real_save(path, *args)
        checkpoint = torch.load(path, weights_only=True)
        written.append((checkpoint["epoch"], checkpoint["step"]))
        if len(written) == 4:  # 30 steps into epoch 2: kept to resume from below
            (tmp_path / "mid_epoch").mkdir()
            (tmp_path / "mid_epoch" / "checkpoint.pt").write_bytes(path.read_bytes())

    monkeypatch.setattr(train, "save_checkpoint", save)
    assert train.main(_cfg(tmp_path / "run", f"train.checkpoint_every_steps={every}")) == 0
    # Every 30 steps inside an epoch, none at its last step (the epoch's own checkpoint follows), then the epoch's.
    within = [(epoch, step) for step in range(every, steps, every) for epoch in (0, 1)]
    assert sorted(written) == sorted([*within, (1, 0), (2, 0)]) and written[3] == (1, every)
    _assert_same_training(tmp_path / "run", reference_run)  # checkpointing changes nothing

    monkeypatch.undo()
    assert train.main(_cfg(tmp_path / "mid_epoch", "resume=true")) == 0
    _assert_same_training(tmp_path / "mid_epoch", reference_run)
    assert _metrics(tmp_path / "mid_epoch")["resumed_from"] == [{"epoch": 1, "step": every}]


def test_a_torchrun_restart_resumes_only_its_own_launchs_checkpoint(resumable: Path) -> None:
    checkpoint = _checkpoint(resumable)
    checkpoint["launch_id"] = "job-a"
    torch.save(checkpoint, resumable / "checkpoint.pt")
    fresh = _cfg(resumable)  # resume=false, as make train runs it
    assert find_resume_checkpoint(fresh, 1, launch_id="job-a")["step"] == 3  # a later attempt of the same launch
    assert find_resume_checkpoint(fresh, 1, launch_id="job-b") is None  # another launch's: start afresh
    assert find_resume_checkpoint(fresh, 1, launch_id=None) is None  # not under torchrun
    assert find_resume_checkpoint(_cfg(resumable, "resume=true"), 1, launch_id="job-b")["step"] == 3  # asked for
    (resumable / "checkpoint.pt").write_bytes(b"not a checkpoint")  # unreadable: no attempt of this launch wrote it
    assert find_resume_checkpoint(fresh, 1, launch_id="job-a") is None
    # torchrun's run id: --standalone draws one per launch; "none" is its placeholder without --rdzv_id.
    assert launch_id({"TORCHELASTIC_RUN_ID": "3f2a"}) == "3f2a"
    assert launch_id({"TORCHELASTIC_RUN_ID": "none"}) is None and launch_id({}) is None


# ---------------------------------------------------------------------------------------------------------
# Refusals: incompatible, unsafe, foreign or missing checkpoints.
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def resumable(tmp_path: Path, reference_run: Path) -> Path:
    """A copy of the reference run's checkpoint, edited to say it stopped 3 steps into epoch 2 (for refusals)."""
    checkpoint = _checkpoint(reference_run)
    checkpoint["epoch"], checkpoint["step"], checkpoint["sampler_epoch"] = 1, 3, 2
    torch.save(checkpoint, tmp_path / "checkpoint.pt")
    return tmp_path


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (["model.width=8"], ["model.width: 4 in the checkpoint, 8 now"]),
        (["seed=1"], ["seed: 0 in the checkpoint, 1 now"]),
        (["data.batch_size=8", "train.lr=0.2"], ["2 key(s)", "data.batch_size: 16", "train.lr: 0.1"]),
        (["parallel=dataparallel"], ["parallel: 'ddp' in the checkpoint, 'dataparallel' now"]),
        (["model.sync_bn=false"], ["model.sync_bn: True in the checkpoint, False now"]),
        (["train.epochs=1"], ["at epoch 1 (+3 steps), past train.epochs=1"]),
    ],
)
def test_incompatible_checkpoint_is_refused_before_any_process_group(
    resumable: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    overrides: list[str],
    fragments: list[str],
) -> None:
    cfg = _cfg(resumable, "resume=true", *overrides)
    with pytest.raises(CheckpointError) as info:
        find_resume_checkpoint(cfg, world_size=1)
    for fragment in fragments:
        assert fragment in str(info.value)

    def no_group(cfg: Any) -> None:
        raise AssertionError("init_distributed was called before the checkpoint was refused")

    monkeypatch.setattr(train, "init_distributed", no_group)
    assert train.main(cfg) == 2
    assert str(info.value) in capsys.readouterr().err


def test_world_size_must_match_the_checkpoint(resumable: Path) -> None:
    with pytest.raises(CheckpointError, match=r"written by 1 process\(es\), this run has 2"):
        find_resume_checkpoint(_cfg(resumable, "resume=true"), world_size=2)


def test_keys_that_do_not_change_a_step_may_change_on_resume(resumable: Path, tmp_path_factory: Any) -> None:
    cfg = _cfg(resumable, "resume=true", "train.epochs=5", "timeout_s=10.0", "data.eval_batch_size=7")
    assert find_resume_checkpoint(cfg, world_size=1)["epoch"] == 1
    # Copied elsewhere: output_dir differs from the one in the checkpoint's config.
    moved = tmp_path_factory.mktemp("moved")
    (moved / "checkpoint.pt").write_bytes((resumable / "checkpoint.pt").read_bytes())
    assert find_resume_checkpoint(_cfg(moved, "resume=true"), world_size=1)["epoch"] == 1
    assert find_resume_checkpoint(_cfg(resumable), world_size=1) is None  # resume is off


def test_extending_a_finished_run_continues_on_the_longer_cosine(
    tmp_path: Path, reference_run: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "checkpoint.pt").write_bytes((reference_run / "checkpoint.pt").read_bytes())
    with caplog.at_level("INFO", logger="train"):
        assert train.main(_cfg(tmp_path, "resume=true", "train.epochs=3")) == 0
    assert "resuming after epoch 2 + 0 steps" in caplog.text
    rows, reference = _metrics(tmp_path)["epochs"], _metrics(reference_run)["epochs"]
    assert rows[:2] == reference  # carried over from the checkpoint, not retrained
    assert rows[2]["epoch"] == 3
    # Cosine annealing over 3 epochs, after 2 (the 2-epoch schedule has reached lr 0 there).
    assert rows[2]["lr"] == pytest.approx(0.1 * (1 + math.cos(math.pi * 2 / 3)) / 2, rel=1e-12)
    steps = _metrics(reference_run)["steps_per_epoch"]
    assert _checkpoint(tmp_path)["model"]["head.2.num_batches_tracked"].item() == 3 * steps


class _RunsCode:
    """An object whose unpickling would call os.system: what weights_only=True must refuse to do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_checkpoint_that_would_run_code_is_refused_and_the_code_never_runs(
    resumable: Path, tmp_path_factory: Any
) -> None:
    marker = tmp_path_factory.mktemp("marker") / "pwned"
    checkpoint = _checkpoint(resumable)
    checkpoint["metrics"]["payload"] = _RunsCode(marker)
    torch.save(checkpoint, resumable / "checkpoint.pt")
    with pytest.raises(CheckpointError, match=r"weights_only=True"):
        find_resume_checkpoint(_cfg(resumable, "resume=true"), world_size=1)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("corrupt", "fragment"),
    [
        (lambda path: path.write_bytes(path.read_bytes()[:1000]), "cannot load checkpoint"),  # truncated
        (lambda path: torch.save([1, 2], path), "expected a mapping (got list)"),
        (lambda path: torch.save({"model": {}, "epoch": 1}, path), "not a resumable checkpoint"),  # e.g. older format
        (lambda path: _drop(path, "rng"), "no resume state (missing keys: rng)"),
    ],
)
def test_unreadable_or_foreign_checkpoint_is_refused(
    resumable: Path, corrupt: Callable[[Path], None], fragment: str
) -> None:
    corrupt(resumable / "checkpoint.pt")
    with pytest.raises(CheckpointError, match="checkpoint") as info:
        find_resume_checkpoint(_cfg(resumable, "resume=true"), world_size=1)
    assert fragment in str(info.value)


def _drop(path: Path, key: str) -> None:
    checkpoint = torch.load(path, weights_only=True)
    del checkpoint[key]
    torch.save(checkpoint, path)


def test_resume_without_a_checkpoint_starts_afresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, reference_run: Path
) -> None:
    with caplog.at_level("WARNING", logger="train"):
        assert train.main(_cfg(tmp_path, "resume=true")) == 0
    assert "no checkpoint.pt" in caplog.text and "starting afresh" in caplog.text
    _assert_same_training(tmp_path, reference_run)


def test_resume_override_sets_resume() -> None:
    assert parse_config(DigitsConfig, ["resume=true"], "").resume is True
    assert parse_config(DigitsConfig, [], "").resume is False


# ---------------------------------------------------------------------------------------------------------
# Two gloo ranks in-process: a signal reaching one rank only, at an exact step.
# ---------------------------------------------------------------------------------------------------------


def _stop_one_rank_case(runtime: Any, root: str, signal_at: int, sync_bn: str) -> dict[str, Any]:
    import torch.distributed as dist

    def cfg(name: str, *overrides: str) -> Any:
        sets = [*QUICK, f"output_dir={root}/{name}_{sync_bn}", f"model.sync_bn={sync_bn}", *overrides]
        return load_digits_config(ROOT / "configs" / "digits.yaml", sets)

    assert train.run(cfg("reference"), runtime) == 0
    dist.barrier()  # rank 0 writes after the last collective
    original, calls = DigitsNet.forward, [0]

    def forward(net: Any, x: torch.Tensor) -> torch.Tensor:
        if net.training:
            calls[0] += 1
            if runtime.rank == 1 and calls[0] == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)  # rank 1 only: rank 0 must learn of it and stop too
        return original(net, x)

    DigitsNet.forward = forward
    try:
        status = train.run(cfg("stopped"), runtime)
    finally:
        DigitsNet.forward = original
    dist.barrier()
    assert train.run(cfg("stopped", "resume=true"), runtime) == 0
    dist.barrier()
    return {"status": status, "forwards": calls[0]}


def _stop_one_rank_worker(rank: int, world_size: int, root: str, signal_at: int) -> list[dict[str, Any]]:
    runtime = Runtime(rank, world_size, torch.device("cpu"), True)
    # sync_bn false: plain BatchNorm, whose running statistics differ across ranks mid-epoch.
    return [_stop_one_rank_case(runtime, root, signal_at, sync_bn) for sync_bn in ("true", "false")]


@pytest.mark.distributed
def test_signal_to_one_rank_stops_every_rank_at_the_same_step_and_resume_is_exact(tmp_path: Path) -> None:
    steps = (1437 // 2) // 16  # DistributedSampler(drop_last) shards of the 1,437 training images
    signal_at = steps + 5  # rank 1 gets SIGTERM during its 5th step of epoch 2
    # A rank that stopped alone would leave the other in a collective: collective_timeout bounds that hang.
    # Fresh ranks: rank 1 signals itself and the job installs signal handlers.
    results = run_distributed(
        _stop_one_rank_worker, 2, str(tmp_path), signal_at, timeout=240, collective_timeout=30, fresh=True
    )
    for variant, sync_bn in enumerate(("true", "false")):
        assert [r[variant]["status"] for r in results] == [0, 0]  # both stopped cleanly
        assert [r[variant]["forwards"] for r in results] == [signal_at, signal_at]  # after the same step
        stopped = tmp_path / f"stopped_{sync_bn}"
        metrics = _metrics(stopped)
        assert metrics["resumed_from"] == [{"epoch": 1, "step": 5}]
        _assert_same_training(stopped, tmp_path / f"reference_{sync_bn}")
        assert len(set(metrics["state_sha256"])) == 1  # both ranks ended identical


# ---------------------------------------------------------------------------------------------------------
# The job as real subprocesses under torchrun.
# ---------------------------------------------------------------------------------------------------------

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
STANDALONE = [*TORCHRUN, "--standalone", "--nproc_per_node=2"]
JOB = ["model.width=8", "train.epochs=3", "progress_bar=false"]


@pytest.mark.distributed
def test_jobs_started_by_tests_inherit_nothing_from_torchrun() -> None:
    # The environment torchrun really gives a worker (printed by the worker itself), against the one it started
    # from: what env_outside_torchrun (the env of every job above and below) keeps must not include any of it.
    outer = env_outside_torchrun(OMP_NUM_THREADS="1")
    done = subprocess.run(
        [*TORCHRUN, "--standalone", "--nproc_per_node=1", "--no-python", "env", "-0"],  # NUL-separated
        env=outer,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    worker = dict(entry.split("=", 1) for entry in done.stdout.split("\0") if "=" in entry)
    added = {key for key in worker if key not in outer}
    assert {"RANK", "WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RUN_ID"} <= added  # it did run under torchrun
    leaked = added & set(env_outside_torchrun(worker))
    assert not leaked, leaked


class _Job:
    """One torchrun invocation of launch.digits.train, its output in ``log``; killed with its workers on close."""

    def __init__(
        self, launcher: list[str], out: Path, *overrides: str, log: str = ""
    ) -> None:
        self.out, self.log = out, out.parent / f"{log or out.name}.log"
        sets = [*JOB, f"output_dir={out}", *overrides]
        with open(self.log, "w") as log_file:
            self.proc = subprocess.Popen(
                [*launcher, "-m", "launch.digits.train", "--config", "configs/digits.yaml", *sets],
                cwd=ROOT,
                env=env_outside_torchrun(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""),  # CPU paths, on any machine
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )

    def wait(self, timeout: float) -> int:
        """torchrun's exit code; fails the test (killing everything) if it has not exited within ``timeout``."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.close()
            pytest.fail(f"torchrun did not exit within {timeout} s:\n{self.text()}")

    def succeed(self, timeout: float = 240) -> None:
        code = self.wait(timeout)
        assert code == 0, f"torchrun exited {code}:\n{self.text()}"

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def workers(self) -> list[int]:
        """The worker pids (torchrun's children)."""
        children = []
        for task in Path(f"/proc/{self.proc.pid}/task").glob("*"):
            try:
                children += (task / "children").read_text().split()
            except FileNotFoundError:  # a thread that just ended
                pass
        return sorted(int(pid) for pid in children)

    def wait_for_epoch(self, epoch: int, timeout: float = 180) -> list[dict[str, Any]]:
        """metrics.json's epochs once it lists ``epoch`` (rank 0 writes it atomically after that epoch's checkpoint)."""
        deadline = time.monotonic() + timeout
        path = self.out / "metrics.json"
        while time.monotonic() < deadline:
            if path.is_file() and len(rows := json.loads(path.read_text())["epochs"]) >= epoch:
                return rows
            if self.proc.poll() is not None:
                pytest.fail(f"torchrun exited ({self.proc.returncode}) before epoch {epoch}:\n{self.text()}")
            time.sleep(0.05)
        self.close()
        pytest.fail(f"epoch {epoch} did not finish within {timeout} s:\n{self.text()}")

    def close(self) -> None:
        if self.proc.poll() is None:
            workers = self.workers()
            self.proc.kill()
            for pid in workers:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait()


@pytest.fixture
def jobs() -> Any:
    """Starts :class:`_Job`\\ s; kills whatever is still running at the end of the test."""
    started: list[_Job] = []

    def start(*args: Any, **kwargs: Any) -> _Job:
        started.append(_Job(*args, **kwargs))
        return started[-1]

    yield start
    for job in started:
        job.close()


@pytest.fixture(scope="session")
def uninterrupted_run(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """The uninterrupted torchrun run of ``JOB`` that the interrupted and the multi-node runs must reproduce; its
    output_dir.

    Run once per session, by the first test that asks; the xdist workers share it through a file lock in the
    session's directory (the other worker waits for it, then reads it). Each of those tests used to run its own."""
    shared = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        shared = shared.parent  # the session's directory, above each worker's own
    out, done = shared / "uninterrupted", shared / "uninterrupted.done"
    with FileLock(str(shared / "uninterrupted.lock")):
        if not done.is_file():
            job = _Job(STANDALONE, out)
            try:
                job.succeed()
            finally:
                job.close()
            done.touch()
    return out


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.over_budget("two torchrun jobs of 3 epochs: the stopped one and its resume")
def test_sigterm_to_torchrun_mid_training_then_resume_equals_the_uninterrupted_run(
    tmp_path: Path, jobs: Any, uninterrupted_run: Path
) -> None:
    """SIGTERM to torchrun mid-epoch: both workers checkpoint and exit 0; resume=true finishes as the uninterrupted run.

    About 30 s under the suite's load: two torchrun jobs (an agent and two workers each; the uninterrupted run is the
    session's, made once): a real torchrun's signal forwarding and its workers' exit are the assertion."""
    stopped = jobs(STANDALONE, tmp_path / "stopped")
    rows = stopped.wait_for_epoch(1)
    time.sleep(0.3 * rows[0]["epoch_time_s"])  # into epoch 2, most likely mid-epoch
    stopped.proc.send_signal(signal.SIGTERM)  # torchrun forwards it to both workers
    # torchrun exits 1 (it re-raises the SignalException); the workers checkpoint and exit 0 first.
    assert stopped.wait(timeout=60) != 0
    log = stopped.text()
    assert "got signal: 15" in log and "Unable to shutdown process" not in log  # no worker needed a SIGKILL
    for rank in (0, 1):
        assert f"[rank {rank}] SIGTERM: stopped after epoch" in log, log
    checkpoint = _checkpoint(tmp_path / "stopped")
    position = {"epoch": checkpoint["epoch"], "step": checkpoint["step"]}
    assert 1 <= position["epoch"] < 3  # stopped mid-training, after epoch 1
    assert _metrics(tmp_path / "stopped")["stopped_at"] == {**position, "signal": "SIGTERM"}

    jobs(STANDALONE, tmp_path / "stopped", "resume=true", log="resumed").succeed()
    assert _metrics(tmp_path / "stopped")["resumed_from"] == [position]
    _assert_same_training(tmp_path / "stopped", uninterrupted_run)


@pytest.mark.slow
@pytest.mark.distributed
def test_sigkilled_worker_fails_the_run_with_torchrun_report_instead_of_hanging(tmp_path: Path, jobs: Any) -> None:
    job = jobs(STANDALONE, tmp_path / "killed", "timeout_s=20.0")
    job.wait_for_epoch(1)
    workers = job.workers()
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)
    # The survivor's next collective fails (gloo sees the connection drop, or times out after timeout_s),
    # and torchrun's monitor notices the dead worker: well within timeout_s + torchrun's 30 s grace.
    code = job.wait(timeout=90)
    log = job.text()
    assert code != 0, log
    assert "ChildFailedError" in log and "launch.digits.train FAILED" in log
    assert f"exitcode  : -9 (pid: {workers[1]})" in log and "Signal 9 (SIGKILL)" in log  # the root cause
    assert "final_test_acc" not in _metrics(tmp_path / "killed")  # it did not finish


def _wait_for_checkpoint(job: _Job, epoch: int, step: int, timeout: float = 180) -> None:
    """Until ``job``'s checkpoint is at ``epoch`` completed epochs and at least ``step`` steps into the next."""
    deadline, path, seen = time.monotonic() + timeout, job.out / "checkpoint.pt", 0.0
    while time.monotonic() < deadline:
        if path.is_file() and path.stat().st_mtime != seen:
            seen = path.stat().st_mtime
            checkpoint = torch.load(path, weights_only=True)  # atomically replaced: always whole
            if (checkpoint["epoch"], checkpoint["step"]) >= (epoch, step):
                return
        if job.proc.poll() is not None:
            pytest.fail(f"torchrun exited ({job.proc.returncode}) before that checkpoint:\n{job.text()}")
        time.sleep(0.02)
    job.close()
    pytest.fail(f"no checkpoint at epoch {epoch} step {step} within {timeout} s:\n{job.text()}")


def _without_timing(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` less its wall times and resume history: what an uninterrupted run must reproduce exactly."""
    kept = {key: value for key, value in metrics.items() if key not in ("total_time_s", "resumed_from")}
    kept["epochs"] = [{k: v for k, v in row.items() if k != "epoch_time_s"} for row in metrics["epochs"]]
    return kept


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.over_budget("a torchrun job of 3 epochs that restarts its workers")
def test_sigkilled_worker_mid_epoch_is_restarted_and_finishes_as_the_uninterrupted_run(
    tmp_path: Path, jobs: Any, uninterrupted_run: Path
) -> None:
    """A worker SIGKILLed mid-epoch: torchrun restarts both once and the job finishes as the uninterrupted run.

    About 30 s under the suite's load: a torchrun job whose restart starts two workers again (the uninterrupted run is
    the session's, made once); a real torchrun's restart is the assertion."""
    every = 5  # of the 44 steps of an epoch
    restarted = jobs([*STANDALONE, "--max-restarts=1"], tmp_path / "restarted", f"train.checkpoint_every_steps={every}")
    _wait_for_checkpoint(restarted, epoch=1, step=every)  # epoch 2 is under way
    workers = restarted.workers()
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)  # as the OOM killer would: no handler, no checkpoint
    restarted.succeed()  # torchrun restarts both workers once; the job finishes and exits 0
    log = restarted.text()
    # torchrun restarted the workers once (TORCHELASTIC_RESTART_COUNT=1), and the restart continued by itself.
    assert "restart 1: resuming after epoch 1 + " in log, log
    assert "shares its store" not in log  # env_outside_torchrun launched torchrun with a fresh store per attempt
    got, want = _metrics(tmp_path / "restarted"), _metrics(uninterrupted_run)
    (resumed,) = got["resumed_from"]
    assert resumed["epoch"] == 1 and 0 < resumed["step"] < got["steps_per_epoch"] and resumed["step"] % every == 0
    assert got["state_sha256"] == want["state_sha256"] and len(set(got["state_sha256"])) == 1  # bit-identical
    assert _without_timing(got) == _without_timing(want)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.distributed
def test_two_nodes_on_loopback_equal_a_single_node_run(tmp_path: Path, jobs: Any, uninterrupted_run: Path) -> None:
    single = uninterrupted_run  # 2 processes on one node
    port = _free_port()
    node = [
        *TORCHRUN,
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{port}",
        f"--rdzv_id=test-{port}",
        "--local_addr=127.0.0.1",
    ]
    # One output_dir (loopback: shared storage), written by whichever node the rendezvous makes rank 0.
    nodes = [jobs(node, tmp_path / "multinode", log=f"node{r}") for r in (0, 1)]
    for job in nodes:
        job.succeed()
    got, want = _metrics(tmp_path / "multinode"), _metrics(single)
    assert got["world_size"] == 2 and got["bn_transport"] == ["distributed"]
    # Every rank's final state digest (parameters and running statistics): identical across the two
    # nodes, and to the single-node run's.
    assert len(got["state_sha256"]) == 2 and len(set(got["state_sha256"])) == 1
    assert got["state_sha256"] == want["state_sha256"]
    got_state, want_state = _checkpoint(tmp_path / "multinode")["model"], _checkpoint(single)["model"]
    for name in [n for n in want_state if n.endswith(("running_mean", "running_var", "num_batches_tracked"))]:
        # Same seed, shards and two-term sums (commutative in IEEE arithmetic): bit-identical.
        torch.testing.assert_close(got_state[name], want_state[name], rtol=0, atol=0, msg=name)
    assert [r["loss"] for r in got["epochs"]] == [r["loss"] for r in want["epochs"]]


_REPORT_UNDER_SIGTERM = """
import os, signal, sys
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler
from launch.digits.stop import deaf_once_failed

write = ErrorHandler.record_exception

def sigterm_then_write(self, e):
    os.kill(os.getpid(), signal.SIGTERM)  # torchrun's agent, closing the job as this worker reports its failure
    write(self, e)

ErrorHandler.record_exception = sigterm_then_write

def main():
    raise RuntimeError("gloo: connection closed by peer")

sys.exit(record(deaf_once_failed(main) if sys.argv[1] == "deaf" else main)())
"""


@pytest.mark.parametrize("wrapped", [True, False])
def test_a_failed_worker_writes_its_failure_report_whole_under_the_agents_sigterm(
    tmp_path: Path, wrapped: bool
) -> None:
    """deaf_once_failed: a worker SIGTERMed while ``record`` writes its error file still writes all of it (the
    agent parses it: a truncated one crashed torchrun with a JSONDecodeError instead of a restart). Unwrapped, the
    same worker dies on the signal without a report: the case the wrapper exists for."""
    error_file = tmp_path / "error.json"
    proc = subprocess.run(
        [sys.executable, "-c", _REPORT_UNDER_SIGTERM, "deaf" if wrapped else "plain"],
        cwd=ROOT,
        env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    if wrapped:
        assert proc.returncode == 1, proc.stderr[-2000:]
        report = json.loads(error_file.read_text())
        assert report["message"]["message"] == "RuntimeError: gloo: connection closed by peer"
    else:
        assert proc.returncode == -signal.SIGTERM, proc.stderr[-2000:]
        assert not error_file.exists() or error_file.read_text() == ""
