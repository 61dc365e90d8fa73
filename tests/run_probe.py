"""What a target of ``python -m syncbn_dist.run`` sees, written as JSON to the file named by its first argument.

Run by tests/test_run.py as ``python -m syncbn_dist.run tests/run_probe.py OUT CODE [children]`` or with
``-m run_probe``. It never imports syncbn_dist: whether ``torch.nn.SyncBatchNorm`` is patched is read from the module
of its forward, here and, with ``children``, in a ``torch.multiprocessing`` spawn child and a plain Python
subprocess. It exits with status CODE.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
import torch.multiprocessing as mp


def _seen() -> dict[str, object]:
    return {
        "forward_module": torch.nn.SyncBatchNorm.forward.__module__,
        "shadowed_sitecustomize": os.environ.get("SHADOWED_SITECUSTOMIZE_RAN"),
    }


def _child(queue: mp.SimpleQueue) -> None:
    queue.put(_seen())


if __name__ == "__main__":
    report: dict[str, object] = {"argv": sys.argv, "path0": sys.path[0], "main_file": __file__, **_seen()}
    if sys.argv[3:] == ["children"]:
        ctx = mp.get_context("spawn")
        queue = ctx.SimpleQueue()
        process = ctx.Process(target=_child, args=(queue,))
        process.start()
        process.join()
        report["spawn_child"] = queue.get()
        probe = "import json, os, torch; print(json.dumps(torch.nn.SyncBatchNorm.forward.__module__))"
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
        report["subprocess_child"] = json.loads(out)
    with open(sys.argv[1], "w") as file:
        json.dump(report, file)
    sys.exit(int(sys.argv[2]))
