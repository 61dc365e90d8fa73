"""What a program's ranks did, against what the oracle says they must do, and against float64 ``nn.BatchNorm``.

A rank the oracle expects to run to the end must be exact: every output, input gradient and parameter gradient of its
steps, and its buffers at the end, equal to the program's plain model (``nn.BatchNorm1d``, float64, the same weights)
run on each synchronized forward's union of batches, the batches of every member of the rank's group that runs that
forward (under ``Join``, those still active). A rank the oracle expects to raise must raise one of its errors before the
group's timeout; a class the page documents as not caught must fail as documented (or be caught).
:func:`problems` returns what differs, each with its kind (:func:`kind_of` groups failures into classes).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from .oracle import ABORT, EXACT, HANG, LAYER_MISMATCH, RAISE, Verdict, collectives
from .programs import Program, norm_layers, plain_model, step_input
from .runner import RankRecord, Run, timeouts

# float64 throughout, on values of order 1 through two layers and a sum over at most 12 rows: float64 rounding.
RTOL = ATOL = 1e-9
BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def expected_steps(program: Program, members: tuple[int, ...]) -> tuple[dict[int, dict[int, dict[str, Any]]], dict]:
    """The reference for one group whose members issue the same collectives: by rank and step index, what the step
    must give (its output, input gradient, and parameter gradients summed over the active members), and each layer's
    buffers at the end."""
    reference = plain_model(program)
    trains = {r: [i for i, s in enumerate(program.steps[r]) if s.trains] for r in members}
    forwards = max(len(t) for t in trains.values())
    expected: dict[int, dict[int, dict[str, Any]]] = {r: {} for r in members}

    def evaluations(k: int) -> None:  # each member's evaluations after its k-th training forward
        for r in members:
            count = 0
            for i, step in enumerate(program.steps[r]):
                if step.trains:
                    count += 1
                elif count == k:
                    reference.eval()
                    with torch.no_grad():
                        expected[r][i] = {"out": reference(step_input(program, r, i)[0], step.branch)}
                    reference.train()

    for k in range(forwards):
        evaluations(k)
        active = [r for r in members if k < len(trains[r])]
        steps = {r: program.steps[r][trains[r][k]] for r in active}
        step = steps[active[0]]
        inputs = [step_input(program, r, trains[r][k]) for r in active]
        x = torch.cat([xi for xi, _ in inputs]).requires_grad_(step.kind == "train")
        reference.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(step.kind == "train"):
            out = reference(x, step.branch)
        if step.has_backward:
            out.backward(torch.cat([dy for _, dy in inputs]))
        rows = [xi.size(0) for xi, _ in inputs]
        outs = out.detach().split(rows)
        grad_inputs = x.grad.split(rows) if step.has_backward else [None] * len(active)
        grads = {n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None}
        for r, o, g in zip(active, outs, grad_inputs):
            entry: dict[str, Any] = {"out": o, "active": active}
            if g is not None:
                entry["grad_input"] = g
                entry["grads"] = grads
            expected[r][trains[r][k]] = entry
    evaluations(forwards)
    buffers = {
        name: (m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone())
        for name, m in norm_layers(reference).items()
    }
    return expected, buffers


def buffers_before_parting(program: Program, members: tuple[int, ...], position: int) -> dict[str, tuple[Tensor, ...]]:
    """Each layer's buffers after the collectives before ``position`` (where the group's members part): the failed call
    leaves them as they were before it (docs/troubleshooting.md), so they count the training forwards, and within the
    failing step the layers, whose forward collective came before it."""
    reference = plain_model(program)
    trains = {r: [i for i, s in enumerate(program.steps[r]) if s.trains] for r in members}
    updated: dict[int, list[str]] = {}  # the group's training forward -> the layers it updated, in order
    for event in collectives(program, members[0])[:position]:
        if event.kind == "layer" and event.tracked:
            updated.setdefault(event.forward, []).append(event.layer)
    with torch.no_grad():
        for k, layers in sorted(updated.items()):
            h = reference.stem[0](torch.cat([step_input(program, r, trains[r][k])[0] for r in members]))
            h = reference.stem[1](h)  # the stem's forward is a forward's first collective
            if len(layers) > 1:
                reference.heads[layers[1]](h)
    return {
        name: (m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone())
        for name, m in norm_layers(reference).items()
    }


def _max_diff(actual: Tensor, expected: Tensor) -> Optional[float]:
    """The greatest difference beyond the tolerance, or None if every element is within it."""
    actual, expected = actual.double(), expected.double()
    if actual.shape != expected.shape:
        return float("inf")
    if torch.allclose(actual, expected, rtol=RTOL, atol=ATOL):
        return None
    return float((actual - expected).abs().max())


def _exact(program: Program, members: tuple[int, ...], records: list[RankRecord]) -> list[str]:
    expected, buffers = expected_steps(program, members)
    found: list[str] = []

    def compare(what: str, actual: Tensor, reference: Tensor) -> None:
        diff = _max_diff(actual, reference)
        if diff is not None:
            found.append(f"wrong numbers: {what} off by {diff:.3g}")

    for r in members:
        for i, entry in expected[r].items():
            got = records[r].steps.get(i)
            if got is None:
                found.append(f"wrong numbers: rank {r} step {i} has no record")
                continue
            compare(f"rank {r} step {i} {program.steps[r][i]!r} output", got["out"], entry["out"])
            if "grad_input" in entry:
                compare(f"rank {r} step {i} input gradient", got["grad_input"], entry["grad_input"])
                for name, reference in entry["grads"].items():
                    if program.ddp:  # DDP averages over the initial world size, under Join too
                        actual = got["grads"].get(name, torch.zeros_like(reference)) * program.world_size
                    else:  # each rank's own gradient: the group's active members' sum
                        active = entry["active"]
                        actual = sum(
                            records[a].steps[_index_of(program, a, r, i)]["grads"].get(name, 0.0) for a in active
                        )
                    compare(f"rank {r} step {i} gradient of {name}", actual, reference)
        for name, values in buffers.items():
            got_values = records[r].buffers.get(name)
            if got_values is None:
                found.append(f"wrong numbers: rank {r} has no buffers of {name}")
                continue
            for label, actual, reference in zip(BUFFERS, got_values, values):
                compare(f"rank {r} {name}.{label} at the end", actual, reference)
    return found


def _index_of(program: Program, rank: int, like_rank: int, like_index: int) -> int:
    """The step index of ``rank``'s training forward that is the same synchronized forward as ``like_rank``'s step
    ``like_index``."""
    k = sum(1 for s in program.steps[like_rank][:like_index] if s.trains)
    return [i for i, s in enumerate(program.steps[rank]) if s.trains][k]


def problems(run: Run) -> list[str]:
    """What ``run`` did that its verdict does not allow, each starting with its kind (see :func:`kind_of`)."""
    program, verdict = run.program, run.verdict
    if run.records is None:
        if verdict.outcome in (ABORT, HANG):
            return []  # not caught, as documented (only in fresh processes)
        return [f"{run.failure}: the job {'lost a rank' if run.failure == ABORT else 'never ended'}: {run.text[:400]}"]
    found: list[str] = []
    records = run.records
    for rank, record in enumerate(records):
        allowed = verdict.errors.get(rank, ())
        if not allowed:
            if record.outcome != "ok":
                kind = "hang" if record.timeout else "unexpected error"
                found.append(f"{kind}: rank {rank} raised {_describe(record)} (expected to run to the end)")
            continue
        if allowed[0] in (ABORT, HANG):
            continue  # checked below, for the whole group
        if record.outcome == "ok":
            found.append(f"no error: rank {rank} ran to the end (expected {' or '.join(allowed)})")
        elif record.timeout and "timeout" not in allowed:
            found.append(f"hang: rank {rank} waited for the group's timeout: {_describe(record)}")
        elif not (any(record.raised(name) for name in allowed) or (record.timeout and "timeout" in allowed)):
            found.append(f"wrong error: rank {rank} raised {_describe(record)} (expected {' or '.join(allowed)})")
        elif record.elapsed_s > run_limit(run):
            found.append(f"slow error: rank {rank} raised after {record.elapsed_s:.1f} s: {_describe(record)}")
    if verdict.outcome in (ABORT, HANG):
        found += _not_caught(verdict, records)
    for members in program.groups():
        if all(not verdict.errors.get(r) and records[r].outcome == "ok" for r in members):
            found += _exact(program, members, records)
        elif _buffers_checked(program, verdict, members, records):
            expected = buffers_before_parting(program, members, verdict.parted_at[members])
            for r in members:
                for name, values in expected.items():
                    for label, actual, reference in zip(BUFFERS, records[r].buffers[name], values):
                        if _max_diff(actual, reference) is not None:
                            found.append(
                                f"buffers changed by the failed call: rank {r} {name}.{label} off by "
                                f"{_max_diff(actual, reference):.3g}"
                            )
    return found


def _not_caught(verdict: Verdict, records: list[RankRecord]) -> list[str]:
    """A class the page lists as not caught, whose ranks all reported: some rank must have met the documented failure
    (the group's timeout or a peer's lost connection; for an abort, any gloo error), and not every one been caught."""
    parted = [records[r] for r, errors in verdict.errors.items() if errors and errors[0] in (ABORT, HANG)]
    if all(record.outcome == "ok" for record in parted):
        return [f"ran through: documented as not caught ({verdict.outcome}), but every rank ran to the end"]
    if all(record.raised(LAYER_MISMATCH) for record in parted):
        return [f"caught: documented as not caught ({verdict.outcome}), but every rank raised LayerMismatchError"]
    if verdict.outcome == HANG and not any(record.timeout for record in parted):
        return [f"wrong failure: documented as waiting for the group's timeout: {_describe(parted[0])}"]
    return []


def _buffers_checked(program: Program, verdict: Verdict, members: tuple[int, ...], records: list[RankRecord]) -> bool:
    """Whether the group's buffers after its caught mismatch are checked: every member raised its expected error, not
    under Join (a joined rank's buffers follow the active ones' by another path) nor torch.compile (the graph is the
    failed call: it writes no buffer)."""
    if verdict.outcome != RAISE or members not in verdict.parted_at or program.join or any(program.compile):
        return False
    return all(
        records[r].outcome != "ok" and not records[r].timeout and any(records[r].raised(e) for e in verdict.errors[r])
        for r in members
    )


def run_limit(run: Run) -> float:
    """The seconds within which an expected error must come: below the group's timeout."""
    return 0.8 * timeouts(run.program, run.verdict)[0]


def _describe(record: RankRecord) -> str:
    type_name, message = record.chain[0] if record.chain else (record.outcome, "")
    inner = [name for name, _ in record.chain[1:]]
    first_line = message.strip().splitlines()[0] if message.strip() else ""
    within = f" (from {', '.join(inner)})" if inner else ""
    return f"{type_name}{within} at step {record.where}: {first_line[:200]}"


def kind_of(found: list[str]) -> str:
    """The kinds of a run's problems (the text before each one's colon), sorted and joined: with the verdict's class,
    the key by which ``make fuzz`` groups failures."""
    return ", ".join(sorted({p.split(":", 1)[0] for p in found}))


__all__ = ["EXACT", "RAISE", "expected_steps", "kind_of", "problems", "run_limit", "Verdict"]
