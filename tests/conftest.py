"""Shared pytest fixtures and hooks: the pooled gloo worlds, the kernel set, the test budget."""

from __future__ import annotations

import importlib.util
import os
import resource
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from launch.common.spawn import pooled_job_cpu_s, pooled_worlds
from launch.common.worlds import cpu_seconds


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("test_budget_s", "seconds of wall time (2 cores) a test may take without the over_budget marker")


def pytest_configure(config: pytest.Config) -> None:
    """Write yapf's grammar cache once, in the process that starts the xdist workers, before it starts them; and
    account there for the run's cost (:class:`_SuiteCost`).

    yapf (imported by mmengine and mmcv) writes its grammar pickle to the user cache on its first import after an
    install, in place; two processes importing it together (two ranks of tests/test_torch_patch.py in a fresh venv)
    can load the half-written file: ``EOFError: Ran out of input`` (seen once in a fresh clone). Written here, it is
    only read after.
    """
    if not hasattr(config, "workerinput") and importlib.util.find_spec("yapf") is not None:
        import yapf.yapflib.yapf_api  # noqa: F401  (mmengine's import: it loads the grammars, writing the cache)
    if not hasattr(config, "workerinput"):  # the process that writes the summary (xdist's controller)
        config.pluginmanager.register(_SuiteCost(float(config.getini("test_budget_s"))), _SUITE_COST)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test marked over_budget gives a reason and a docstring that says why it needs the time; and the longest tests
    run first.

    The order is the longest-first rule of scheduling: the over_budget tests, then the slow ones, then the rest, each
    group in collection order. xdist's worksteal hands each worker a share of the list and moves tests from a busy
    worker's queue to an idle one, so the run ends on short tests that the two workers share, instead of one worker
    running a minute-long test found last while the other has nothing left.
    """
    for item in items:
        marker = item.get_closest_marker("over_budget")
        if marker is not None and not (marker.args and getattr(getattr(item, "function", None), "__doc__", None)):
            raise pytest.UsageError(f"{item.nodeid}: over_budget needs a reason, and the test a docstring saying why")
    items.sort(key=lambda item: 0 if "over_budget" in item.keywords else 1 if "slow" in item.keywords else 2)


_SUITE_COST = "syncbn-dist-suite-cost"


class _SuiteCost:
    """What the run cost, reported at its end (registered in the process that writes the summary: xdist's controller).

    The test budget (pyproject.toml's ``test_budget_s``, wall seconds on 2 cores): a test that takes longer is marked
    ``@pytest.mark.over_budget("reason")`` and says why in its docstring. An unmarked test over budget is listed, not
    failed: a test's time depends on the machine's load; speed is what the benchmarks measure, the tests check
    correctness. Also listed: the jobs the pooled gloo ranks ran, the rank processes spawned for them, and the run's
    CPU seconds (on 2 cores the suite is CPU-bound: its wall time follows them), with the tests that took the most.
    """

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.over: list[tuple[float, str]] = []
        self.worlds: list[dict[str, Any]] = []
        # (CPU seconds of a test's setup and call, its children's and pooled jobs' included; nodeid)
        self.cpu: list[tuple[float, str]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call":
            return
        if report.duration > self.budget_s and "over_budget" not in report.keywords:
            self.over.append((report.duration, report.nodeid))
        self.cpu.extend((value, report.nodeid) for name, value in report.user_properties if name == _CPU_S)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:  # an xdist worker's pool statistics
        if "worlds" in getattr(node, "workeroutput", {}):
            self.worlds.append(node.workeroutput["worlds"])

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        jobs = sum(w["jobs"] for w in self.worlds)
        # The pooled ranks' CPU outside jobs (start-up, idle); their jobs' is in the tests'.
        ranks_cpu_s = sum(w["cpu_s"] - w["job_cpu_s"] for w in self.worlds)
        if jobs:
            spawned, evicted = (sum(w[key] for w in self.worlds) for key in ("spawned", "evicted"))
            retired = sorted({reason for w in self.worlds for reason in w["retired"]})
            terminalreporter.write_line(
                f"pooled gloo ranks: {jobs} jobs on {spawned} rank processes ({evicted} ended to make room, "
                f"{sum(len(w['retired']) for w in self.worlds)} retired{': ' if retired else ''}{'; '.join(retired)})"
            )
        if self.cpu:
            tests_cpu_s = sum(value for value, _ in self.cpu)
            terminalreporter.write_line(
                f"CPU seconds: {tests_cpu_s + ranks_cpu_s:.0f} (the tests {tests_cpu_s:.0f}, with the processes "
                f"they started and their pooled jobs; the pooled ranks outside jobs {ranks_cpu_s:.0f}); the tests that "
                "took the most:"
            )
            for value, nodeid in sorted(self.cpu, reverse=True)[:10]:
                terminalreporter.write_line(f"  {value:6.1f} s  {nodeid}")
        if self.over:
            terminalreporter.section(f"unmarked tests over the {self.budget_s:g} s test budget", yellow=True)
            for duration, nodeid in sorted(self.over, reverse=True):
                terminalreporter.line(f"{duration:.1f}s {nodeid}: mark it over_budget, saying why, or make it leaner")


_CPU_S = "cpu_s"


_SETUP_CPU_S = pytest.StashKey[float]()


def _cpu_now_s() -> float:
    return cpu_seconds(resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) + pooled_job_cpu_s()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    start = _cpu_now_s()
    yield
    item.stash[_SETUP_CPU_S] = _cpu_now_s() - start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """The CPU seconds of a test's setup and call: its own process's, those of the processes it started and waited for
    (ranks spawned afresh, torchrun jobs, subprocesses, a shared run a fixture makes) and its pooled ranks' in its
    jobs. Teardown is left out: the pool ends in the last test's."""
    start = _cpu_now_s()
    yield
    spent = _cpu_now_s() - start + item.stash.get(_SETUP_CPU_S, 0.0)
    item.user_properties.append((_CPU_S, spent))


# SYNCBN_DIST_TEST_POOL=0: every multi-process test spawns its ranks afresh, as outside the suite (to tell a pooled
# world's leftover state from a real failure).
POOL_ENV = "SYNCBN_DIST_TEST_POOL"


@pytest.fixture(scope="session", autouse=True)
def _pooled_worlds(pytestconfig: pytest.Config) -> Iterator[None]:
    """Multi-process tests share long-lived gloo ranks (launch.common.worlds): each rank process imports torch and
    syncbn_dist once per session, not once per test; each job still gets a process group of its own, and what it
    changes in a rank is put back. The ranks exit at the end of the session (of each xdist worker)."""
    if os.environ.get(POOL_ENV, "1") == "0":
        yield
        return
    with pooled_worlds() as pool:
        yield
        before = cpu_seconds(resource.RUSAGE_CHILDREN)
    stats = {"jobs": pool.jobs, "spawned": pool.spawned, "evicted": pool.evicted, "retired": pool.retired}
    # The ranks' CPU over their lifetimes, counted when they end here (ranks retired earlier, in their test's).
    stats["cpu_s"] = cpu_seconds(resource.RUSAGE_CHILDREN) - before
    stats["job_cpu_s"] = pool.job_cpu_s
    if hasattr(pytestconfig, "workerinput"):
        pytestconfig.workeroutput["worlds"] = stats  # type: ignore[attr-defined]  (xdist sends it to the controller)
    else:
        pytestconfig.pluginmanager.get_plugin(_SUITE_COST).worlds.append(stats)


# World sizes 2 and 3 for the costliest gloo suites: world size 2 already has uneven and empty shards, 3 a rank that
# is neither first nor last.
WORLD_SIZES = [2, 3]


@pytest.fixture
def one_intra_op_thread() -> Iterator[None]:
    """DataParallel replicas are threads already: one intra-op thread each keeps them off each other's cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
