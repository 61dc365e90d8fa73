"""What a reader of the built site must be able to follow and read: repository paths are links, not plain text in
the prose, and code blocks fit :data:`MAX_COLUMNS`. ``tests/test_docs.py`` and ``make docs-check``
(launch/docs/browser_check.py) both fail on either, less the allowances below.

A page or a docstring that points to a file of the repository links to it (a relative link: the hooks give every
linked repository file a page of its own), so the reader can follow it; a path in plain text cannot be followed. A
docstring renders on a page of docs/api/, so it links as that page would: ``[the conversion contract]
(../api/conversion.md#the-conversion-contract)``. Paths inside code (a command, a file named in backticks) and link
texts are not prose; pages that show a repository file (``source/...``) are not either.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Optional

# docs/..., syncbn_dist/..., launch/..., tests/..., configs/... with at least one more path segment, and the root pages.
REPOSITORY_PATH = re.compile(
    r"(?<![\w/.-])(?:(?:docs|syncbn_dist|launch|tests|configs)/[\w.-]+(?:/[\w.-]+)*|(?:README|CHANGELOG)\.md)"
)
# Plain-text paths left as they are, each with its reason: objects by the name the API pages give them, pages by their
# site path. Drop an entry once its text links.
ALLOWED = {
    "performance_cuda.html": "generated from a GPU run (launch.bench.render), which names files in plain text",
    "performance_fast_paths.html": "generated (launch.bench.fast_paths.render), which names configs in plain text",
}
# The widest line of a code block: at 100 columns a block fits the page at 1280 pixels (docs/stylesheets/extra.css).
MAX_COLUMNS = 100
_NOT_PROSE = {"a", "pre", "code", "script", "style"}
_VOID = {"area", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


@dataclass(frozen=True)
class PathText:
    """A repository path in prose: the page (site-relative), the API object it belongs to (None outside one), the path
    and the sentence around it."""

    page: str
    owner: Optional[str]
    path: str
    context: str


class _Prose(HTMLParser):
    def __init__(self, page: str) -> None:
        super().__init__(convert_charrefs=True)
        self.page, self.open_tags, self.in_article, self.owner = page, [], 0, None
        self.found: list[PathText] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, Optional[str]]]) -> None:
        if tag in _VOID:
            return
        self.open_tags.append(tag)
        self.in_article += tag == "article"
        ident = dict(attrs).get("id") or ""
        if self.in_article and ident.startswith("syncbn_dist."):  # an API entry's heading: what follows is its own
            self.owner = ident

    def handle_endtag(self, tag: str) -> None:
        while self.open_tags:
            closed = self.open_tags.pop()
            self.in_article -= closed == "article"
            if closed == tag:
                break

    def handle_data(self, data: str) -> None:
        if not self.in_article or _NOT_PROSE.intersection(self.open_tags):
            return
        for match in REPOSITORY_PATH.finditer(data):
            context = " ".join(data[max(0, match.start() - 60) : match.end() + 60].split())
            self.found.append(PathText(self.page, self.owner, match.group(0), context))


def path_text(site: Path) -> list[PathText]:
    """Every repository path in the prose of the built ``site``, less :data:`ALLOWED`, page by page."""
    found = []
    for html in sorted(site.rglob("*.html")):
        page = html.relative_to(site).as_posix()
        if page.startswith("source/") or page in ALLOWED:
            continue
        parser = _Prose(page)
        parser.feed(html.read_text(encoding="utf-8"))
        found += [hit for hit in parser.found if hit.owner not in ALLOWED]
    return found
