"""The README, as a reader meets it: every code block says what it is, the runnable ones run as pasted (the quick
start under torchrun on 2 CPU processes), and the generated tables equal their render from the reports' JSON.

``make bench`` and ``make compare`` rewrite the README's tables (``readme: README.md`` in their configs) and
``python -m launch.bench.render`` the GPU one, so the README holds no number typed by hand; a stale or hand-edited
table fails here. tests/readme_blocks.py says how the blocks are marked.
"""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from readme_blocks import (
    README,
    Block,
    code_blocks,
    fragment_names,
    marker_problems,
    readme_blocks,
    run_blocks,
)

from launch.bench import render
from launch.bench.report import markdown, readme_gpu_section
from launch.common.config import ConfigError
from launch.common.readme import check_readme_key, fill_section, read_section
from launch.compare.config import README_SECTION as COMPARE_SECTION
from launch.compare.summary import accuracy_table

# Left out of make test-quick (docs/testing.md, "The quick tier"): the README's code blocks and generated tables.
pytestmark = pytest.mark.plumbing

ROOT = Path(__file__).resolve().parents[1]


def _report(name: str) -> dict:
    return json.loads((ROOT / "docs" / name).read_text())


# ---------------------------------------------------------------------------------------------------------------
# The code blocks
# ---------------------------------------------------------------------------------------------------------------


def test_every_readme_code_block_says_what_it_is() -> None:
    blocks = readme_blocks()
    # Each block marked, each fragment saying so, each line within 100 columns.
    problems = marker_problems(blocks)
    assert not problems, "\n".join(problems)
    kinds = [block.kind for block in blocks]
    # The quick start: a file, the command that runs it, what it prints; all before the first not-run block.
    assert kinds[: kinds.index("not run")] == ["fragment", "file", "run", "output"]
    assert "torchrun --standalone --nproc_per_node=2 quickstart.py" in blocks[2].text



# The README says what the project is and how to use it; docs/ holds the depth (issue 46).
README_MAX_LINES = 400


def test_the_readme_stays_within_its_line_budget() -> None:
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines, over {README_MAX_LINES}: move depth to docs/"


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_what_the_readmes_install_and_make_write_is_ignored_by_git() -> None:
    """The README's ``pip wheel -w dist``, ``make install`` and the recipes leave nothing for ``git status`` to list."""
    assert "pip wheel --no-deps -w dist ." in README.read_text()
    written = ["dist/syncbn_dist-0.1.0-py3-none-any.whl", ".venv/bin/python", "build/lib/x.py",
               "syncbn_dist.egg-info/PKG-INFO", "outputs/digits/metrics.json"]
    done = subprocess.run(["git", "check-ignore", "--no-index", *written], cwd=ROOT, capture_output=True, text=True)
    assert sorted(done.stdout.split()) == sorted(written), f"not ignored: {set(written) - set(done.stdout.split())}"


def test_readme_fragments_parse_and_every_syncbn_dist_name_they_use_exists() -> None:
    fragments = [block for block in readme_blocks() if block.kind == "fragment" and block.language == "python"]
    assert len(fragments) >= 4
    used = set()
    for block in fragments:
        used |= fragment_names(block)  # parses it
    assert {"syncbn_dist:convert_model", "syncbn_dist:patch_sync_batchnorm"} <= used
    for name in sorted(used):
        module, attribute = name.split(":")
        assert hasattr(importlib.import_module(module), attribute), f"the README uses {name}, which does not exist"


def test_the_block_checks_fail_on_what_they_must_catch(tmp_path: Path) -> None:
    text = (
        "<!-- fragment -->\n```python\n# fragment: x is yours\nsyncbn_dist.no_such_name(x)\n```\n"
        "```bash\necho unmarked\n```\n"
        "<!-- run -->\n```bash\necho printed\n```\n<!-- output -->\n```text\nnot printed\n```\n"
    )
    fragment, unmarked, run, output = code_blocks(text)
    assert (fragment.kind, unmarked.kind, run.kind, output.kind) == ("fragment", None, "run", "output")
    assert fragment_names(fragment) == {"syncbn_dist:no_such_name"}
    with pytest.raises(AssertionError, match="'not printed' is not a line"):
        run_blocks([run, output], tmp_path, Path(sys.executable).parent)
    failing = Block("run", "", "python", "raise SystemExit(3)\n", 1)
    with pytest.raises(AssertionError, match="exited 3"):
        run_blocks([failing], tmp_path, Path(sys.executable).parent)
    with pytest.raises(SyntaxError):  # a fragment that does not parse
        fragment_names(Block("fragment", "", "python", "# fragment: broken\ndef (:\n", 1))


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_readme_runs_as_pasted(tmp_path: Path) -> None:
    """Every runnable block, in order, in a directory outside the tree, with this venv's python and torchrun: the
    quick start on 2 CPU processes (gloo)."""
    ran = run_blocks(readme_blocks(), tmp_path, Path(sys.executable).parent)
    assert [block.language for block, _ in ran] == ["bash"]  # the rest runs in the guides (tests/test_guides.py)
    assert "torchrun" in ran[0][0].text and "2 processes, BatchNorm: distributed" in ran[0][1]


# ---------------------------------------------------------------------------------------------------------------
# The generated reports and tables
# ---------------------------------------------------------------------------------------------------------------


def test_generated_reports_and_readme_tables_equal_their_render() -> None:
    """docs/performance.md, docs/performance_cuda.md and the README's CPU and GPU tables, from their JSON."""
    expected = render.renders()
    assert {(path.name, section) for path, section in expected} >= {
        ("performance.md", None),
        ("performance_cuda.md", None),
        ("README.md", "performance table"),
        ("README.md", render.GPU_README_SECTION),
    }
    for (path, section), text in expected.items():
        current = path.read_text() if section is None else read_section(path, section)
        assert current == text, f"{path.name} {section or ''} differs from its render: python -m launch.bench.render"
    assert render.main(["--check"]) == 0


def test_readme_compare_table_is_the_compare_report_rendered() -> None:
    expected = "\n".join(accuracy_table(_report("compare.json"))) + "\n"
    assert read_section(README, COMPARE_SECTION) == expected
    assert expected in (ROOT / "docs" / "compare.md").read_text()  # the same table as the report's


@pytest.mark.parametrize("name", ["performance.json", "performance_cuda.json"])
def test_a_report_has_no_empty_table_and_no_machine_path(name: str) -> None:
    summary = _report(name)
    text = markdown(summary)
    lines = text.splitlines()
    for index, line in enumerate(lines):
        if line.startswith("|---"):
            assert index + 1 < len(lines) and lines[index + 1].startswith("| "), f"{name}: an empty table at {index}"
    assert "thread(s)" not in text and "output_dir=" not in text
    if name == "performance_cuda.json":
        assert summary["command"].count("output_dir=/") == 1  # the JSON keeps it; the report does not show it
        device = summary["machine"]["cuda_devices"][0]
        assert text.startswith(f"# syncbn_dist performance on a GPU ({device})\n")
        assert "Generated by `make bench-gpu`" in text and "Not measured in this run" in text
    else:
        assert text.startswith("# syncbn_dist performance on CPU\n") and "Generated by `make bench`;" in text


def test_the_gpu_table_says_no_report_without_a_step_report_and_renders_one() -> None:
    layer = _report("performance_cuda.json")
    missing = readme_gpu_section(layer, None)
    assert "**no generated report yet**" in missing
    assert "(docs/gpu.md#the-resnet-50-training-step-on-an-h200)" in missing
    assert readme_gpu_section(None, None).count("\n") == 1  # no layer sentence without a layer report

    def row(variant: str, dtype: str, ms: float) -> dict:
        return {"variant": variant, "dtype": dtype, "median_ms": ms}

    step = {
        "device": "a GPU",
        "torch": "2.x",
        "config": {"width": 64, "batch_size": 64, "image_size": 224},
        "rows": [
            row("plain", "bfloat16", 20.0),
            row("torch_function", "bfloat16", 50.0),
            row("syncbn_dist_native", "bfloat16", 40.0),
            row("plain_reduce_overhead", "bfloat16", 10.0),
            row("syncbn_dist_reduce_overhead", "bfloat16", 11.0),
        ],
    }
    text = readme_gpu_section(layer, step)
    assert "not measured" not in text
    assert "| eager, native kernels, bfloat16 | 20.0 | 50.0 | 40.0 | 2.00 | 0.80 |" in text
    assert '| torch.compile "reduce-overhead" (CUDA graphs), bfloat16 | 10.0 | – | 11.0 | 1.10 | – |' in text
    assert "compiled kernels, bfloat16" not in text  # a row that did not run is left out


# ---------------------------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------------------------


def test_fill_section_replaces_only_its_section(tmp_path: Path) -> None:
    path = tmp_path / "README.md"
    path.write_text(
        "intro\n<!-- t: generated by x -->\nold\n<!-- end t -->\n<!-- u: generated by y -->\nkeep\n<!-- end u -->\n"
    )
    fill_section(path, "t", "| new |")
    assert path.read_text() == (
        "intro\n<!-- t: generated by x -->\n| new |\n<!-- end t -->\n<!-- u: generated by y -->\nkeep\n<!-- end u -->\n"
    )
    assert read_section(path, "t") == "| new |\n"
    with pytest.raises(ValueError, match="no section"):
        fill_section(path, "missing", "x")


def test_a_readme_without_the_section_is_a_config_error_before_the_run(tmp_path: Path) -> None:
    check_readme_key(None, "t")  # not set: nothing to check
    path = tmp_path / "README.md"
    path.write_text("no sections\n")
    with pytest.raises(ConfigError, match="config key 'readme': .*no section"):
        check_readme_key(str(path), "t")
    with pytest.raises(ConfigError, match="config key 'readme'"):
        check_readme_key(str(tmp_path / "missing.md"), "t")
