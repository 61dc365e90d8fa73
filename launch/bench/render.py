"""Render the benchmark's reports again from their stored JSON, measuring nothing: docs/performance.md, the GPU
reports and the README's two performance sections, after a change to the renderer or a GPU run copied in.

    .venv/bin/python -m launch.bench.render                 # from the repository root
    .venv/bin/python -m launch.bench.render --check         # exit 1 if a file differs from its render

``make bench`` writes docs/performance.json and renders the CPU files itself. ``make bench-gpu`` runs on a GPU
machine and writes outputs/bench_gpu/; bring its results into docs/ and render them here::

    cp outputs/bench_gpu/performance.json docs/performance_cuda.json        # the one-layer benchmark (stage micro)
    cp outputs/bench_gpu/resnet50_step.md docs/performance_cuda_step.md     # the ResNet-50 step (stage step)
    .venv/bin/python -m launch.bench.render
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

from launch.bench.config import README_SECTION
from launch.bench.report import markdown, readme_gpu_section, readme_tables
from launch.bench.resnet50_step import read_report
from launch.common.io import write_text
from launch.common.readme import fill_section, read_section

ROOT = Path(__file__).resolve().parents[2]
GPU_README_SECTION = "gpu table"


def _json(path: Path) -> Optional[dict[str, Any]]:
    return json.loads(path.read_text()) if path.is_file() else None


def renders(root: Path = ROOT) -> dict[tuple[Path, Optional[str]], str]:
    """What each generated file (or README section, by name) must hold: ``{(path, section or None): text}``.

    A report whose JSON is absent is left out; the README's GPU section says which report is absent.
    """
    docs = root / "docs"
    cpu, gpu = _json(docs / "performance.json"), _json(docs / "performance_cuda.json")
    step_path = docs / "performance_cuda_step.md"
    step = read_report(step_path) if step_path.is_file() else None
    out: dict[tuple[Path, Optional[str]], str] = {}
    if cpu is not None:
        out[(docs / "performance.md", None)] = markdown(cpu)
        out[(root / "README.md", README_SECTION)] = readme_tables(cpu)
    if gpu is not None:
        out[(docs / "performance_cuda.md", None)] = markdown(gpu)
    out[(root / "README.md", GPU_README_SECTION)] = readme_gpu_section(gpu, step)
    return out


def _current(path: Path, section: Optional[str]) -> Optional[str]:
    if not path.is_file():
        return None
    return path.read_text() if section is None else read_section(path, section)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file differs")
    args = parser.parse_args(argv)
    stale = []
    for (path, section), text in renders().items():
        if _current(path, section) == text:
            continue
        name = str(path.relative_to(ROOT)) + (f" ({section})" if section else "")
        stale.append(name)
        if not args.check:
            if section is None:
                write_text(path, text)
            else:
                fill_section(path, section, text)
            print(f"[render] wrote {name}")
    if args.check and stale:
        print("[render] differ from their render: " + ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
