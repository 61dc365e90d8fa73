"""The distribution: the wheel and the sdist built from the repository's files, installed outside the source tree.

The tests run against an editable install, which imports from the tree whatever pyproject.toml declares; only a
built wheel shows what a user gets. The wheel is built without build isolation (setuptools is already in the venv;
isolation would fetch it, and the dependency resolution could pull a CUDA torch), from a copy of the files git
would put in a fresh clone, and installed with the running torch into a new venv that has no path to the tree. In
that venv the README's runnable blocks run as a new user would paste them (tests/readme_blocks.py).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest
from readme_blocks import GUIDES, code_blocks, readme_blocks, run_blocks

import syncbn_dist

# Left out of make test-quick (docs/testing.md, "The quick tier"): the built wheel in a fresh venv.
pytestmark = pytest.mark.plumbing

ROOT = Path(__file__).resolve().parents[1]


def _run(command: list[str], cwd: Path, timeout: float = 180) -> str:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    output = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}:\n{output}"
    return done.stdout


def _fresh_clone(destination: Path) -> Path:
    """The files a clone of the working tree would hold (tracked, and untracked but not ignored), copied."""
    listed = _run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], ROOT).split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():  # a tracked file deleted in the working tree is not there
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, destination / name)
    return destination


def _package_files() -> set[str]:
    """What must be installed: every file of the package in the source tree (modules of every subpackage, py.typed)."""
    package = ROOT / "syncbn_dist"
    return {
        path.relative_to(ROOT).as_posix()
        for path in package.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }


def test_version_comes_from_the_distribution_metadata() -> None:
    assert syncbn_dist.__version__ == version("syncbn_dist") != "0+unknown"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.over_budget("a new venv with torch, the wheel built and installed, 2 ranks and the README run in it")
def test_wheel_installed_outside_the_tree_imports_and_synchronizes(tmp_path: Path) -> None:
    """The wheel and sdist of a fresh copy of the tree, installed into a new venv with no path to the tree: it imports,
    synchronizes 2 gloo ranks and runs the README's blocks as pasted.

    Over 30 s: the venv, torch installed into it (from pip's cache), the builds and the installed runs are each
    separate processes that import torch; what a user gets from the distribution is the assertion."""
    source = _fresh_clone(tmp_path / "clone")
    # A venv of the base interpreter with nothing in it, then the running torch (this machine's CPU build, from pip's
    # cache for others) and later the wheel: no editable install, no .pth into the tree.
    venv = tmp_path / "venv"
    pip = [sys.executable, "-m", "pip"]
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path)
    python = str(venv / "bin" / "python")
    # The distribution's version (2.13.0+cpu here; PyPI's CUDA builds report torch.__version__ 2.10.0+cu128 for 2.10.0).
    # --no-compile: pip would byte-compile all of torch (2300 modules, 10 s of CPU) and its dependencies; the first
    # import below compiles the ones imported (about 1800 with syncbn_dist's, 2 s) into the venv's __pycache__, which
    # the processes after it read.
    torch_spec = f"torch=={version('torch')}"
    _run([*pip, "--python", python, "install", "--quiet", "--no-compile", torch_spec], tmp_path, timeout=600)
    work = tmp_path / "elsewhere"  # the working directory: outside the tree, and the script's own directory
    work.mkdir()
    # The clone on sys.path by hand, before anything is built in it (no metadata anywhere): the version's fallback.
    probe = f"import sys; sys.path.insert(0, {str(source)!r}); import syncbn_dist; print(syncbn_dist.__version__)"
    assert _run([python, "-I", "-c", probe], work).strip() == "0+unknown"

    dist_dir = tmp_path / "dist"
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(dist_dir), str(source)], tmp_path)
    backend = "import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])"
    _run([sys.executable, "-c", backend, str(dist_dir)], source)
    (wheel,) = dist_dir.glob("syncbn_dist-*.whl")
    (sdist,) = dist_dir.glob("syncbn_dist-*.tar.gz")
    expected = _package_files()
    assert {"syncbn_dist/comm/__init__.py", "syncbn_dist/py.typed"} <= expected
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    assert expected <= in_wheel, f"missing from the wheel: {sorted(expected - in_wheel)}"
    assert not [n for n in in_wheel if n.startswith(("launch/", "tests/"))]  # the recipes and tests stay out
    in_sdist = {name.split("/", 1)[1] for name in tarfile.open(sdist).getnames() if "/" in name}
    assert expected <= in_sdist, f"missing from the sdist: {sorted(expected - in_sdist)}"

    _run([*pip, "--python", python, "install", "--quiet", "--no-deps", str(wheel)], tmp_path)
    _run([*pip, "--python", python, "check"], tmp_path)  # the wheel's torch requirement holds for this torch
    script = shutil.copy(ROOT / "tests" / "installed_check.py", work)
    # -I: no PYTHONPATH, no user site, not even the script's directory on sys.path.
    out = _run([python, "-I", script, str(ROOT), syncbn_dist.__version__], work, timeout=240)
    assert "2-rank gloo parity ok" in out

    # A new user's path: the README's runnable blocks (the quick start under torchrun on 2 processes) and the Join
    # guide's script, unchanged, with this venv's python and torchrun first on PATH, outside the tree.
    ran = run_blocks(readme_blocks(), tmp_path / "readme", venv / "bin", timeout=240)
    assert "2 processes, BatchNorm: distributed" in ran[0][1]
    join_guide = GUIDES / "join.md"
    ran = run_blocks(code_blocks(join_guide.read_text()), tmp_path / "join", venv / "bin", timeout=240,
                     source="docs/guides/join.md")
    assert "batches per process under Join: [3, 4]" in ran[0][1]  # Join with torch alone installed (no numpy)
