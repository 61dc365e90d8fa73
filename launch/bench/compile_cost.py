"""What the compiled kernels cost to build: the first forward+backward of one synchronized layer in a new process,
with an empty inductor cache and again with the cache the first process left (``TORCHINDUCTOR_CACHE_DIR``), and the
number of graphs compiled. On CUDA the process group is NCCL and the first call includes Triton's compilation.

    .venv/bin/python -m launch.bench.compile_cost          # prints the JSON that make bench puts in performance.json
    .venv/bin/python -m launch.bench.compile_cost cuda     # the same on GPU 0
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


def _child(device: str) -> dict[str, Any]:
    started = time.perf_counter()
    import torch
    import torch.distributed as dist

    import syncbn_dist
    from syncbn_dist.comm import DistributedTransport
    from syncbn_dist.kernels import compiled as kernels
    from syncbn_dist.layer.functions import sync_batch_norm

    torch.set_num_threads(1)
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    imported = time.perf_counter() - started
    syncbn_dist.set_kernels("compiled")
    x = torch.randn(SHAPE, device=device, requires_grad=True)
    weight = torch.ones(SHAPE[1], device=device, requires_grad=True)
    bias = torch.zeros(SHAPE[1], device=device, requires_grad=True)
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        sync_batch_norm(x, weight, bias, None, None, 0.1, 1e-5, DistributedTransport(None)).sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    dist.destroy_process_group()
    return {
        "import_s": round(imported, 2),
        "first_call_s": round(seconds[0], 2),
        "second_call_ms": round(1e3 * seconds[1], 2),
        "graphs": sum(kernel.graphs() for kernel in kernels.COMPILED_KERNELS),
        "dynamo_frames": torch._dynamo.utils.counters["stats"]["unique_graphs"],
    }


def measure(device: str = "cpu") -> dict[str, Any]:
    """Run :func:`_child` on ``device`` ("cpu" or "cuda") twice, in new processes sharing a new inductor cache
    directory: ``cold`` then ``warm``."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
        runs = {}
        for name in ("cold", "warm"):
            done = subprocess.run(
                [sys.executable, "-m", "launch.bench.compile_cost", device, "--child"],
                env=env, capture_output=True, text=True, check=True, timeout=600,
            )
            runs[name] = json.loads(done.stdout.strip().splitlines()[-1])
    return {"shape": list(SHAPE), "dtype": "float32", "device": device, **runs}


if __name__ == "__main__":
    device = "cuda" if "cuda" in sys.argv[1:] else "cpu"
    print(json.dumps(_child(device) if "--child" in sys.argv else measure(device)))
