"""The documentation, read two ways.

On the repository's pages (GitHub): every relative link in README.md, CHANGELOG.md and docs/ points to a file of the
repository, and every ``#anchor`` to a heading of its page (GitHub's anchors: the heading lower-cased, punctuation
dropped, spaces as hyphens) or to an object the page renders (``::: name``, an anchor of the site only).

As the site (mkdocs.yml, ``make docs``): the strict build passes, offline; a broken link, a missing anchor, a public
name without a docstring or rendered other than once, and a docstring griffe cannot read each fail it; every name of
``syncbn_dist.__all__`` has exactly one entry, on the API pages; the pictures and the search index are in the site;
and the design page's diagrams are what launch/docs/diagrams.py draws. ``make docs-check`` opens the built site in a
headless browser (launch/docs/browser_check.py): not here, since CI has no browser.
"""

from __future__ import annotations

import ast
import json
import logging
import re
import shutil
import socket
from pathlib import Path

import pytest

from launch.docs import diagrams, site_text
from launch.docs.site_text import ALLOWED, MAX_COLUMNS, path_text

# Left out of make test-quick (docs/testing.md, "The quick tier"): the docs.
pytestmark = pytest.mark.plumbing

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    ROOT / "README.md",
    ROOT / "CHANGELOG.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "docs" / "api").glob("*.md")),
    *sorted((ROOT / "docs" / "guides").glob("*.md")),
]
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
    headings = {github_anchor(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}
    return headings | set(re.findall(r"^::: ([\w.]+)\s*$", text, re.M))


def links_of(page: Path) -> list[str]:
    return [m.group(1) for m in _LINK.finditer(_FENCE.sub("", page.read_text()))]


def public_names() -> list[str]:
    """``syncbn_dist.__all__``, read from the source (importing the package would import torch)."""
    tree = ast.parse((ROOT / "syncbn_dist" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError("syncbn_dist/__init__.py has no literal __all__")


def test_the_anchor_rule_follows_github() -> None:
    assert github_anchor("torch.compile and FSDP2") == "torchcompile-and-fsdp2"
    assert github_anchor("Frameworks that build `torch.nn.SyncBatchNorm` (mmengine, timm)") == (
        "frameworks-that-build-torchnnsyncbatchnorm-mmengine-timm"
    )
    assert github_anchor("SIGABRT or a hang at exit") == "sigabrt-or-a-hang-at-exit"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves_on_the_repository(page: Path) -> None:
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


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def build_site(root: Path, site_dir: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Build the site of the tree at ``root`` (its mkdocs.yml) strictly into ``site_dir``, with every connection
    beyond this machine refused; return the warnings, each of which fails the build (none: it built)."""
    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    from mkdocs.exceptions import Abort

    # Loopback and local sockets stay open: the suite's own (the pooled ranks' connections) may run meanwhile.
    def local(address: object) -> bool:
        return not isinstance(address, tuple) or address[0] in ("127.0.0.1", "::1", "localhost")

    def connect(self: socket.socket, address: object) -> None:
        if not local(address):
            raise OSError(f"the docs build tried to reach the network: {address}")
        return original_connect(self, address)

    def create_connection(address: object, *args: object, **kwargs: object) -> socket.socket:
        if not local(address):
            raise OSError(f"the docs build tried to reach the network: {address}")
        return original_create_connection(address, *args, **kwargs)

    original_connect, original_create_connection = socket.socket.connect, socket.create_connection
    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "create_connection", create_connection)
    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")
    warnings = _Warnings()
    logger = logging.getLogger("mkdocs")
    logger.addHandler(warnings)
    try:
        config = load_config(config_file=str(root / "mkdocs.yml"), site_dir=str(site_dir), strict=True)
        config.plugins.on_startup(command="build", dirty=False)
        try:
            build(config)
        except Abort:
            assert warnings.messages, "the strict build aborted without a warning"
        finally:
            config.plugins.on_shutdown()
    finally:
        logger.removeHandler(warnings)
    return warnings.messages


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site of this tree, built once for the tests that read it."""
    site_dir = tmp_path_factory.mktemp("site")
    with pytest.MonkeyPatch.context() as monkeypatch:
        warnings = build_site(ROOT, site_dir, monkeypatch)
    assert not warnings, "make docs fails (strict, offline):\n" + "\n".join(warnings)
    return site_dir


def test_every_public_name_has_exactly_one_entry_on_the_api_pages(site: Path) -> None:
    names = public_names()
    assert len(names) == len(set(names)) > 20
    entries: dict[str, list[str]] = {}
    for page in site.rglob("*.html"):
        for name in re.findall(r'\bid="syncbn_dist\.(\w+)"', page.read_text()):
            entries.setdefault(name, []).append(str(page.relative_to(site)))
    wrong = {name: entries.get(name, []) for name in names if len(entries.get(name, [])) != 1}
    assert not wrong, f"public names rendered other than once (pages): {wrong}"
    elsewhere = {name: pages for name, pages in entries.items() if name in names and not pages[0].startswith("api/")}
    assert not elsewhere, f"public names rendered outside the API pages: {elsewhere}"


def test_the_pictures_render_on_their_pages_and_the_search_index_holds_the_api(site: Path) -> None:
    for page, image in [
        ("design.html", "transports.svg"),
        ("design.html", "step.svg"),
        ("compare.html", "compare.png"),
        ("performance.html", "performance.png"),
        ("index.html", "compare.png"),
    ]:
        assert re.search(rf'<img [^>]*src="{re.escape(image)}"', (site / page).read_text()), (page, image)
        assert (site / image).stat().st_size > 1000, image
    index = json.loads((site / "search" / "search_index.json").read_text())
    locations = {doc["location"] for doc in index["docs"]}
    assert "api/conversion.html#syncbn_dist.convert_model" in locations
    assert {"index.html", "guides/ddp.html", "guides/join.html", "guides/export.html", "changelog.html"} <= locations


def test_the_site_loads_nothing_from_outside(site: Path) -> None:
    """Scripts, styles, fonts and images come with the site: a reader offline sees what the suite built."""
    outside = []
    for page in site.rglob("*.html"):
        for tag, url in re.findall(r'<(script|link|img|source)\b[^>]*?(?:src|href)="((?:https?:)?//[^"]+)"',
                                   page.read_text()):
            outside.append(f"{page.relative_to(site)}: <{tag}> {url}")
    assert not outside, "\n".join(outside[:20])


def _remove_docstring(path: Path, function: str) -> None:
    source = path.read_text()
    tree = ast.parse(source)
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    docstring = node.body[0]
    assert isinstance(docstring, ast.Expr) and isinstance(docstring.value, ast.Constant), function
    lines = source.split("\n")
    del lines[docstring.lineno - 1 : docstring.end_lineno]
    if len(node.body) == 1:
        lines.insert(docstring.lineno - 1, " " * docstring.col_offset + "pass")
    path.write_text("\n".join(lines))


def _replace_docstring(path: Path, function: str, text: str) -> None:
    source = path.read_text()
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == function)
    docstring = node.body[0]
    lines = source.split("\n")
    lines[docstring.lineno - 1 : docstring.end_lineno] = [" " * docstring.col_offset + f'"""{text}"""']
    path.write_text("\n".join(lines))


def test_the_strict_build_fails_on_each_kind_of_defect(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy of the tree with one defect of each kind: the build fails, and its warnings name every defect."""
    tree = tmp_path / "tree"
    ignore = shutil.ignore_patterns("__pycache__")
    for folder in ("docs", "syncbn_dist", "launch/docs"):
        shutil.copytree(ROOT / folder, tree / folder, ignore=ignore)
    for name in ("mkdocs.yml", "README.md", "CHANGELOG.md"):
        shutil.copy(ROOT / name, tree / name)
    with (tree / "docs" / "training.md").open("a") as page:
        page.write("\n[a page that is not there](no-such-page.md)\n")
    with (tree / "docs" / "compat.md").open("a") as page:
        page.write("\n[a heading that is not there](design.md#no-such-heading)\n")
    with (tree / "README.md").open("a") as readme:
        readme.write("\n[a doc that is not there](docs/no-such-doc.md)\n")
    _remove_docstring(tree / "syncbn_dist" / "settings.py", "is_debug_enabled")
    unreadable = "The mode.\n\n    Args:\n        no_such_argument: x.\n    "  # griffe: not in the signature
    _replace_docstring(tree / "syncbn_dist" / "settings.py", "get_kernels", unreadable)
    switches = tree / "docs" / "api" / "switches.md"
    switches.write_text(switches.read_text().replace("::: syncbn_dist.set_kernels\n", ""))
    with (tree / "docs" / "api" / "errors.md").open("a") as page:
        page.write("\n::: syncbn_dist.set_debug\n")

    warnings = "\n".join(build_site(tree, tmp_path / "site", monkeypatch))
    for expected in [
        "no-such-page.md",  # a broken link
        "'#no-such-heading'",  # a missing anchor
        "no-such-doc.md",  # a broken link in the README (the home page)
        "syncbn_dist.is_debug_enabled has no docstring",  # a public name without a docstring
        "'no_such_argument' does not appear in the function signature",  # a docstring griffe cannot read
        "syncbn_dist.set_kernels (in __all__) is rendered 0 times",  # a public name left out
        "syncbn_dist.set_debug (in __all__) is rendered 2 times",  # a public name twice
    ]:
        assert expected in warnings, f"{expected!r} not among the build's warnings:\n{warnings}"


def test_the_diagrams_are_what_the_script_draws() -> None:
    """docs/*.svg are launch/docs/diagrams.py's output (make docs redraws them): no picture is drawn by hand."""
    for name, draw in diagrams.DIAGRAMS.items():
        committed = (ROOT / "docs" / name).read_text()
        assert committed == draw(), f"docs/{name} differs from its drawing: python -m launch.docs.diagrams"
    step = diagrams.step_svg()
    # The facts it draws: one payload per layer and direction, 2C+6 float64 values (the statistics and the collective's
    # tag), empty shards under Join.
    assert step.count("2C+6 float64") == 4 and "zeros, count 0" in step
    assert "SyncMaster" in diagrams.transports_svg() and "SlavePipe" in diagrams.transports_svg()


# ---------------------------------------------------------------------------------------------------------------
# What a reader sees: paths that link, code that fits
# ---------------------------------------------------------------------------------------------------------------


def test_no_repository_path_is_plain_text_in_the_sites_prose(site: Path) -> None:
    """A page or docstring that names a repository file links to it (launch/docs/site_text.py says how)."""
    found = path_text(site)
    assert not found, "repository paths in prose, to link instead:\n" + "\n".join(
        f"{hit.page} ({hit.owner or 'page text'}): {hit.path!r} in {hit.context!r}" for hit in found
    )


def test_each_path_text_allowance_is_still_needed(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An allowance whose text now links is dropped (ALLOWED, launch/docs/site_text.py)."""
    monkeypatch.setattr(site_text, "ALLOWED", {})
    found = site_text.path_text(site)
    needed = {hit.owner for hit in found} | {hit.page for hit in found}
    assert set(ALLOWED) <= needed, f"allowances no longer needed, to drop: {sorted(set(ALLOWED) - needed)}"


def test_the_path_check_finds_a_plain_path_in_a_docstring_and_passes_a_link_or_code(tmp_path: Path) -> None:
    (tmp_path / "api").mkdir()
    (tmp_path / "api" / "x.html").write_text(
        '<article><h2 id="syncbn_dist.f">f</h2><p>See docs/design.md, "Transports", <a href="d.html">docs/design.md'
        "</a>, <code>tests/test_comm.py</code>.</p></article><p>outside the article: docs/x.md</p>"
    )
    (found,) = path_text(tmp_path)
    assert (found.page, found.owner, found.path) == ("api/x.html", "syncbn_dist.f", "docs/design.md")


def _site_page(page: Path) -> str:
    """The site page of a markdown page of the repository (README.md: the home page)."""
    return "index.html" if page == ROOT / "README.md" else str(page.relative_to(ROOT / "docs").with_suffix(".html"))


_SITE_PAGES = [page for page in PAGES if page != ROOT / "CHANGELOG.md"]  # README.md and docs/: what _site_page maps


def fenced_blocks(text: str) -> list[tuple[int, list[str]]]:
    """Each fenced block of the markdown ``text``, indented ones (in a list item) too: the line of its opening fence
    and its lines as rendered, without the fence's indent."""
    blocks, lines, index = [], text.splitlines(), 0
    while index < len(lines):
        fence = re.match(r"( *)(```|~~~)", lines[index])
        if not fence:
            index += 1
            continue
        indent, end = len(fence.group(1)), index + 1
        while end < len(lines) and not lines[end].strip().startswith(fence.group(2)):
            end += 1
        blocks.append((index + 1, [line[indent:] for line in lines[index + 1 : end]]))
        index = end + 1
    return blocks


@pytest.mark.parametrize("page", _SITE_PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_code_block_fits_100_columns(page: Path) -> None:
    """What the site shows whole at 1280 pixels (docs/stylesheets/extra.css)."""
    name = str(page.relative_to(ROOT))
    wide = [
        f"{name} line {n}: {len(line)} columns"
        for start, lines in fenced_blocks(page.read_text())
        for n, line in enumerate(lines, start + 1)
        if len(line) > MAX_COLUMNS
    ]
    assert not wide, "\n".join(wide)


def test_the_width_check_reads_indented_blocks() -> None:
    text = "- item\n\n  ```\n  " + "x" * 100 + "\n  ```\n\n```python\n" + "y" * 101 + "\n```\n"
    assert fenced_blocks(text) == [(3, ["x" * 100]), (7, ["y" * 101])]
