"""A program on its ranks: each rank interprets its steps (:func:`run_rank`, the job's worker) and records what it
did; :func:`run_program` runs the job on real gloo process groups and says how it ended.

A rank records, for every step it finished, the output, and after a backward the input gradient and the parameter
gradients; at the end, every BatchNorm layer's buffers; and how it ended: "ok", or the error it raised (every type and
message of the chain, whether it is the group's timeout, and how long after the step began). The parent compares them
(:mod:`launch.fuzz.check`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

import syncbn_dist
from launch.common.spawn import run_distributed

from .oracle import ABORT, HANG, Verdict, decide
from .programs import Program, Step, norm_layers, step_input, synchronized_model

# The process group's timeout, and the replicas' (SyncBatchNorm.replica_timeout): an error must come before them.
COLLECTIVE_TIMEOUT_S = 10.0
# A compiling rank may keep its peers waiting in a collective while it compiles (seconds on a loaded core).
COMPILED_COLLECTIVE_TIMEOUT_S = 40.0
# Texts of the errors that mean a rank waited for the group's timeout, or a peer's process was gone.
TIMEOUT_TEXTS = (
    "Timed out",
    "timed out",
    "Application timeout",
    "Connection closed by peer",
    "Connection reset by peer",
)


@dataclass
class RankRecord:
    """What one rank did.

    Args:
        outcome: "ok", or the name of the error's type.
        chain: the error's chain, (type name, first 600 characters of the message) from the outermost.
        types: the names of every error type in the chain and of their base classes.
        timeout: whether the error is the group's timeout (or a peer's lost connection).
        elapsed_s: seconds from the start of the step (or of Join's exit) to the error.
        where: the step index the error came from, or "join exit".
        steps: by step index, the step's tensors ("out", "grad_input", "grads": name -> tensor).
        buffers: each BatchNorm layer's (running_mean, running_var, num_batches_tracked), by qualified name.
    """

    outcome: str = "ok"
    chain: list[tuple[str, str]] = field(default_factory=list)
    types: set[str] = field(default_factory=set)
    timeout: bool = False
    elapsed_s: float = 0.0
    where: Any = None
    steps: dict[int, dict[str, Any]] = field(default_factory=dict)
    buffers: dict[str, tuple[torch.Tensor, ...]] = field(default_factory=dict)

    def raised(self, name: str) -> bool:
        """Whether the error's chain holds an error of type ``name`` or a subclass of it (a compiled graph wraps the
        layer's error)."""
        return name in self.types


def _chain(error: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    current: Optional[BaseException] = error
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _wrap(program: Program, rank: int, model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The module each training step calls (replicas, DDP, torch.compile around the model) and the one evaluations
    call (the DDP model's module, which communicates nothing: docs/troubleshooting.md's remedy for a logging pass)."""
    runner: nn.Module = model
    if program.replicas[rank] > 1:
        runner = syncbn_dist.DataParallelWithCallback(runner, cpu_replicas=program.replicas[rank])
    evaluator = runner
    if program.ddp:
        runner = DistributedDataParallel(runner, find_unused_parameters=True)
    if program.compile[rank]:
        runner = torch.compile(runner, backend=program.compile[rank])
        evaluator = runner
    return runner, evaluator


def _join(program: Program, model: nn.Module, runner: nn.Module) -> Any:
    if not program.join:
        return contextlib.nullcontext()
    target = runner if program.join_target == "runner" else model
    joinables: list[Any] = []
    if program.ddp:
        ddp = runner._orig_mod if hasattr(runner, "_orig_mod") else runner
        joinables.append(ddp)
    if program.join in ("layers", "ddp+layers"):
        joinables.append(syncbn_dist.join_layers(target))
    return Join(joinables, throw_on_early_termination=program.join_throw)


def _run_step(
    program: Program, rank: int, index: int, model: nn.Module, runner: nn.Module, evaluator: nn.Module
) -> dict:
    step: Step = program.steps[rank][index]
    x, dy = step_input(program, rank, index)
    if step.kind == "eval":
        evaluator.eval()
        with torch.no_grad():
            out = evaluator(x, step.branch)
        evaluator.train()
        return {"out": out.detach().clone()}
    if step.kind == "no_grad":
        with torch.no_grad():
            out = runner(x, step.branch)
        return {"out": out.detach().clone()}
    for p in model.parameters():
        p.grad = None
    x.requires_grad_()
    out = runner(x, step.branch, step.checkpoint)
    record = {"out": out.detach().clone()}
    if step.backward:
        out.backward(dy)
        record["grad_input"] = x.grad.detach().clone()
        record["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return record


def run_rank(rank: int, world_size: int, program: Program, timeout_s: float) -> RankRecord:
    """The job's worker: ``program`` on this rank, every error caught and recorded (the parent judges it)."""
    record = RankRecord()
    syncbn_dist.set_debug(program.debug)
    started = time.monotonic()
    model: Optional[nn.Module] = None
    try:
        group = syncbn_dist.new_sync_groups(program.group_size) if program.group_size else None
        model = synchronized_model(program, group)
        for layer in model.modules():
            if isinstance(layer, syncbn_dist.SyncBatchNorm):
                layer.replica_timeout = timeout_s
        runner, evaluator = _wrap(program, rank, model)
        with _join(program, model, runner):
            for index in range(len(program.steps[rank])):
                record.where, started = index, time.monotonic()
                record.steps[index] = _run_step(program, rank, index, model, runner, evaluator)
            record.where, started = "join exit", time.monotonic()
        record.where = None
    except Exception as error:  # noqa: BLE001 - recorded for the parent, which holds it against the oracle
        record.elapsed_s = time.monotonic() - started
        chain = _chain(error)
        record.chain = [(type(e).__name__, str(e)[:600]) for e in chain]
        record.types = {cls.__name__ for e in chain for cls in type(e).__mro__}
        record.outcome = record.chain[0][0]
        # The outermost error's text (a compiled graph's error quotes its cause's): an error raised on time may carry
        # a peer's lost connection as its context.
        record.timeout = any(text in record.chain[0][1] for text in TIMEOUT_TEXTS)
    finally:
        syncbn_dist.set_debug(False)
    if model is not None:
        record.buffers = {
            name: tuple(t.detach().clone() for t in (m.running_mean, m.running_var, m.num_batches_tracked))
            for name, m in norm_layers(model).items()
        }
    return record


@dataclass
class Run:
    """How a program's job ended: every rank's record, or the job's failure ("abort": a rank died without a report;
    "hang": ranks still ran at the job's deadline) and its text."""

    program: Program
    verdict: Verdict
    records: Optional[list[RankRecord]] = None
    failure: Optional[str] = None
    text: str = ""
    wall_s: float = 0.0
    fresh: bool = False


def timeouts(program: Program, verdict: Verdict) -> tuple[float, float]:
    """The group's collective timeout for ``program``, and the whole job's."""
    collective = COMPILED_COLLECTIVE_TIMEOUT_S if any(program.compile) else COLLECTIVE_TIMEOUT_S
    return collective, 3 * collective + 60.0


def run_program(program: Program, fresh: Optional[bool] = None) -> Run:
    """Run ``program`` on ``program.world_size`` gloo ranks and return how it ended.

    Args:
        fresh: spawn the ranks afresh (default: for a program whose class may abort a rank or leave it waiting; the
            others run on the test session's pooled ranks, if any).
    """
    verdict = decide(program)
    if fresh is None:
        fresh = verdict.outcome in (ABORT, HANG) or any("timeout" in errors for errors in verdict.errors.values())
    collective, job = timeouts(program, verdict)
    start = time.monotonic()
    run = Run(program, verdict, fresh=fresh)
    try:
        run.records = run_distributed(
            run_rank, program.world_size, program, collective, timeout=job, collective_timeout=collective, fresh=fresh
        )
    except TimeoutError as error:
        run.failure, run.text = HANG, str(error)
    except AssertionError as error:  # a rank died without a report (gloo aborts), or the job's setup failed
        run.failure, run.text = ABORT, str(error)
    run.wall_s = time.monotonic() - start
    return run


__all__ = ["RankRecord", "Run", "run_program", "run_rank"]
