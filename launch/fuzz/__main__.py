"""make fuzz: many rank-divergent programs, a random seed; each failing class printed as a script that reproduces it.

    .venv/bin/python -m launch.fuzz                                   # 300 programs, a random seed
    .venv/bin/python -m launch.fuzz programs=1000 seed=1234
    .venv/bin/python -m launch.fuzz known_open=true                   # the classes of launch.fuzz.oracle.KNOWN_OPEN too
    .venv/bin/python -m launch.fuzz not_caught=true output=outputs/fuzz  # also what the page lists as not caught
    make fuzz FUZZ_PROGRAMS=300 FUZZ_SEED=1234 FUZZ_ARGS="known_open=true"

Each program is drawn by hypothesis (launch.fuzz.programs), judged by the oracle (launch.fuzz.oracle), run on gloo
ranks (pooled: one set of rank processes for the run; fresh ones for a program that may abort or hang a rank) and
checked (launch.fuzz.check). After the budget, each failing class (the oracle's class and the kinds of problem) has
its first program shrunk (launch.fuzz.shrink) and printed as a script, with how many programs failed that way. The
exit code is 1 if a program failed, 2 for a bad config.
"""

from __future__ import annotations

import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from hypothesis import HealthCheck, Phase, assume, given, seed, settings

from launch.common.config import ConfigError, config_error_exit, non_negative, parse_config, positive
from launch.common.io import write_text
from launch.common.spawn import pooled_worlds

from .check import kind_of, problems
from .oracle import decide, selected
from .programs import FEATURES, Program, programs
from .repro import script
from .runner import run_program
from .shrink import shrink


@dataclass
class FuzzConfig:
    programs: int = positive(300)  # programs run (those the selection leaves out are not counted)
    seed: Optional[int] = None  # None: a random seed, printed
    features: list[str] = field(default_factory=lambda: sorted(FEATURES))  # what the strategy draws
    known_open: bool = False  # also programs in the oracle's KNOWN_OPEN classes
    not_caught: bool = False  # also classes the page lists as not caught (fresh processes; seconds each)
    shrink_runs: int = non_negative(40)  # runs to shrink each failing class's first program (0: print it as found)
    output: Optional[str] = None  # a directory to write each failing class's script into


@dataclass
class Finding:
    """The programs that failed one way: the oracle's class and the kinds of problem."""

    count: int = 0
    program: Optional[Program] = None
    found: list[str] = field(default_factory=list)


def explore(cfg: FuzzConfig, run_seed: int) -> tuple[Counter, dict[tuple[str, str], Finding]]:
    """Run ``cfg.programs`` programs; the number run by class, and the failures by (class, kinds)."""
    runs: Counter = Counter()
    findings: dict[tuple[str, str], Finding] = {}
    include = frozenset(cfg.features)

    @seed(run_seed)
    @settings(
        max_examples=cfg.programs,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    )
    @given(programs(include))
    def one(program: Program) -> None:
        verdict = decide(program)
        assume(selected(verdict, known_open=cfg.known_open, not_caught=cfg.not_caught))
        found = problems(run_program(program))
        runs[verdict.name] += 1
        total = sum(runs.values())
        if found:
            finding = findings.setdefault((verdict.name, kind_of(found)), Finding())
            finding.count += 1
            if finding.program is None:
                finding.program, finding.found = program, found
        if total % 25 == 0:
            print(f"  {total} programs, {sum(f.count for f in findings.values())} failed", flush=True)

    one()
    return runs, findings


def _key(program: Program) -> tuple[str, str]:
    found = problems(run_program(program))
    return decide(program).name, kind_of(found) if found else ""


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        cfg = parse_config(FuzzConfig, argv, __doc__.splitlines()[0])
        unknown = sorted(set(cfg.features) - FEATURES)
        if unknown:
            raise ConfigError(f"config key 'features': expected names from {sorted(FEATURES)} (got {unknown})")
    except ConfigError as error:
        return config_error_exit(error)
    run_seed = cfg.seed if cfg.seed is not None else random.randrange(2**32)
    print(f"make fuzz: {cfg.programs} programs, seed={run_seed} (rerun: make fuzz FUZZ_SEED={run_seed})", flush=True)
    start = time.monotonic()
    with pooled_worlds():
        runs, findings = explore(cfg, run_seed)
        explored_s = time.monotonic() - start
        scripts: list[tuple[tuple[str, str], Finding, str]] = []
        for key, finding in sorted(findings.items()):
            assert finding.program is not None
            program, tried = finding.program, 0
            if cfg.shrink_runs:
                program, tried = shrink(program, lambda p, key=key: _key(p) == key, cfg.shrink_runs)
            found = problems(run_program(program))
            scripts.append((key, finding, script(program, decide(program), found or finding.found)))
    _report(cfg, run_seed, runs, scripts, explored_s, time.monotonic() - start)
    return 1 if findings else 0


def _report(
    cfg: FuzzConfig, run_seed: int, runs: Counter, scripts: list[Any], explored_s: float, wall_s: float
) -> None:
    total = sum(runs.values())
    failed = sum(finding.count for _, finding, _ in scripts)
    print(f"\n{total} programs in {explored_s:.0f} s ({wall_s:.0f} s with shrinking), seed={run_seed}: {failed} failed")
    print("programs by class:")
    for name, count in runs.most_common():
        print(f"  {count:5d}  {name}")
    for index, ((name, kinds), finding, text) in enumerate(scripts):
        print(f"\n=== failing class {index + 1}: {name}: {kinds} ({finding.count} of {runs[name]} programs) ===")
        print(text)
        if cfg.output is not None:
            write_text(Path(cfg.output) / f"fuzz_{run_seed}_{index + 1}.py", text)
    if cfg.output is not None and scripts:
        print(f"scripts written to {cfg.output}/")


if __name__ == "__main__":
    sys.exit(main())
