"""The oracle: which class a program is in, and what each rank must then do, decided from the program alone.

:data:`TABLE` is the table "What is caught, and when" of docs/troubleshooting.md, as data: one :class:`Row` per class,
keyed by the name the page gives it in its first column, with the outcome in the default mode and in debug mode
(tests/test_fuzz.py holds that the page and this table agree). :func:`decide` lists the synchronized collectives each
rank issues on its process group (:func:`collectives`), in order, and walks the members of each group side by side,
as the library's checks see them:

- while the members issue the same collective, the group goes on; its first step ends where the page says (the
  backward of its first layer, or a collective repeated);
- at the first position where they differ, the differing collectives name the class: another layer of the same width,
  a forward under ``no_grad`` against a training forward, a forward against a backward, another width (at the first
  step, or later), a rank compiled beside an eager one;
- a member whose collectives ran out has joined, under ``Join`` (the others go on, and announce every collective to it);
  without ``Join``, the others wait for it.

:data:`KNOWN_OPEN` names the classes the fuzzer found that the library does not yet meet: each has a one-line reason,
:func:`decide` marks the programs in them, and the fixed-seed suite leaves those programs out, so that each can be
switched back on when its fix lands.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from .programs import WIDTHS, Program, Step

EXACT, RAISE, ABORT, HANG, ONE_RANK = "exact", "raise", "abort", "hang", "one rank raises"
OUTCOMES = (EXACT, RAISE, ABORT, HANG, ONE_RANK)
LAYER_MISMATCH = "LayerMismatchError"
FORWARD, NO_GRAD_FORWARD, BACKWARD = "forward", "forward without backward", "backward"


@dataclass(frozen=True)
class Row:
    """One class of the table.

    Args:
        default: the outcome in the default mode: EXACT (trains exactly: nothing to catch), RAISE (every rank raises
            ``error``, within seconds), ABORT or HANG (not caught: gloo aborts a rank, or a rank waits for the group's
            timeout), ONE_RANK (only the rank at fault raises; its peers wait).
        debug: the outcome in debug mode (``SYNCBN_DEBUG=1``).
        error: the error every rank raises where the outcome is RAISE.
        generated: whether :func:`launch.fuzz.programs.programs` draws programs of this class (the others are the
            page's rows that need a setup the fuzzer does not draw: another dtype, a bad input, a second model).
    """

    default: str
    debug: str
    error: str = LAYER_MISMATCH
    generated: bool = True


# The page's rows, in its order (docs/troubleshooting.md, "What is caught, and when").
TABLE: dict[str, Row] = {
    "other-layer": Row(RAISE, RAISE),
    "no-grad-forward": Row(RAISE, RAISE),
    "forward-meets-backward": Row(RAISE, RAISE),
    "other-width-first-step": Row(RAISE, RAISE),
    "other-width-later": Row(ABORT, RAISE),
    "dtype-first-step": Row(RAISE, RAISE, generated=False),
    "dtype-later": Row(EXACT, RAISE, generated=False),
    "bad-input-first-step": Row(RAISE, RAISE, generated=False),
    "bad-input-later": Row(ONE_RANK, RAISE, generated=False),
    "compiled-beside-eager": Row(RAISE, RAISE),
    "compiled-fallback": Row(EXACT, EXACT, generated=False),
    "compiled-eval-first": Row(EXACT, EXACT),
    "uneven-without-join": Row(HANG, HANG),
    "logging-pass-with-grad-ddp": Row(HANG, HANG, generated=False),
    "join-uncovered": Row(RAISE, RAISE, error="RuntimeError", generated=False),
    "join-throw": Row(RAISE, RAISE, error="RuntimeError"),
}

#: A program whose ranks issue the same collectives: not a row (nothing differs), always exact.
AGREE = "same-collectives"

#: The classes found that the library does not meet yet, each with why; :func:`decide` names those a program is in.
KNOWN_OPEN: dict[str, str] = {
    "identity-by-width": "layers built directly are named by class and width: heads a and b (and the stem) of one "
    "width are one layer to the checks, so ranks at different ones mix statistics; under torch.compile the trace-time "
    "check then gathers at another number of layers on each rank, and they wait for the group's timeout, whatever "
    "differs (issue 59, item 2)",
    "hybrid-replicas": "DataParallel replicas on some processes only: the replica exchange's and the process group's "
    "backward payloads carry one tag (issue 59, item 3)",
    "compiled-cumulative-average": "under torch.compile, momentum=None's factor 1 / num_batches_tracked is a float32 "
    "tensor (an int64 tensor divided by a float): from the third training forward the running statistics are off by "
    "up to 3e-8 relative (syncbn_dist/layer/batchnorm.py, _momentum_factor); eager and plain BatchNorm compiled are "
    "exact",
    "compiled-first-step-recompiled": "under torch.compile, the first step's gather runs in the compilation that "
    "first traces the group's training calls only: layers of other widths met in a recompilation within the first "
    "step (a training forward after a no_grad one) are not gathered, and gloo aborts, as after the first step",
    "join-skipped-backward": "under Join, a rank that skips a backward (in a step, or its last): the next forward's "
    "header, or Join's exit, meets the peers' backward collective, and every rank waits for the group's timeout "
    "(without Join: caught on every rank)",
    "join-wrapper": "join_layers(model) while a wrapper of the model (DataParallelWithCallback, torch.compile) runs: "
    "the joinable's forward hook does not fire (issue 59, item 5)",
}


@dataclass(frozen=True)
class Collective:
    """One synchronized collective of one rank: a layer's (``kind`` "layer") or a ``Join`` header (``kind``
    "header": the control every training forward starts with under ``Join``)."""

    kind: str
    layer: str = ""
    direction: str = ""
    width: int = 0
    identity: str = ""  # what the library's checks call the layer (its tag): its qualified name, or class and width
    # Which of the rank's training forwards it belongs to, and whether it updates the layer's running statistics (a
    # training forward's, not a recomputation's): not compared, since ranks that agree may number steps otherwise.
    forward: int = field(default=-1, compare=False)
    tracked: bool = field(default=False, compare=False)

    def __repr__(self) -> str:
        return "header" if self.kind == "header" else f"{self.layer}:{self.direction}"


@dataclass(frozen=True)
class Verdict:
    """What a program must do.

    Args:
        row: a key of :data:`TABLE`, or :data:`AGREE`.
        outcome: this program's outcome (the row's, in the program's mode; RAISE wherever ``Join`` announces the
            differing collective to a joined rank).
        errors: by rank, the names of the errors the rank may raise (empty: it runs to the end, exactly).
        open: the :data:`KNOWN_OPEN` classes the program is in.
        detail: where the ranks part and how, for the report.
        parted_at: by group (its ranks), the position in :func:`collectives` where its members part.
    """

    row: str
    outcome: str
    errors: dict[int, tuple[str, ...]] = field(default_factory=dict)
    open: tuple[str, ...] = ()
    detail: str = ""
    parted_at: dict[tuple[int, ...], int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The class as reports name it: the row, and the open classes in brackets."""
        return self.row + (f" [{', '.join(self.open)}]" if self.open else "")


def _identity(program: Program, layer: str) -> str:
    if program.naming == "direct":  # named by class and width only (docs/troubleshooting.md)
        return f"SyncBatchNorm/{WIDTHS[layer]}"
    return layer


def _layer(program: Program, name: str, direction: str, forward: int = -1, tracked: bool = False) -> Collective:
    return Collective("layer", name, direction, WIDTHS[name], _identity(program, name), forward, tracked)


def collectives(program: Program, rank: int) -> list[Collective]:
    """The synchronized collectives ``rank`` issues on its process group, in order: per training forward, a header
    (under ``Join``, unless it throws on early termination: then torch's own notification counts the ranks), the stem's
    forward and the head's; per backward, the head's forward again if checkpointed (a recomputation repeats the
    collective over a process group; DataParallel replicas replay it), then the head's backward and the stem's."""
    events: list[Collective] = []
    replicas = program.replicas[rank] > 1
    for k, step in enumerate(s for s in program.steps[rank] if s.trains):
        if program.join and not program.join_throw:
            events.append(Collective("header", forward=k))
        direction = FORWARD if step.kind == "train" else NO_GRAD_FORWARD
        events += [_layer(program, "stem", direction, k, True), _layer(program, step.branch, direction, k, True)]
        if step.has_backward:
            if step.checkpoint and not replicas:
                events.append(_layer(program, step.branch, FORWARD, k))
            events += [_layer(program, step.branch, BACKWARD, k), _layer(program, "stem", BACKWARD, k)]
    return events


class _Window:
    """A group's first step, as the page defines it: it ends once the backward of its first layer, or a collective
    repeated, has been checked."""

    def __init__(self) -> None:
        self.open = True
        self.first: Optional[str] = None
        self.seen: set[tuple[str, str]] = set()

    def passed(self, event: Collective) -> None:
        key = (event.identity, event.direction)
        if key in self.seen or (event.direction == BACKWARD and event.identity == self.first):
            self.open = False
        if self.first is None:
            self.first = event.identity
        self.seen.add(key)


@dataclass(frozen=True)
class _Parting:
    """Where a group's members part: the row, the position, the ranks still active and those that had joined."""

    row: str
    position: int
    active: tuple[int, ...]
    joined: tuple[int, ...]
    announced: bool  # under Join, a member had joined: the differing collective is announced (and caught)
    detail: str
    open: tuple[str, ...] = ()


SKIPPED = ("join-skipped-backward",)


def _differing(program: Program, events: set[Collective], first_step: bool) -> tuple[str, tuple[str, ...]]:
    """The row of differing collectives at one position, and the open classes it meets."""
    kinds = {e.kind for e in events}
    if len(kinds) > 1:  # a Join header against a layer's collective: a rank skipped a backward, its peer did not
        return "forward-meets-backward", SKIPPED
    if len({e.width for e in events}) > 1:
        return ("other-width-first-step" if first_step else "other-width-later"), ()
    directions = {e.direction for e in events}
    if BACKWARD in directions and len(directions) > 1:
        return "forward-meets-backward", ()
    if len(directions) > 1:
        return "no-grad-forward", ()
    same_tag = len({e.identity for e in events}) == 1
    return "other-layer", (("identity-by-width",) if same_tag else ())


def _walk(program: Program, members: tuple[int, ...]) -> Optional[_Parting]:
    """Walk one group's members side by side; where they part, or None if they issue the same collectives."""
    sequences = {rank: collectives(program, rank) for rank in members}
    window = _Window()
    position = 0
    while True:
        active = tuple(r for r in members if position < len(sequences[r]))
        joined = tuple(r for r in members if position >= len(sequences[r]))
        if not active:
            return None
        events = {sequences[r][position] for r in active}
        here = f"position {position}: " + ", ".join(
            f"rank {r} {sequences[r][position] if r in active else 'done'}" for r in members
        )
        if joined and not program.join:
            return _Parting("uneven-without-join", position, active, joined, False, here)
        if joined and program.join_throw:
            return _Parting("join-throw", position, active, joined, False, here)
        announced = bool(joined)  # under Join, a joined rank hears of every collective
        just_joined = any(position == len(sequences[r]) for r in joined)
        if just_joined and any(e.kind != "header" for e in events):
            # A rank ended inside a step (without its last backward): the others' backward meets a joined rank.
            return _Parting("forward-meets-backward", position, active, joined, announced, here, SKIPPED)
        if len(events) > 1:
            row, open_ = _differing(program, events, window.open)
            traced = bool(program.compile[members[0]]) and not program.debug  # debug mode runs the layers eagerly
            if traced and row == "other-width-first-step" and any(e.forward >= 1 for e in events):
                open_ = (*open_, "compiled-first-step-recompiled")
            if announced and "identity-by-width" in open_:  # the announcement numbers each layer: caught
                open_ = ()
            return _Parting(row, position, active, joined, announced, here, open_)
        (event,) = events
        if event.kind == "layer" and not joined:
            window.passed(event)
        position += 1


def decide(program: Program) -> Verdict:
    """The verdict on ``program``, from the program alone.

    Groups part independently: the ranks of a group that parts raise (or wait, or abort, as its class says); the ranks
    of a group whose members agree run to the end, exactly. The first group that parts names the class.
    """
    open_: list[str] = []
    if len(set(program.replicas)) > 1:
        open_.append("hybrid-replicas")
    wrapped = any(r > 1 for r in program.replicas) or any(program.compile)
    if program.join and program.join_target == "model" and wrapped:
        open_.append("join-wrapper")
    errors: dict[int, tuple[str, ...]] = {}
    parted_at: dict[tuple[int, ...], int] = {}
    verdict_row, outcome, details = AGREE, EXACT, []
    for members in program.groups():
        if len(members) < 2 or not any(collectives(program, r) for r in members):
            continue
        compiled = {bool(program.compile[r]) for r in members}
        if len(compiled) > 1:
            parting: Optional[_Parting] = _Parting(
                "compiled-beside-eager", 0, members, (), False, "ranks " + ", ".join(
                    f"{r} {program.compile[r] or 'eager'}" for r in members
                )
            )
        else:
            parting = _walk(program, members)
        if parting is None:
            if program.compile[members[0]] and _eval_first_on_some(program, members):
                verdict_row = "compiled-eval-first" if verdict_row == AGREE else verdict_row
            forwards = max(sum(s.trains for s in program.steps[r]) for r in members)
            traced = program.compile[members[0]] and not program.debug
            if traced and program.momentum is None and forwards >= 3 and "compiled-cumulative-average" not in open_:
                open_.append("compiled-cumulative-average")  # 1/3 is the first factor float32 rounds
            continue
        if program.naming == "direct" and program.compile[members[0]] and "identity-by-width" not in parting.open:
            parting = dataclasses.replace(parting, open=(*parting.open, "identity-by-width"))
        row = TABLE[parting.row]
        group_outcome = row.debug if program.debug else row.default
        if parting.announced and parting.row != "join-throw":
            group_outcome = RAISE  # under Join, each collective is announced to the joined ranks, and checked
        open_ += [o for o in parting.open if o not in open_]
        for rank in members:
            if group_outcome == EXACT:  # nothing to catch (another dtype after the first step, say)
                continue
            if group_outcome == RAISE:
                errors[rank] = (row.error,)
                if rank in parting.joined and program.ddp and parting.row != "join-throw":
                    # docs/troubleshooting.md: beside a DDP model, a joined rank may wait for the group's timeout first
                    errors[rank] = (row.error, "timeout")
            else:
                errors[rank] = (group_outcome,)
        details.append(f"group {list(members)} parts at {parting.detail}")
        parted_at[members] = parting.position
        if verdict_row in (AGREE, "compiled-eval-first"):
            verdict_row, outcome = parting.row, group_outcome
    return Verdict(verdict_row, outcome, errors, tuple(open_), "; ".join(details) or "the ranks agree", parted_at)


def _eval_first_on_some(program: Program, members: tuple[int, ...]) -> bool:
    """Whether some member, but not all, evaluates before its first training forward."""

    def first_is_eval(steps: tuple[Step, ...]) -> bool:
        return bool(steps) and steps[0].kind == "eval"

    firsts = {first_is_eval(program.steps[r]) for r in members}
    return len(firsts) > 1


def selected(verdict: Verdict, *, known_open: bool = False, not_caught: bool = False) -> bool:
    """Whether a run of the fuzzer takes a program of ``verdict``: not one in a :data:`KNOWN_OPEN` class unless
    ``known_open``, not one the page lists as not caught (a rank aborts or waits for the group's timeout: fresh
    processes, seconds each) unless ``not_caught``."""
    if verdict.open and not known_open:
        return False
    return not_caught or verdict.outcome not in (ABORT, HANG)
