"""The code blocks of the README and the guide pages, what each one is, and running them as a reader would paste
them.

Shared by tests/test_readme.py (the editable install), tests/test_guides.py (the guide pages, docs/guides/*.md),
tests/test_packaging.py (a fresh venv holding torch and the built wheel) and tests/test_gpu.py (the quick start on
the GPUs). Every fenced block of README.md and of a guide page has an HTML comment on the line just above its
opening fence that says what it is:

- ``<!-- run -->``: run as pasted: a ``python`` block as a script, a ``bash`` block with ``bash -e``, in a scratch
  directory that holds the ``file`` blocks above it, with the venv's ``bin`` first on ``PATH``;
- ``<!-- file NAME -->``: a ``python`` block saved there as NAME, for a later ``run`` block;
- ``<!-- output -->``: lines that the ``run`` block above it prints, each a whole line of its standard output;
- ``<!-- fragment -->``: not run, because it uses names the reader supplies; its first line says so to the reader
  (``# fragment: ...``), and a ``python`` fragment must parse;
- ``<!-- not run: WHY -->``: commands the tests do not run (installing packages, the suite itself).

A block without one of these fails tests/test_readme.py or tests/test_guides.py, so a new block cannot go unrun
by accident. Every line of a block fits :data:`MAX_COLUMNS`, so that the site shows it whole.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from launch.common.torchrun import env_outside_torchrun
from launch.docs.site_text import MAX_COLUMNS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDES = ROOT / "docs" / "guides"
KINDS = ("run", "file", "output", "fragment", "not run")
_MARKER = re.compile(r"<!-- (run|file|output|fragment|not run)(?:[ :] *(.*?))? -->")


@dataclass(frozen=True)
class Block:
    """One fenced code block: its ``kind`` (one of :data:`KINDS`, or None without a marker), the marker's argument
    (the file name of a ``file`` block, the reason of a ``not run`` one), the fence's language, the text between
    the fences and the 1-based line of the opening fence."""

    kind: str | None
    arg: str
    language: str
    text: str
    line: int


def code_blocks(text: str) -> list[Block]:
    """Every fenced block of the markdown ``text``, in order, with the marker on the line above it."""
    lines = text.splitlines()
    blocks = []
    index = 0
    while index < len(lines):
        if not lines[index].startswith("```"):
            index += 1
            continue
        opening = index
        end = next((i for i in range(opening + 1, len(lines)) if lines[i].startswith("```")), None)
        if end is None:
            raise ValueError(f"line {opening + 1}: a code block that never closes")
        marker = _MARKER.fullmatch(lines[opening - 1].strip()) if opening > 0 else None
        blocks.append(
            Block(
                kind=marker.group(1) if marker else None,
                arg=(marker.group(2) or "").strip() if marker else "",
                language=lines[opening][3:].strip(),
                text="\n".join(lines[opening + 1 : end]) + "\n",
                line=opening + 1,
            )
        )
        index = end + 1
    return blocks


def fragment_names(block: Block) -> set[str]:
    """The ``syncbn_dist`` names a python block uses: ``syncbn_dist.NAME`` and ``from syncbn_dist[.MODULE] import
    NAME``, as ``MODULE:NAME`` (``syncbn_dist:convert_model``, ``syncbn_dist.lightning:SyncBatchNormPlugin``)."""
    names = set()
    for node in ast.walk(ast.parse(block.text)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "syncbn_dist":
            names.add(f"syncbn_dist:{node.attr}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "syncbn_dist":
            names.update(f"{node.module}:{alias.name}" for alias in node.names)
    return names


def marker_problems(blocks: list[Block], source: str = "README") -> list[str]:
    """What is wrong with the markers of ``blocks`` (of the page ``source``): a block without one, a ``fragment``
    that does not say so first, a ``file`` block that is not a ``.py`` file, a ``not run`` one that gives no reason,
    an ``output`` block with no ``run`` block above it, a line wider than :data:`MAX_COLUMNS`. Empty: all good."""
    problems = []
    ran = False
    for block in blocks:
        where = f"{source} line {block.line}"
        if block.kind is None:
            problems.append(f"{where}: no <!-- {' | '.join(KINDS)} --> marker above the block")
        if block.kind == "fragment" and not block.text.startswith("# fragment: "):  # the reader sees it too
            problems.append(f"{where}: a fragment says '# fragment: ...' first")
        if block.kind == "file" and not (block.language == "python" and block.arg.endswith(".py")):
            problems.append(f"{where}: a file block is a python block saved as NAME.py")
        if block.kind == "not run" and not block.arg:
            problems.append(f"{where}: a 'not run' block says why")
        ran = ran or block.kind == "run"
        if block.kind == "output" and not ran:
            problems.append(f"{where}: an output block with no run block above it")
        wide = [n for n, line in enumerate(block.text.splitlines(), block.line + 1) if len(line) > MAX_COLUMNS]
        if wide:
            problems.append(f"{where}: lines {wide} are wider than {MAX_COLUMNS} columns")
    return problems


def run_blocks(
    blocks: list[Block],
    workdir: Path,
    bin_dir: Path,
    env: Mapping[str, str] | None = None,
    timeout: float = 120,
    source: str = "README",
) -> list[tuple[Block, str]]:
    """Run the ``run`` blocks of ``blocks`` in order in ``workdir``, after writing the ``file`` blocks above each,
    and check every ``output`` block against the standard output of the run before it.

    ``bin_dir`` holds the ``python`` and ``torchrun`` a reader's shell finds first. The environment is ``env`` (default
    this process's) without what torchrun sets for its workers (a test may run inside one) and without
    ``PYTHONPATH``, with one intra-op thread per process (the processes share the cores). ``source`` names the page
    in the messages.

    Returns:
        ``(block, stdout)`` for each ``run`` block.

    Raises:
        AssertionError: a block exited non-zero (with its output), or an ``output`` line was not printed.
    """
    environment = env_outside_torchrun(env, OMP_NUM_THREADS="1")
    environment.pop("PYTHONPATH", None)
    environment["PATH"] = f"{bin_dir}{os.pathsep}{environment.get('PATH', '')}"
    workdir.mkdir(parents=True, exist_ok=True)
    ran: list[tuple[Block, str]] = []
    for block in blocks:
        if block.kind == "file":
            (workdir / block.arg).write_text(block.text)
        elif block.kind == "run":
            if block.language == "python":
                script = workdir / f"line_{block.line}.py"
                script.write_text(block.text)
                command = [str(bin_dir / "python"), script.name]
            else:
                command = ["bash", "-e", "-c", block.text]
            done = subprocess.run(
                command, cwd=workdir, env=environment, capture_output=True, text=True, timeout=timeout
            )
            assert done.returncode == 0, (
                f"{source} line {block.line} exited {done.returncode}:\n{block.text}\n"
                f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
            )
            ran.append((block, done.stdout))
        elif block.kind == "output":
            assert ran, f"{source} line {block.line}: an output block with no run block above it"
            printed = ran[-1][1].splitlines()
            for expected in filter(None, block.text.splitlines()):
                assert expected in printed, (
                    f"{source} line {block.line}: {expected!r} is not a line that line {ran[-1][0].line} printed:"
                    f"\n{ran[-1][1][-3000:]}"
                )
    return ran


def readme_blocks() -> list[Block]:
    """The code blocks of the repository's README.md."""
    return code_blocks(README.read_text())


def guide_pages() -> list[Path]:
    """The guide pages, docs/guides/*.md, in name order."""
    return sorted(GUIDES.glob("*.md"))
