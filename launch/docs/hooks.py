"""MkDocs hooks of the documentation site (mkdocs.yml): the repository's root pages, links out of docs/, and the API
reference's completeness. Loaded by MkDocs from its path, so it imports nothing of the repository.

- README.md is the home page (``index.md``), whole: its "Using it" section points to the guide pages, which live in
  docs/guides/ with the scripts tests/test_guides.py runs. CHANGELOG.md is ``changelog.md``. Their links, written
  from the repository root, are rebased onto docs/.
- A link from a page to a repository file outside docs/ goes to that file's page on the site: README.md to the home
  page, CHANGELOG.md to the changelog, any other file to a page that shows its source (``source/...``, out of the
  nav). A link to a file that does not exist is left as it is, for MkDocs to report.
- The API pages (docs/api/) render every name of ``syncbn_dist.__all__`` exactly once (``::: syncbn_dist.NAME``),
  and every object they render has a docstring of its own.

Anything wrong is a warning, and the strict build (``make docs``, tests/test_docs.py) fails on it.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path
from typing import Any

import griffe
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files, InclusionLevel
from mkdocs.structure.pages import Page

log = logging.getLogger("mkdocs.hooks.syncbn_dist")

# Repository files outside docs/ that are pages of their own.
ROOT_PAGES = {"README.md": "index.md", "CHANGELOG.md": "changelog.md"}
API_PAGES = "api/"
PACKAGE = "syncbn_dist"
SOURCE_PAGES = "source/"

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_LINK = re.compile(r"(\]\()([^)\s]+)(\))")
_DIRECTIVE = re.compile(r"^::: ([\w.]+)\s*$", re.M)
_LANGUAGES = {".py": "python", ".sh": "bash", ".yaml": "yaml", ".yml": "yaml", ".toml": "toml", ".json": "json"}


def _root(config: MkDocsConfig) -> Path:
    return Path(config.config_file_path).resolve().parent


def _outside_code(text: str, rewrite) -> str:
    """``rewrite`` applied to the text between fenced code blocks."""
    out, last = [], 0
    for fence in _FENCE.finditer(text):
        out.append(rewrite(text[last : fence.start()]))
        out.append(fence.group(0))
        last = fence.end()
    out.append(rewrite(text[last:]))
    return "".join(out)


def _site_uri(repo_path: str, root: Path, docs: str) -> str | None:
    """The site page or file of a repository path (a file under docs/, a root page, or a source page)."""
    if repo_path.startswith(docs + "/"):
        return repo_path[len(docs) + 1 :]
    if repo_path in ROOT_PAGES:
        return ROOT_PAGES[repo_path]
    if not repo_path.startswith("..") and (root / repo_path).is_file():
        return f"{SOURCE_PAGES}{repo_path}.md"
    return None


def _rebase(text: str, from_dir: str, page_uri: str, root: Path, docs: str) -> str:
    """Links written from ``from_dir`` (a folder of the repository, "" for its root) rewritten for the site page
    ``page_uri``."""

    def link(match: re.Match[str]) -> str:
        target = match.group(2)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            return match.group(0)
        path, hash_, anchor = target.partition("#")
        if not path:
            return match.group(0)
        repo_path = posixpath.normpath(posixpath.join(from_dir, path))
        uri = _site_uri(repo_path, root, docs)
        if uri is None:
            return match.group(0)
        relative = posixpath.relpath(uri, posixpath.dirname(page_uri) or ".")
        return f"{match.group(1)}{relative}{hash_}{anchor}{match.group(3)}"

    return _outside_code(text, lambda part: _LINK.sub(link, part))


def on_files(files: Files, config: MkDocsConfig) -> Files:
    root = _root(config)
    docs = Path(config.docs_dir).resolve().relative_to(root).as_posix()
    generated: dict[str, str] = {}
    readme = (root / "README.md").read_text(encoding="utf-8")
    generated["index.md"] = _rebase(readme, "", "index.md", root, docs)
    changelog = root / "CHANGELOG.md"
    if changelog.is_file():
        generated["changelog.md"] = _rebase(changelog.read_text(encoding="utf-8"), "", "changelog.md", root, docs)
    # Every repository file a page links to outside docs/ gets a page that shows it.
    texts = [(docs + "/" + posixpath.dirname(f.src_uri), f.content_string) for f in files.documentation_pages()]
    texts += [("", readme), ("", changelog.read_text(encoding="utf-8") if changelog.is_file() else "")]
    for from_dir, text in texts:
        for match in _LINK.finditer(_FENCE.sub("", text)):
            path = match.group(2).partition("#")[0]
            if not path or re.match(r"[a-z][a-z0-9+.-]*:", path):
                continue
            repo_path = posixpath.normpath(posixpath.join(from_dir, path))
            uri = _site_uri(repo_path, root, docs)
            if uri is not None and uri.startswith(SOURCE_PAGES) and uri not in generated:
                source = (root / repo_path).read_text(encoding="utf-8")
                language = _LANGUAGES.get(Path(repo_path).suffix, "text")
                generated[uri] = f"# {repo_path}\n\n```{language}\n{source.rstrip()}\n```\n"
    for uri, text in generated.items():
        if files.get_file_from_path(uri) is not None:
            log.warning(f"docs/{uri} would hide the page the site makes from the repository (launch/docs/hooks.py)")
            continue
        inclusion = InclusionLevel.NOT_IN_NAV if uri.startswith(SOURCE_PAGES) else InclusionLevel.UNDEFINED
        files.append(File.generated(config, uri, content=text, inclusion=inclusion))
    _check_api(files, root)
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files, **kwargs: Any) -> str:
    """Links from a page under docs/ to the repository outside it go to the site's page for the target."""
    if page.file.generated_by is not None:
        return markdown
    root = _root(config)
    docs = Path(config.docs_dir).resolve().relative_to(root).as_posix()
    from_dir = posixpath.join(docs, posixpath.dirname(page.file.src_uri)).rstrip("/")
    return _rebase(markdown, from_dir, page.file.src_uri, root, docs)


def _check_api(files: Files, root: Path) -> None:
    """Every name of the package's ``__all__`` rendered exactly once on the API pages, each with a docstring."""
    rendered: dict[str, list[str]] = {}
    for file in files.documentation_pages():
        for ident in _DIRECTIVE.findall(_FENCE.sub("", file.content_string)):
            rendered.setdefault(ident, []).append(file.src_uri)
            if not file.src_uri.startswith(API_PAGES):
                log.warning(f"{file.src_uri} renders {ident}: the API reference is docs/{API_PAGES} only")
    package = griffe.load(root / PACKAGE, resolve_aliases=False)  # this tree's, not an installed copy
    exports = list(package.exports or [])
    if not exports:
        log.warning(f"{PACKAGE}.__all__ is empty or not a literal list that griffe can read")
    for name in exports:
        pages = rendered.get(f"{PACKAGE}.{name}", [])
        if len(pages) != 1:
            where = ", ".join(pages) if pages else "no page"
            log.warning(f"{PACKAGE}.{name} (in __all__) is rendered {len(pages)} times on the API pages ({where})")
    for ident in rendered:
        if not ident.startswith(PACKAGE + ".") and ident != PACKAGE:
            continue
        try:
            obj = package[ident[len(PACKAGE) + 1 :]] if ident != PACKAGE else package
            docstring = obj.docstring
        except (KeyError, griffe.AliasResolutionError) as error:
            log.warning(f"the API pages render {ident}, which griffe cannot find: {error!r}")
            continue
        if docstring is None or not docstring.value.strip():
            log.warning(f"{ident} has no docstring of its own: the API reference would show a bare signature")
