"""Run a command in its own session and kill the whole session on timeout: the helper of the tests that start jobs
whose processes start more processes (torchrun's workers, Lightning's rank 1), so a hang never leaves orphans."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import pytest


def run_in_session(
    command: Sequence[str], *, env: dict[str, str], timeout: float, cwd: Optional[Path] = None
) -> subprocess.CompletedProcess:
    """Run ``command`` with stdout and stderr together; fail the test, with the output's tail, after ``timeout`` s.

    Returns:
        The completed process (``stdout`` holds both streams).
    """
    proc = subprocess.Popen(
        list(command),
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(command)} did not finish in {timeout} s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(list(command), proc.returncode, out)
