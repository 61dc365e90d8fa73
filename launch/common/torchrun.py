"""Start jobs under torchrun from Python, with an environment that is not mistaken for an outer launch's, and the
launcher setting that makes torchrun's restarts reliable."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

# What torchrun's elastic agent sets in every worker's environment (torch/distributed/elastic/agent/server/
# local_elastic_agent.py, _start_workers), besides the TORCHELASTIC_* prefix (run id, restarts, error file, signals).
# OMP_NUM_THREADS, which torchrun sets only when it is unset, is left to the caller.
TORCHRUN_VARIABLES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    }
)


# For torchrun itself (the elastic agent), not its workers: a new c10d store for every rendezvous round, hosted by
# the new attempt's rank 0 on a fresh port, instead of the agent's TCPStore shared by every attempt. With the
# shared store (torch's default; the same in 2.10 to 2.14), the workers of a restarted attempt find the keys of
# the attempt that died, e.g. the gloo address of a dead rank, and fail in init_process_group ("Gloo
# connectFullMesh failed ... Connection refused"). Workers cannot fix this: the agent shares its store before
# they start. The Makefile exports the same variable for `make train*`; docs/training.md, "Restarts and preemption".
RESTART_SAFE_AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def restart_hazard(env: Mapping[str, str] | None = None) -> str | None:
    """Why a torchrun restart of this worker's job may fail, or None: restarts are allowed and the agent shares its
    store across attempts (``RESTART_SAFE_AGENT_ENV`` was not set for torchrun). For a warning at start-up."""
    env = os.environ if env is None else env
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) < 1:
        return None
    setting = " ".join(f"{key}={value}" for key, value in RESTART_SAFE_AGENT_ENV.items())
    return (
        f"torchrun may restart this job (--max-restarts={env['TORCHELASTIC_MAX_RESTARTS']}) but shares its store "
        "across attempts, so a restarted worker can read a dead attempt's addresses and fail in "
        f"init_process_group; launch torchrun with {setting} (docs/training.md, 'Restarts and preemption')"
    )


def env_outside_torchrun(base: Mapping[str, str] | None = None, **updates: str) -> dict[str, str]:
    """A copy of ``base`` (default ``os.environ``) without any variable torchrun sets for its workers, then
    ``updates``: the environment of a job started as a subprocess.

    A job started from inside a torchrun worker (or from a shell that exported ``RANK``, ``MASTER_PORT``, ...)
    would otherwise take itself for a rank of that outer launch, or a nested torchrun would reuse its port.
    It also holds :data:`RESTART_SAFE_AGENT_ENV`, for the torchrun started with it.
    """
    env = {
        key: value
        for key, value in (os.environ if base is None else base).items()
        if key not in TORCHRUN_VARIABLES and not key.startswith("TORCHELASTIC_")
    }
    env.update(RESTART_SAFE_AGENT_ENV)
    env.update(updates)
    return env


def torchrun_command(nproc: int, module: str, args: Sequence[str] = (), max_restarts: int = 0) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc_per_node=nproc --max-restarts=N -m module args...``."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*launcher, f"--max-restarts={max_restarts}", "-m", module, *args]


def run_torchrun(nproc: int, module: str, args: Sequence[str], log_path: Path, timeout_s: float) -> float:
    """Run ``python -m module args`` in ``nproc`` local processes under torchrun; its wall time in seconds.

    One intra-op thread per process (the processes share the cores). The workers' stderr (rank 0's progress
    bar) comes through; torchrun's and the workers' stdout go to ``log_path``.

    Raises:
        RuntimeError: if it exits with a non-zero status (pointing at the log).
        subprocess.TimeoutExpired: if it runs longer than ``timeout_s``.
    """
    command = torchrun_command(nproc, module, args)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log_path, "w") as log_file:
        log_file.write("$ " + " ".join(command) + "\n")
        log_file.flush()
        env = env_outside_torchrun(OMP_NUM_THREADS="1")
        code = subprocess.run(command, stdout=log_file, env=env, timeout=timeout_s).returncode
    elapsed = time.perf_counter() - start
    if code != 0:
        raise RuntimeError(f"{' '.join(command[3:])} exited with status {code} (see above and {log_path})")
    return elapsed
