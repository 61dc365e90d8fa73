"""The launch commands in a config file's header comment, as argv lists: what the tests check each config says."""

from __future__ import annotations

import shlex
from pathlib import Path


def header_commands(path: Path, module: str) -> list[list[str]]:
    """The command lines of ``path``'s leading comment that run ``-m module``, continuations joined, as argv.

    Prose that names the module without ``-m`` is not a command and is left out.
    """
    header = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line[1:].strip())
    lines = "\n".join(header).replace("\\\n", " ").splitlines()
    return [shlex.split(line) for line in lines if f"-m {module} " in line]
