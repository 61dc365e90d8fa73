"""What the compiled kernels cost to build: the first forward+backward of one synchronized layer in a new process,
with an empty inductor cache and again with the cache the first process left (``TORCHINDUCTOR_CACHE_DIR``), and the
number of graphs compiled.

    .venv/bin/python -m launch.bench.compile_cost      # prints the JSON that make bench puts in performance.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

SHAPE = (32, 64, 28, 28)


def _child() -> dict[str, Any]:
    started = time.perf_counter()
    import torch
    import torch.distributed as dist

    from syncbn_dist import kernels
    from syncbn_dist.comm import DistributedTransport
    from syncbn_dist.functions import sync_batch_norm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    imported = time.perf_counter() - started
    kernels.set_kernels("compiled")
    x = torch.randn(SHAPE, requires_grad=True)
    weight, bias = torch.ones(SHAPE[1], requires_grad=True), torch.zeros(SHAPE[1], requires_grad=True)
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        sync_batch_norm(x, weight, bias, None, None, 0.1, 1e-5, DistributedTransport(None)).sum().backward()
        seconds.append(time.perf_counter() - start)
    dist.destroy_process_group()
    return {
        "import_s": round(imported, 2),
        "first_call_s": round(seconds[0], 2),
        "second_call_ms": round(1e3 * seconds[1], 2),
        "graphs": sum(kernel.graphs() for kernel in kernels.COMPILED_KERNELS),
        "dynamo_frames": torch._dynamo.utils.counters["stats"]["unique_graphs"],
    }


def measure() -> dict[str, Any]:
    """Run :func:`_child` twice in new processes sharing a new inductor cache directory: ``cold`` then ``warm``."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
        runs = {}
        for name in ("cold", "warm"):
            done = subprocess.run(
                [sys.executable, "-m", "launch.bench.compile_cost", "--child"],
                env=env, capture_output=True, text=True, check=True, timeout=600,
            )
            runs[name] = json.loads(done.stdout.strip().splitlines()[-1])
    return {"shape": list(SHAPE), "dtype": "float32", **runs}


if __name__ == "__main__":
    print(json.dumps(_child() if "--child" in sys.argv else measure()))
