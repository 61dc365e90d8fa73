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
    "compiled-beside-eager": Row(RAISE, EXACT),
    "compiled-fallback": Row(EXACT, EXACT, generated=False),
    "compiled-eval-first": Row(EXACT, EXACT),
    "other-width-first-step-recompiled": Row(ABORT, RAISE, generated=False),  # (drawn, but rarely)
    "replicas-beside-direct": Row(RAISE, RAISE),
    "uneven-without-join": Row(HANG, HANG),
    "logging-pass-with-grad-ddp": Row(HANG, HANG, generated=False),
    "join-uncovered": Row(RAISE, RAISE, error="RuntimeError", generated=False),
    "join-wrapper": Row(EXACT, EXACT, generated=False),
    "join-repeat-outside-model": Row(ABORT, ABORT, generated=False),
    "join-skipped-backward": Row(HANG, HANG),
    "join-throw": Row(RAISE, RAISE, error="RuntimeError"),
}

#: A program whose ranks issue the same collectives: not a row (nothing differs), always exact.
AGREE = "same-collectives"

#: The classes found that the library does not meet yet, each with why; :func:`decide` names those a program is in.
KNOWN_OPEN: dict[str, str] = {}


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
    return layer  # its place in the model, however it was built (docs/design.md, "Every collective checks itself")


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


def _differing(program: Program, events: set[Collective], first_step: bool) -> tuple[str, tuple[str, ...]]:
    """The row of differing collectives at one position, and the open classes it meets."""
    kinds = {e.kind for e in events}
    if len(kinds) > 1:  # a Join header against a layer's collective: a rank skipped a backward, its peer did not
        return "join-skipped-backward", ()
    if len({e.width for e in events}) > 1:
        return ("other-width-first-step" if first_step else "other-width-later"), ()
    directions = {e.direction for e in events}
    if BACKWARD in directions and len(directions) > 1:
        return "forward-meets-backward", ()
    if len(directions) > 1:
        return "no-grad-forward", ()
    return "other-layer", ()


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
            return _Parting("join-skipped-backward", position, active, joined, False, here)
        if len(events) > 1:
            row, open_ = _differing(program, events, window.open)
            traced = bool(program.compile[members[0]]) and not program.debug  # debug mode runs the layers eagerly
            if traced and row == "other-width-first-step" and any(e.forward >= 1 for e in events):
                row = "other-width-first-step-recompiled"
            return _Parting(row, position, active, joined, announced and row != "join-skipped-backward", here, open_)
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
    errors: dict[int, tuple[str, ...]] = {}
    parted_at: dict[tuple[int, ...], int] = {}
    verdict_row, outcome, details = AGREE, EXACT, []
    for members in program.groups():
        if len(members) < 2 or not any(collectives(program, r) for r in members):
            continue
        compiled = {bool(program.compile[r]) for r in members}
        if len(compiled) > 1:
            how = ", ".join(f"rank {r} {_mode(program.compile[r])}" for r in members)
            parting: Optional[_Parting] = _Parting("compiled-beside-eager", 0, members, (), False, how)
        else:
            parting = _replicas_beside_direct(program, members) or _walk(program, members)
        if parting is None:
            if program.compile[members[0]] and _eval_first_on_some(program, members):
                verdict_row = "compiled-eval-first" if verdict_row == AGREE else verdict_row
            continue
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


def _mode(backend: str) -> str:
    return f"compiled ({backend})" if backend else "eager"


def _replicas_beside_direct(program: Program, members: tuple[int, ...]) -> Optional[_Parting]:
    """Members that run the layers in DataParallel replicas beside members that run them directly, at their first
    layer collective: every member raises there (the tags name the exchange). Not where a member with no training
    forward leaves the others waiting (without Join), nor where only one kind is active (a joined rank adds zeros)."""
    runners = [r for r in members if collectives(program, r)]
    if len(runners) < len(members) and not program.join:
        return None
    if len({program.replicas[r] > 1 for r in runners}) < 2:
        return None
    position = next(i for i, e in enumerate(collectives(program, runners[0])) if e.kind == "layer")
    here = "the first layer: ranks " + ", ".join(
        f"{r} {'replicas' if program.replicas[r] > 1 else 'direct'}" for r in members
    )
    joined = tuple(r for r in members if r not in runners)
    return _Parting("replicas-beside-direct", position, tuple(runners), joined, bool(joined), here)


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
