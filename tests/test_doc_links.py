"""Every relative link in README.md and docs/*.md points to a file of the repository, and every ``#anchor`` to a
heading of its page (GitHub's anchors: the heading lower-cased, punctuation dropped, spaces as hyphens). Pages move
(issue 46 moved "What has run where" into docs/gpu.md); a link left behind is found here, not by a reader."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

# Left out of make test-quick (docs/testing.md, "The quick tier"): the docs.
pytestmark = pytest.mark.plumbing

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, inline code marks and punctuation other than ``-``
    and ``_`` dropped, each space a hyphen."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors_of(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text())
    return {github_anchor(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def links_of(page: Path) -> list[str]:
    return [m.group(1) for m in _LINK.finditer(_FENCE.sub("", page.read_text()))]


def test_the_anchor_rule_follows_github() -> None:
    assert github_anchor("torch.compile and FSDP2") == "torchcompile-and-fsdp2"
    assert github_anchor("Frameworks that build `torch.nn.SyncBatchNorm` (mmengine, timm)") == (
        "frameworks-that-build-torchnnsyncbatchnorm-mmengine-timm"
    )
    assert github_anchor("SIGABRT or a hang at exit") == "sigabrt-or-a-hang-at-exit"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for link in links_of(page):
        if re.match(r"[a-z]+:", link):  # http(s):, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no file {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}")
        elif anchor and target.suffix == ".md" and anchor not in anchors_of(target):
            broken.append(f"{link}: no heading with anchor #{anchor} in {target.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)
