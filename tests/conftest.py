"""Shared pytest fixtures."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest
import torch

from syncbn_dist.kernels import KERNELS_ENV

# The suite runs the native kernels unless a test asks for the compiled ones (the ``kernel_mode`` fixture): every
# process that compiles pays inductor's start-up, seconds on two cores, and every gloo rank is a process. Set in the
# environment, so that the ranks tests spawn inherit it; ``SYNCBN_DIST_KERNELS=compiled make test`` runs it all
# compiled.
os.environ.setdefault(KERNELS_ENV, "native")


def pytest_configure(config: pytest.Config) -> None:
    """Write yapf's grammar cache once, in the process that starts the xdist workers, before it starts them.

    yapf (imported by mmengine and mmcv) writes its grammar pickle to the user cache on its first import after an
    install, in place; two processes importing it together (two ranks of tests/test_torch_patch.py in a fresh venv)
    can load the half-written file: ``EOFError: Ran out of input`` (seen once in a fresh clone). Written here, it is
    only read after.
    """
    if not hasattr(config, "workerinput") and importlib.util.find_spec("yapf") is not None:
        import yapf.yapflib.yapf_api  # noqa: F401  (mmengine's import: it loads the grammars, writing the cache)


# World sizes 2 and 3 on the native kernels and 2 on the compiled ones, for the costliest gloo suites: world size 2
# already has uneven and empty shards, and the kernels do not change with the number of ranks.
WORLD_SIZES_AND_KERNELS = [(2, "native"), (3, "native"), (2, "compiled")]


@pytest.fixture(params=["native", "compiled"])
def kernel_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs the test once per kernel set (syncbn_dist.set_kernels), in this process and the ranks it spawns."""
    monkeypatch.setenv(KERNELS_ENV, request.param)
    return request.param


@pytest.fixture
def one_intra_op_thread() -> Iterator[None]:
    """DataParallel replicas are threads already: one intra-op thread each keeps them off each other's cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
