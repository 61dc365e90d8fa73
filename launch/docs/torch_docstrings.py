"""A griffe extension (mkdocs.yml, mkdocstrings' python handler) that reads the docstrings' torch-style reST as
Markdown, so that the API reference renders what ``help()`` and an IDE show as text.

The public docstrings follow torch's (STYLE.md): Google sections (``Args:``, ``Returns:``, ``Raises:``) with reST
inside them, which mkdocstrings would print verbatim. Each is rewritten once the package is loaded, before griffe
parses it:

- cross-references (``:class:`~syncbn_dist.SyncBatchNorm```, ``:func:`convert_model```, ``:attr:`last_transport```,
  ...) become links to the object's entry where it is documented (a name of ``syncbn_dist.__all__`` or one of its
  members), and code spans elsewhere (torch's names, private modules);
- ``:math:`...``` and ``.. math::`` become MathML (latex2mathml), which browsers render with no script;
- ``.. note::`` and the other directives become admonitions;
- a literal block (a paragraph ending in ``::``) becomes a fenced code block, and ``Example::`` / ``Examples::``
  before ``>>>`` lines the Google ``Examples:`` section.

The docstrings in the source stay as they are.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import griffe
from latex2mathml.converter import convert as latex_to_mathml

_ROLE = re.compile(r":(?:py:)?(class|func|meth|attr|mod|data|exc|obj|const):`(~?)([^`]+)`")
_MATH_ROLE = re.compile(r":math:`([^`]+)`")
_DIRECTIVE = re.compile(
    r"^(\s*)\.\. (note|warning|seealso|tip|important|caution|attention|hint|danger|error)::\s*(.*)$"
)
_MATH_DIRECTIVE = re.compile(r"^(\s*)\.\. math::\s*(.*)$")
_EXAMPLES_TITLE = re.compile(r"^(\s*)(Examples?)::\s*$")
_ADMONITION_KIND = {"seealso": "info", "attention": "warning", "caution": "warning", "hint": "tip", "error": "danger"}


def _indent_of(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _block_after(lines: list[str], start: int, indent: int) -> int:
    """The end (exclusive) of the block of lines after ``start`` indented deeper than ``indent`` (blank lines
    inside it included, trailing ones not)."""
    end = start
    index = start
    while index < len(lines):
        line = lines[index]
        if line.strip():
            if _indent_of(line) <= indent:
                break
            end = index + 1
        index += 1
    return end


def _dedent(block: list[str]) -> list[str]:
    width = min((_indent_of(line) for line in block if line.strip()), default=0)
    return [line[width:] if line.strip() else "" for line in block]


def _math(latex: str, display: str) -> str:
    return latex_to_mathml(latex.strip(), display=display).replace("\n", "")


def _blocks(text: str) -> str:
    """Directives, math blocks and literal blocks, line by line."""
    lines = text.split("\n")
    out: list[str] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        indent = _indent_of(line)
        pad = " " * indent
        math = _MATH_DIRECTIVE.match(line)
        directive = _DIRECTIVE.match(line)
        examples = _EXAMPLES_TITLE.match(line)
        if math:
            end = _block_after(lines, index + 1, indent)
            latex = " ".join(part.strip() for part in [math.group(2), *lines[index + 1 : end]] if part.strip())
            out.append(pad + _math(latex, "block"))
            index = end
        elif directive:
            kind = _ADMONITION_KIND.get(directive.group(2), directive.group(2))
            end = _block_after(lines, index + 1, indent)
            out.append(f"{pad}!!! {kind}")
            body = ([directive.group(3)] if directive.group(3) else []) + _dedent(lines[index + 1 : end])
            out.extend(f"{pad}    {part}" if part else "" for part in _blocks("\n".join(body)).split("\n"))
            index = end
        elif (examples or line.rstrip().endswith("::")) and _block_after(lines, index + 1, indent) > index + 1:
            end = _block_after(lines, index + 1, indent)
            body = _dedent(lines[index + 1 : end])
            while body and not body[0].strip():
                body.pop(0)
            if examples and body and body[0].startswith(">>>"):  # griffe's Examples section reads the >>> lines
                out.append(f"{pad}Examples:")
                out.extend(f"{pad}    {part}" if part else "" for part in body)
            else:  # a sentence ending in "::" (or an example that is not a session) ends in ":" before its code
                if line.strip() != "::":
                    out.append(line.rstrip()[:-1])
                    out.append("")
                out.append(f"{pad}```{'pycon' if body and body[0].startswith('>>>') else 'python'}")
                out.extend(f"{pad}{part}" if part else "" for part in body)
                out.append(f"{pad}```")
            index = end
        else:
            out.append(line)
            index += 1
    return "\n".join(out)


class TorchDocstrings(griffe.Extension):
    """Rewrites every docstring of the loaded package once, with the whole package known (to resolve names)."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        # Where each public name is documented: the canonical path of its object -> the path it is rendered under.
        self._public: dict[str, str] = {}
        for name in pkg.exports or ():
            member = pkg.members.get(name)
            if member is not None:
                self._public[member.canonical_path if member.is_alias else member.path] = f"{pkg.path}.{name}"
        self._pkg = pkg
        for obj in _walk(pkg):
            if obj.docstring is not None:
                obj.docstring.value = self.rewrite(obj.docstring.value, obj)

    def rewrite(self, text: str, obj: griffe.Object) -> str:
        text = _blocks(text)
        # In a span: Markdown takes a line that starts with <math> for a block of HTML.
        text = _MATH_ROLE.sub(lambda match: f'<span class="math">{_math(match.group(1), "inline")}</span>', text)
        return _ROLE.sub(lambda match: self._reference(match, obj), text)

    def _reference(self, match: re.Match[str], obj: griffe.Object) -> str:
        role, short, target = match.groups()
        label = target.rsplit(".", 1)[-1] if short else target
        label = f"{label}()" if role in ("func", "meth") and not label.endswith(")") else label
        public = self._public_path(target, obj)
        return f"[`{label}`][{public}]" if public is not None else f"`{label}`"

    def _public_path(self, target: str, obj: griffe.Object) -> Optional[str]:
        """The rendered path of ``target`` as seen from ``obj``'s scope, or None where it is not rendered."""
        first, _, rest = target.partition(".")
        canonical: Optional[str]
        if first == self._pkg.name:
            canonical = _canonical(self._pkg, rest)
        else:
            scope: Optional[griffe.Object] = obj if obj.is_class or obj.is_module else obj.parent
            canonical = None
            while scope is not None and canonical is None:
                try:
                    canonical = scope.resolve(first)
                except (griffe.NameResolutionError, griffe.AliasResolutionError):
                    canonical = None
                scope = scope.parent
            if canonical is not None:
                inside = canonical.startswith(self._pkg.name + ".")
                found = _canonical(self._pkg, canonical.partition(".")[2]) if inside else None
                canonical = None if found is None else f"{found}.{rest}" if rest else found
        if canonical is None:
            return None
        for prefix, public in self._public.items():
            if canonical == prefix or canonical.startswith(prefix + "."):
                return public + canonical[len(prefix) :]
        return None


def _canonical(pkg: griffe.Module, dotted: str) -> Optional[str]:
    try:
        member = pkg[dotted] if dotted else pkg
    except (KeyError, griffe.AliasResolutionError):
        return None
    try:
        return member.canonical_path if member.is_alias else member.path
    except griffe.AliasResolutionError:
        return None


def _walk(obj: griffe.Object):
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)
