"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def one_intra_op_thread() -> Iterator[None]:
    """DataParallel replicas are threads already: one intra-op thread each keeps them off each other's cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
