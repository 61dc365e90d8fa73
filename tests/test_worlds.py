"""Tests of launch/common/worlds.py: the long-lived gloo ranks that run the suite's multi-process jobs.

A pooled job must see what a fresh process would: the state a job leaves in its ranks (syncbn_dist's switches and
patch, a compiled model, torch's modes and configs, hooks, warnings filters, environment, working directory) is gone
for the next job, which is compared with the same job run in new processes, and a graph compiled by one job is an
inductor cache hit for the next. A job that fails, hangs or leaves what cannot be put back retires its ranks, and no
rank outlives its pool. Each test runs its own pool (``pooled_worlds`` nests: the suite's pool is back after the
block).
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import syncbn_dist
from launch.common import spawn
from launch.common.spawn import pooled_worlds, run_distributed
from syncbn_dist.comm import agreement
from syncbn_dist.settings import KERNELS_ENV

# Left out of make test-quick (docs/testing.md, "The quick tier"): the suite's own pooled gloo ranks.
pytestmark = pytest.mark.plumbing

PROBE_ENV = "SYNCBN_DIST_WORLDS_PROBE"
HAS_CXX = any(shutil.which(cc) for cc in ("g++", "c++"))


def _compile_layer(rank: int, world_size: int) -> dict[str, int]:
    """A user's ``torch.compile`` (inductor) of one synchronized layer, forward and backward: inductor's cache
    counters."""
    layer = torch.compile(syncbn_dist.SynchronizedBatchNorm2d(3))
    layer(torch.randn(2 + rank, 3, 4, 4, requires_grad=True)).sum().backward()
    counters = torch._dynamo.utils.counters
    return {**counters["inductor"], **counters["aot_autograd"]}


def _leave_state(rank: int, world_size: int) -> int:
    """Change everything a job could leave behind, a compiled model's caches included."""
    if HAS_CXX:
        _compile_layer(rank, world_size)
    syncbn_dist.set_debug(True)
    layer = syncbn_dist.SynchronizedBatchNorm2d(3)
    layer(torch.randn(2, 3, 4, 4))  # a debug-mode call number on the world group
    syncbn_dist.set_sbn_eps_mode("clip")
    syncbn_dist.patch_torch_sync_batchnorm()
    solo = dist.new_group([rank])  # on every rank: one group each
    dist.all_reduce(torch.ones(1), group=solo)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.use_deterministic_algorithms(True)
    torch._dynamo.config.cache_size_limit = 1
    torch._dynamo.utils.counters["probe"]["left"] += 1
    nn.modules.module.register_module_forward_hook(lambda *args: None)
    warnings.simplefilter("error")
    os.environ[PROBE_ENV] = "left"
    os.chdir("/")
    sys.path.append("/nonexistent-worlds-probe")
    return os.getpid()


def _state(rank: int, world_size: int) -> dict[str, Any]:
    """What a job sees of the state :func:`_leave_state` changes (and the pid, which tells worlds apart)."""
    total = torch.ones(1)
    dist.all_reduce(total)
    return {
        "pid": os.getpid(),
        "world": total.item(),
        "kernels": syncbn_dist.get_kernels(),
        "debug": syncbn_dist.is_debug_enabled(),
        "debug_calls": len(agreement._DEBUG_CALLS),
        "eps_mode": syncbn_dist.settings._EPS_MODE,
        "patched": syncbn_dist.is_torch_sync_batchnorm_patched(),
        "dtype": str(torch.get_default_dtype()),
        "grad": torch.is_grad_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "cache_size_limit": torch._dynamo.config.cache_size_limit,
        "counters": {name: dict(counter) for name, counter in torch._dynamo.utils.counters.items() if counter},
        "forward_hooks": len(nn.modules.module._global_forward_hooks),
        "error_filter": any(f[0] == "error" and f[2] is Warning for f in warnings.filters),
        "probe_env": os.environ.get(PROBE_ENV),
        "kernels_env": os.environ.get(KERNELS_ENV),
        "cwd": os.getcwd(),
        "probe_path": "/nonexistent-worlds-probe" in sys.path,
    }


def _fail_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 fails this job")
    return os.getpid()


def _pid(rank: int, world_size: int) -> int:
    return os.getpid()


def _hang(rank: int, world_size: int) -> None:
    time.sleep(600)


def _leave_a_thread(rank: int, world_size: int) -> int:
    stop = threading.Event()
    threading.Thread(target=stop.wait, args=(60,), name="left-behind").start()
    return os.getpid()


_KEPT: list[type] = []  # in a rank's copy of this module


def _keep_a_subclass(rank: int, world_size: int) -> int:
    class Kept(nn.SyncBatchNorm):  # what patch_torch_sync_batchnorm(strict=True) would check in every later job
        pass

    _KEPT.append(Kept)
    return os.getpid()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.distributed
def test_a_pooled_job_sees_what_a_fresh_process_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PROBE_ENV, raising=False)
    monkeypatch.setenv(KERNELS_ENV, "native")
    session_pool = spawn._POOL
    with pooled_worlds() as pool:
        assert spawn._POOL is pool
        pids = run_distributed(_leave_state, 2)
        pooled = run_distributed(_state, 2)
        assert [state["pid"] for state in pooled] == pids  # the same processes served both jobs
        # Variables read at every use come with each job, to the same world.
        monkeypatch.setenv(KERNELS_ENV, "auto")
        states = run_distributed(_state, 2)
        assert [(s["pid"], s["kernels_env"], s["kernels"]) for s in states] == [(pid, "auto", "native") for pid in pids]
        monkeypatch.setenv(KERNELS_ENV, "native")
        # Any other difference gets a world spawned with it, whose first job is a fresh process's: the reference.
        monkeypatch.setenv(PROBE_ENV, "new")
        fresh = run_distributed(_state, 2)
        assert not {state["pid"] for state in fresh} & set(pids)
        assert [state.pop("probe_env") for state in fresh] == ["new", "new"]
        assert [state.pop("probe_env") for state in pooled] == [None, None]
        assert [{**state, "pid": 0} for state in pooled] == [{**state, "pid": 0} for state in fresh]
        assert pooled[0]["kernels"] == "native" and not pooled[0]["patched"] and pooled[0]["world"] == 2.0
        monkeypatch.delenv(PROBE_ENV)
        assert run_distributed(_pid, 1) == pids[:1]  # a smaller job takes the first processes
        if HAS_CXX:
            # Dynamo is reset between jobs, as in a new process, but inductor's caches (the machine's, on disk, and
            # the process's) serve the next job: the graphs _leave_state compiled, from an empty cache or not, are
            # no second compilation.
            for counters in run_distributed(_compile_layer, 2):
                assert counters.get("fxgraph_cache_miss", 0) == 0 and counters["fxgraph_cache_hit"] == 2, counters
                # (AOTAutograd's own cache passes the layer's graph by: counted as autograd_cache_bypass, not a miss.)
                assert counters.get("autograd_cache_miss", 0) == 0, counters
        assert (pool.spawned, pool.retired) == (4, [])
        everyone = pids + [state["pid"] for state in fresh]
    assert spawn._POOL is session_pool
    assert not [pid for pid in everyone if _alive(pid)]  # no rank outlives its pool


@pytest.mark.distributed
def test_a_failed_hung_or_unclean_job_retires_its_ranks() -> None:
    with pooled_worlds() as pool:
        pids = run_distributed(_pid, 2)
        with pytest.raises(AssertionError, match=r"(?s)rank 1:.*ValueError: rank 1 fails this job"):
            run_distributed(_fail_on_rank_1, 2)  # rank 0 returned: only rank 1's failure tells
        assert not [pid for pid in pids if _alive(pid)] and pool.retired == ["the job failed"] * 2

        alone = run_distributed(_pid, 1)
        with pytest.raises(TimeoutError, match="did not finish within 2 s"):
            run_distributed(_hang, 1, timeout=2)
        assert not _alive(alone[0]) and pool.retired[-1] == "no report"
        (left,) = run_distributed(_leave_a_thread, 1)  # succeeds, then retires: its thread is still running
        assert not _alive(left) and "left-behind" in pool.retired[-1], pool.retired
        (kept,) = run_distributed(_keep_a_subclass, 1)  # in a new process; it retires too
        assert kept not in (left, alone[0]) and not _alive(kept)
        assert "Kept" in pool.retired[-1] and (pool.jobs, pool.spawned, len(pool.retired)) == (6, 5, 5), pool.retired
