"""A failing program as a script that reproduces it: the program as a literal, what each rank does as torch code in a
comment, and :func:`reproduce`, which runs it on fresh gloo processes and prints what every rank did and what the check
found."""

from __future__ import annotations

from .check import problems
from .oracle import TABLE, Verdict
from .programs import Program, Step
from .runner import Run, run_program


def setup_lines(program: Program) -> list[str]:
    """The setup every rank runs, as torch code."""
    group = f"syncbn_dist.new_sync_groups({program.group_size})" if program.group_size else "None"
    if program.naming == "convert":
        lines = [f"model = syncbn_dist.convert_model(FuzzNet(nn.BatchNorm1d), process_group={group})"]
    else:
        lines = [f"model = FuzzNet(syncbn_dist.SyncBatchNorm, process_group={group})  # built directly"]
    if program.momentum != 0.1:
        lines[0] += f"  # momentum={program.momentum}"
    if program.debug:
        lines.insert(0, "syncbn_dist.set_debug(True)")
    for rank in range(program.world_size):
        wrapped = "model"
        if program.replicas[rank] > 1:
            wrapped = f"DataParallelWithCallback({wrapped}, cpu_replicas={program.replicas[rank]})"
        if program.ddp:
            wrapped = f"DistributedDataParallel({wrapped}, find_unused_parameters=True)"
        if program.compile[rank]:
            wrapped = f"torch.compile({wrapped}, backend={program.compile[rank]!r})"
        lines.append(f"run = {wrapped}  # rank {rank}" if program.world_size > 1 else f"run = {wrapped}")
    if program.join:
        target = "run" if program.join_target == "runner" else "model"
        joinables = {"layers": f"[syncbn_dist.join_layers({target})]", "ddp": "[ddp]"}.get(
            program.join, f"[ddp, syncbn_dist.join_layers({target})]"
        )
        throw = ", throw_on_early_termination=True" if program.join_throw else ""
        lines.append(f"with Join({joinables}{throw}):  # the steps below")
    return _dedupe_ranks(lines)


def _dedupe_ranks(lines: list[str]) -> list[str]:
    """One ``run = ...`` line where every rank wraps alike."""
    runs = [line for line in lines if line.startswith("run = ")]
    bodies = {line.split("  # rank")[0] for line in runs}
    if len(bodies) == 1 and len(runs) > 1:
        first = lines.index(runs[0])
        lines = [line for line in lines if not line.startswith("run = ")]
        lines.insert(first, bodies.pop())
    return lines


def step_line(step: Step) -> str:
    """One step as torch code (``x``, ``dy``: the step's input and output gradient)."""
    if step.kind == "eval":
        return f"model.eval(); run(x, {step.branch!r}); model.train()"
    if step.kind == "no_grad":
        return f"with torch.no_grad(): run(x, {step.branch!r})"
    call = f"run(x, {step.branch!r}{', use_checkpoint=True' if step.checkpoint else ''})"
    return f"{call}.backward(dy)" if step.backward else f"{call}  # no backward"


def steps_lines(program: Program) -> list[str]:
    lines = []
    for rank, steps in enumerate(program.steps):
        lines.append(f"rank {rank}:" + ("" if steps else " (no step)"))
        lines += [f"    {step_line(step)}" for step in steps]
    return lines


def script(program: Program, verdict: Verdict, found: list[str]) -> str:
    """A standalone script that reproduces ``program``'s failure (run it from the repository root)."""
    expected = TABLE[verdict.row].error if verdict.outcome == "raise" else verdict.outcome
    code = "\n".join(f"#   {line}" for line in setup_lines(program) + steps_lines(program))
    found_text = "\n".join(f"#   {line[:300]}" for line in found)
    return f'''"""Fuzzer finding: class {verdict.name} (expected: {expected}).

Run from the repository root: .venv/bin/python THIS_FILE.py
"""
# What each rank does (launch/fuzz/programs.py: FuzzNet, step_input):
{code}
# Where the ranks part: {verdict.detail}
# What the fuzzer saw:
{found_text}
from launch.fuzz.programs import Program, Step
from launch.fuzz.repro import reproduce

PROGRAM = {program!r}

if __name__ == "__main__":
    raise SystemExit(reproduce(PROGRAM))
'''


def summary(run: Run) -> list[str]:
    """Each rank's outcome, one line each (or the job's failure)."""
    if run.records is None:
        return [f"the job: {run.failure}: {run.text[:300]}"]
    lines = []
    for rank, record in enumerate(run.records):
        if record.outcome == "ok":
            lines.append(f"rank {rank}: ran to the end")
        else:
            message = record.chain[0][1].strip().splitlines()[0][:200] if record.chain[0][1].strip() else ""
            lines.append(
                f"rank {rank}: {record.outcome} at step {record.where} after {record.elapsed_s:.1f} s"
                f"{' (the group timeout)' if record.timeout else ''}: {message}"
            )
    return lines


def reproduce(program: Program) -> int:
    """Run ``program`` on fresh processes; print the verdict, each rank's outcome and what the check found. Returns
    (and exits with, from a script) 1 if it found a problem, else 0."""
    run = run_program(program, fresh=True)
    found = problems(run)
    print(f"class: {run.verdict.name}; expected: {run.verdict.outcome} ({run.verdict.detail})")
    for line in summary(run):
        print("  " + line)
    for line in found:
        print("problem: " + line)
    print("ok: as the oracle says" if not found else f"{len(found)} problem(s)")
    return 1 if found else 0

