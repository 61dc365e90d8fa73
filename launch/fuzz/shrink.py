"""A failing program made small for ``make fuzz``: greedy simplifications (a rank fewer, a step fewer, a simpler step
or setup) kept while the program still fails the same way (the same class and kinds of problem).

The fixed-seed test needs none of this: hypothesis shrinks its failure itself. ``make fuzz`` keeps running after a
failure, to count every class in its budget of programs, so it shrinks each class's first failure afterwards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Callable

from .programs import Program, Step


def _drop_last_rank(program: Program) -> Program:
    world_size = program.world_size - 1
    group_size = program.group_size if program.group_size and world_size % program.group_size == 0 else 0
    return dataclasses.replace(
        program,
        world_size=world_size,
        steps=program.steps[:world_size],
        compile=program.compile[:world_size],
        replicas=program.replicas[:world_size],
        group_size=group_size,
    )


def _with_steps(program: Program, rank: int, steps: list[Step]) -> Program:
    by_rank = list(program.steps)
    by_rank[rank] = tuple(steps)
    return dataclasses.replace(program, steps=tuple(by_rank))


def _simpler_steps(step: Step) -> Iterator[Step]:
    if step.checkpoint:
        yield dataclasses.replace(step, checkpoint=False)
    if step.kind == "train" and not step.backward:
        yield dataclasses.replace(step, backward=True)
    if step.kind == "no_grad":
        yield Step("train", step.branch)
    if step.branch != "a":
        yield dataclasses.replace(step, branch="a")
    if step.branch == "c":
        yield dataclasses.replace(step, branch="b")


def candidates(program: Program) -> Iterator[Program]:
    """Simpler programs than ``program``, the greatest simplifications first."""
    if program.world_size > 2:
        yield _drop_last_rank(program)
    for rank, steps in enumerate(program.steps):
        for index in range(len(steps)):
            yield _with_steps(program, rank, [s for i, s in enumerate(steps) if i != index])
    setup = {
        "compile": ("",) * program.world_size,
        "replicas": (1,) * program.world_size,
        "join": "",
        "join_throw": False,
        "join_target": "runner",
        "group_size": 0,
        "debug": False,
        "naming": "convert",
        "momentum": 0.1,
        "seed": 0,
    }
    for name, simple in setup.items():
        if getattr(program, name) != simple:
            yield dataclasses.replace(program, **{name: simple})
    if program.join == "ddp+layers":
        yield dataclasses.replace(program, join="layers")
    for rank, steps in enumerate(program.steps):
        for index, step in enumerate(steps):
            for simpler in _simpler_steps(step):
                yield _with_steps(program, rank, [simpler if i == index else s for i, s in enumerate(steps)])


def shrink(program: Program, still_fails: Callable[[Program], bool], budget: int) -> tuple[Program, int]:
    """The simplest program reached from ``program`` by candidates for which ``still_fails`` holds, trying at most
    ``budget`` of them; and the number tried."""
    tried = 0
    improved = True
    while improved and tried < budget:
        improved = False
        for candidate in candidates(program):
            if tried >= budget:
                break
            tried += 1
            if still_fails(candidate):
                program, improved = candidate, True
                break
    return program, tried
