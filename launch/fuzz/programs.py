"""A rank-divergent program: each rank's steps and the setup they share, its model and inputs, and the hypothesis
strategy that draws it.

A program runs one small model on every rank: a shared stem (a 1x1 convolution and a synchronized BatchNorm of
:data:`C` channels) and one of three heads per forward (a convolution and a synchronized BatchNorm: ``a`` and ``b`` of
width :data:`C`, ``c`` of width :data:`C_OTHER`), float64 throughout, so that a result is exact against float64
``nn.BatchNorm`` up to float64 rounding. Each rank has its own list of :class:`Step`: a training forward of a head
(with or without its backward, with the head under activation checkpointing or not), a training-mode forward under
``no_grad``, an evaluation forward. The setup says how the model runs on each rank (eagerly or under
``torch.compile``, with DataParallel replicas or not, wrapped in DDP), over which process group, and under which
``Join``. Inputs are a function of the program, the rank and the step, so the parent rebuilds them for the reference.

:func:`programs` draws programs where most ranks agree and some part from the others by one or two changes; which
features it draws is a set of names (:data:`FEATURES`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import syncbn_dist

C = 4  # the stem's and heads a and b's width
C_OTHER = 3  # head c's width
C_IN = 3  # input channels
LENGTH = 2  # input length: inputs are (N, C_IN, LENGTH)
WIDTHS = {"stem": C, "a": C, "b": C, "c": C_OTHER}
BRANCHES = ("a", "b", "c")
KINDS = ("train", "no_grad", "eval")
COMPILE_BACKENDS = ("eager", "aot_eager")
JOINS = ("", "layers", "ddp", "ddp+layers")

# What the strategy can draw, each a switch of programs(include=...):
FEATURES = frozenset(
    {
        "widths",  # head c, of another width than the stem and heads a and b
        "no_grad",  # training-mode forwards under no_grad
        "eval",  # evaluation forwards
        "skip_backward",  # training forwards without their backward
        "checkpoint",  # the head under torch.utils.checkpoint (use_reentrant=False)
        "compile",  # torch.compile, backends "eager" and "aot_eager"
        "replicas",  # DataParallelWithCallback(model, cpu_replicas=2) inside a process
        "join",  # uneven step counts under Join, with join_layers
        "ddp",  # DistributedDataParallel, under Join beside join_layers or alone
        "subgroups",  # new_sync_groups
        "debug",  # syncbn_dist.set_debug(True)
        "direct",  # layers built directly (SyncBatchNorm(C) in __init__), not by convert_model
        "uneven",  # steps dropped or added on a rank without Join (the rank with more waits: not caught)
        "hybrid",  # DataParallel replicas on some processes only
    }
)


@dataclass(frozen=True)
class Step:
    """One step of one rank.

    Args:
        kind: "train" (a training forward), "no_grad" (a training-mode forward under ``torch.no_grad``) or "eval"
            (``model.eval()``, a forward, ``model.train()``).
        branch: the head the forward runs, "a", "b" (width C) or "c" (width C_OTHER).
        backward: for "train", whether the step calls backward on the output.
        checkpoint: for "train", whether the head runs under ``torch.utils.checkpoint(use_reentrant=False)``.
    """

    kind: str = "train"
    branch: str = "a"
    backward: bool = True
    checkpoint: bool = False

    def __repr__(self) -> str:
        return _repr_non_defaults(self, positional=("kind", "branch"))

    @property
    def trains(self) -> bool:
        """Whether the step is a training-mode forward (one that synchronizes)."""
        return self.kind != "eval"

    @property
    def has_backward(self) -> bool:
        return self.kind == "train" and self.backward


@dataclass(frozen=True)
class Program:
    """A multi-rank program: the setup every rank shares (or, for ``compile`` and ``replicas``, each rank's own) and
    each rank's steps.

    Args:
        world_size: the number of ranks (2 or 3).
        steps: each rank's steps, by rank.
        seed: the model's initialization and the inputs.
        naming: "convert" (plain ``nn.BatchNorm1d`` layers through ``convert_model``, named by their qualified
            names) or "direct" (``syncbn_dist.SyncBatchNorm`` built in the model's ``__init__``).
        momentum: every layer's momentum (None: the cumulative average).
        debug: ``syncbn_dist.set_debug(True)`` for the program.
        group_size: 0 for the world group, else every layer on ``syncbn_dist.new_sync_groups(group_size)``.
        compile: each rank's ``torch.compile`` backend, "" for eager (empty: every rank eager).
        replicas: each rank's DataParallel replicas (``DataParallelWithCallback(model, cpu_replicas=2)``), or 1 (no
            wrapper; empty: 1 on every rank).
        join: "" (no Join), "layers" (``Join([join_layers(m)])``), "ddp" (``Join([ddp])``, the layers' joinable
            added by syncbn_dist's extension) or "ddp+layers" (``Join([ddp, join_layers(m)])``); the DDP model has
            ``find_unused_parameters=True`` (the heads a step does not run).
        join_target: which module ``join_layers`` gets: "runner" (the one each step calls: the outermost wrapper) or
            "model" (the converted model inside the wrappers).
        join_throw: ``Join(..., throw_on_early_termination=True)``.
    """

    world_size: int = 2
    steps: tuple[tuple[Step, ...], ...] = ((Step(),), (Step(),))
    seed: int = 0
    naming: str = "convert"
    momentum: Optional[float] = 0.1
    debug: bool = False
    group_size: int = 0
    compile: tuple[str, ...] = ()
    replicas: tuple[int, ...] = ()
    join: str = ""
    join_target: str = "runner"
    join_throw: bool = False

    def __post_init__(self) -> None:
        # Empty: every rank eager, without replicas.
        if not self.compile:
            object.__setattr__(self, "compile", ("",) * self.world_size)
        if not self.replicas:
            object.__setattr__(self, "replicas", (1,) * self.world_size)
        for name in ("steps", "compile", "replicas"):
            if len(getattr(self, name)) != self.world_size:
                raise ValueError(f"expected {name} for {self.world_size} ranks (got {getattr(self, name)!r})")
        if self.group_size and self.world_size % self.group_size:
            raise ValueError(f"expected a group_size that divides {self.world_size} (got {self.group_size})")

    def __repr__(self) -> str:
        return _repr_non_defaults(self, always=("world_size", "steps"))

    @property
    def ddp(self) -> bool:
        return "ddp" in self.join

    def group_of(self, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s process group."""
        size = self.group_size or self.world_size
        first = rank - rank % size
        return tuple(range(first, first + size))

    def groups(self) -> list[tuple[int, ...]]:
        return sorted({self.group_of(rank) for rank in range(self.world_size)})


def _repr_non_defaults(obj: Any, positional: tuple[str, ...] = (), always: tuple[str, ...] = ()) -> str:
    """``Class(...)`` with the fields that differ from their defaults, so that a printed program is short and runs."""
    parts = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.name in positional:
            parts.append(repr(value))
        elif isinstance(value, tuple) and default == () and value and all(v in ("", 1) for v in value):
            continue  # the empty default: every rank eager, or without replicas
        elif f.name in always or value != default:
            parts.append(f"{f.name}={value!r}")
    return f"{type(obj).__name__}({', '.join(parts)})"


# ---------------------------------------------------------------------------------------------------------------
# The model and the inputs
# ---------------------------------------------------------------------------------------------------------------


class FuzzNet(nn.Module):
    """The stem (conv, BatchNorm of C) and the heads (conv, BatchNorm of the head's width): ``forward(x, branch,
    checkpoint)`` runs the stem and one head, the head under activation checkpointing if asked."""

    def __init__(self, norm: Any, momentum: Optional[float]) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv1d(C_IN, C, 1), norm(C, momentum=momentum))
        self.heads = nn.ModuleDict(
            {
                name: nn.Sequential(nn.Conv1d(C, WIDTHS[name], 1), norm(WIDTHS[name], momentum=momentum))
                for name in BRANCHES
            }
        )

    def forward(self, x: Tensor, branch: str, use_checkpoint: bool = False) -> Tensor:
        h = self.stem(x)
        head = self.heads[branch]
        return checkpoint(head, h, use_reentrant=False) if use_checkpoint else head(h)


def norm_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The BatchNorm layers of a :class:`FuzzNet`, by qualified name (the same names in the plain and the synchronized
    model)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}


def plain_model(program: Program) -> FuzzNet:
    """The program's model with ``nn.BatchNorm1d`` layers, float64, initialized from ``program.seed``: the reference,
    and the weights of every rank's model."""
    torch.manual_seed(program.seed)
    return FuzzNet(nn.BatchNorm1d, program.momentum).double()


def synchronized_model(program: Program, process_group: Any) -> nn.Module:
    """The model a rank runs: the plain model's weights in synchronized layers over ``process_group``, by
    ``convert_model`` or built directly (``program.naming``)."""
    plain = plain_model(program)
    if program.naming == "convert":
        return syncbn_dist.convert_model(plain, process_group=process_group)

    def norm(width: int, momentum: Optional[float]) -> nn.Module:
        return syncbn_dist.SyncBatchNorm(width, momentum=momentum, process_group=process_group)

    model = FuzzNet(norm, program.momentum).double()
    model.load_state_dict(plain.state_dict())
    return model


def step_input(program: Program, rank: int, index: int) -> tuple[Tensor, Tensor]:
    """Rank ``rank``'s input (N, C_IN, LENGTH) and output gradient (N, width, LENGTH) at its step ``index``, float64,
    with N from 2 to 4 (uneven across ranks and steps)."""
    step = program.steps[rank][index]
    generator = torch.Generator().manual_seed(program.seed * 7919 + rank * 104729 + index * 31 + 1)
    n = 2 + int(torch.randint(0, 3, (1,), generator=generator))
    x = torch.randn(n, C_IN, LENGTH, generator=generator, dtype=torch.float64) * 2.0 + 1.0
    dy = torch.randn(n, WIDTHS[step.branch], LENGTH, generator=generator, dtype=torch.float64)
    return x, dy


# ---------------------------------------------------------------------------------------------------------------
# The strategy
# ---------------------------------------------------------------------------------------------------------------


def _weighted(draw: Any, choices: list[tuple[Any, int]]) -> Any:
    """One of ``choices`` by integer weight; shrinks towards the first."""
    return draw(st.sampled_from([value for value, weight in choices for _ in range(weight)]))


def _chance(draw: Any, percent: int) -> bool:
    return draw(st.integers(0, 99)) < percent


@st.composite
def _step(draw: Any, include: frozenset[str], ddp: bool) -> Step:
    kinds = [("train", 8)]
    if "no_grad" in include and not ddp:  # a no_grad pass on the DDP model: DDP's own contract, not ours
        kinds.append(("no_grad", 1))
    if "eval" in include:
        kinds.append(("eval", 1))
    kind = _weighted(draw, kinds)
    branches = [("a", 3), ("b", 3)] + ([("c", 1)] if "widths" in include else [])
    branch = _weighted(draw, branches)
    backward = kind != "train" or not ("skip_backward" in include and not ddp) or not _chance(draw, 15)
    use_checkpoint = kind == "train" and "checkpoint" in include and _chance(draw, 20)
    return Step(kind, branch, backward if kind == "train" else True, use_checkpoint)


MUTATIONS = ("branch", "backward", "no_grad", "checkpoint", "eval", "drop", "add")


@st.composite
def programs(draw: Any, include: frozenset[str] = FEATURES) -> Program:
    """A program over 2 or 3 ranks: 1 to 3 steps that every rank shares, then, on some programs, one or two changes
    on single ranks (another head, no backward, a no_grad or eval forward, checkpointing, a step dropped or added).

    Args:
        include: the :data:`FEATURES` to draw.
    """
    unknown = set(include) - FEATURES
    if unknown:
        raise ValueError(f"unknown fuzzer features {sorted(unknown)} (known: {sorted(FEATURES)})")
    world_size = draw(st.sampled_from([2, 3]))
    seed = draw(st.integers(0, 255))
    naming = "direct" if "direct" in include and _chance(draw, 20) else "convert"
    momentum = draw(st.sampled_from([0.1, None]))
    debug = "debug" in include and _chance(draw, 15)
    join, join_target, join_throw = "", "runner", False
    if "join" in include and _chance(draw, 30):
        join = _weighted(draw, [("layers", 3)] + ([("ddp", 1), ("ddp+layers", 2)] if "ddp" in include else []))
        join_target = _weighted(draw, [("runner", 3), ("model", 1)])
        join_throw = _chance(draw, 15)
    group_size = 0
    # Not under Join: DDP broadcasts buffers over the world (each step, and the last joiner's at the Join's end).
    if "subgroups" in include and not join and _chance(draw, 20):
        group_size = draw(st.sampled_from([1, world_size]))
    compiled = ""
    if "compile" in include and not join and _chance(draw, 8):  # seconds each: rarely
        compiled = draw(st.sampled_from(COMPILE_BACKENDS))
    replicas = 1
    if "replicas" in include and not compiled and _chance(draw, 15):
        replicas = 2
    compile_by_rank = [compiled] * world_size
    replicas_by_rank = [replicas] * world_size
    if compiled and _chance(draw, 25):  # one rank compiles with another backend, or runs eagerly
        rank = draw(st.integers(0, world_size - 1))
        compile_by_rank[rank] = draw(st.sampled_from(["", *COMPILE_BACKENDS]))
    if "hybrid" in include and not compiled and _chance(draw, 10):  # replicas on some processes only
        rank = draw(st.integers(0, world_size - 1))
        replicas_by_rank[rank] = 3 - replicas_by_rank[rank]
    ddp = "ddp" in join
    base = draw(st.lists(_step(include, ddp), min_size=1, max_size=3))
    steps = [list(base) for _ in range(world_size)]
    if _chance(draw, 50):
        for _ in range(draw(st.integers(1, 2))):
            _mutate(draw, steps, include, join, ddp)
    if compiled and "eval" in include and _chance(draw, 25):  # a validation on rank 0 alone, before training
        steps[0].insert(0, Step("eval", draw(st.sampled_from(["a", "b"]))))
    return Program(
        world_size=world_size,
        steps=tuple(tuple(s) for s in steps),
        seed=seed,
        naming=naming,
        momentum=momentum,
        debug=debug,
        group_size=group_size,
        compile=tuple(compile_by_rank),
        replicas=tuple(replicas_by_rank),
        join=join,
        join_target=join_target,
        join_throw=join_throw,
    )


def _mutate(draw: Any, steps: list[list[Step]], include: frozenset[str], join: str, ddp: bool) -> None:
    """One change to one rank's steps (in place)."""
    rank = draw(st.integers(0, len(steps) - 1))
    own = steps[rank]
    allowed = ["branch"]
    if "skip_backward" in include and not ddp:
        allowed.append("backward")
    if "no_grad" in include and not ddp:
        allowed.append("no_grad")
    if "checkpoint" in include:
        allowed.append("checkpoint")
    if "eval" in include:
        allowed.append("eval")
    if join or "uneven" in include:
        allowed += ["drop", "add", "add"]
    what = draw(st.sampled_from(allowed))
    if what == "add":
        own.insert(draw(st.integers(0, len(own))), draw(_step(include, ddp)))
        return
    if what == "eval":
        own.insert(draw(st.integers(0, len(own))), Step("eval", draw(st.sampled_from(["a", "b"]))))
        return
    if not own:
        return
    index = draw(st.integers(0, len(own) - 1))
    step = own[index]
    if what == "drop":
        del own[index]
    elif what == "branch":
        others = [b for b in BRANCHES if b != step.branch and (b != "c" or "widths" in include)]
        own[index] = dataclasses.replace(step, branch=draw(st.sampled_from(others)))
    elif what == "backward" and step.kind == "train":
        own[index] = dataclasses.replace(step, backward=not step.backward)
    elif what == "no_grad" and step.kind == "train":
        own[index] = Step("no_grad", step.branch)
    elif what == "checkpoint" and step.kind == "train":
        own[index] = dataclasses.replace(step, checkpoint=not step.checkpoint)


__all__ = [
    "BRANCHES",
    "C",
    "C_OTHER",
    "FEATURES",
    "FuzzNet",
    "Program",
    "Step",
    "WIDTHS",
    "norm_layers",
    "plain_model",
    "programs",
    "step_input",
    "synchronized_model",
]
