"""The guide pages (docs/guides/*.md), as a reader meets them: every code block says what it is, and each page's
script runs as printed, on 2 CPU processes (gloo) or in one, and prints what the page says it prints.

The blocks are marked and run as the README's are (tests/readme_blocks.py); each guide is one whole script, a
``run`` block that starts it and an ``output`` block of what it prints.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from readme_blocks import ROOT, code_blocks, guide_pages, marker_problems, run_blocks

# Left out of make test-quick (docs/testing.md, "The quick tier"): the docs.
pytestmark = pytest.mark.plumbing

GUIDES = guide_pages()


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_there_is_a_guide_for_each_way_of_using_syncbn_dist() -> None:
    assert {page.stem for page in GUIDES} == {"ddp", "dataparallel", "hybrid", "join", "frameworks", "export"}


@pytest.mark.parametrize("page", GUIDES, ids=_name)
def test_every_guide_block_says_what_it_is_and_the_guide_is_a_whole_script(page: Path) -> None:
    blocks = code_blocks(page.read_text())
    problems = marker_problems(blocks, _name(page))
    assert not problems, "\n".join(problems)
    kinds = [block.kind for block in blocks]
    assert "run" in kinds and "output" in kinds, f"{_name(page)}: no script run with what it prints"
    assert kinds.index("output") > kinds.index("run")


def test_the_marker_check_catches_a_wide_line_and_an_output_with_nothing_run() -> None:
    text = "<!-- output -->\n```text\nx\n```\n<!-- run -->\n```python\n" + "x = 1  #" + "-" * 100 + "\n```\n"
    problems = marker_problems(code_blocks(text), "page.md")
    assert problems == ["page.md line 2: an output block with no run block above it",
                        "page.md line 6: lines [7] are wider than 100 columns"]


def _runnable(page: Path) -> object:
    marks = [pytest.mark.over_budget("two torchrun launches, each compiling the model")] if page.stem == "ddp" else []
    return pytest.param(page, id=_name(page), marks=marks)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("page", [_runnable(page) for page in GUIDES])
def test_the_guide_runs_as_printed(page: Path, tmp_path: Path) -> None:
    """The page's blocks in order in a directory outside the tree, with this venv's python and torchrun; every
    ``output`` line is a line the script printed. The suite's environment sets SYNCBN_DIST_KERNELS=native
    (tests/conftest.py), the default kernels.

    The DDP guide is over the test budget: its job is run twice (to show the resume), and each launch compiles the
    model (aot_eager) in both processes, about 25 CPU seconds in all; a smaller job would not show what the page
    teaches."""
    ran = run_blocks(code_blocks(page.read_text()), tmp_path, Path(sys.executable).parent, timeout=180,
                     source=_name(page))
    assert ran
