"""Tests of ``python -m syncbn_dist.run``: the target runs as Python would run it, patched, and so do its children.

``tests/run_probe.py`` reports what a target sees (argv, ``sys.path[0]``, its exit status, whether
``torch.nn.SyncBatchNorm`` is patched in it, in a ``torch.multiprocessing`` spawn child and in a plain subprocess, and
whether a ``sitecustomize`` that the start-up hook shadows still ran). ``tests/plain_syncbn_ddp.py``, a script that
uses only ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` and DDP, runs under ``torchrun -m syncbn_dist.run`` on 2
gloo processes and is compared with ``nn.BatchNorm`` on the global batch. Lightning's ``sync_batchnorm=True`` under
``syncbn_dist.run`` is in tests/test_lightning.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch.common.torchrun import env_outside_torchrun, torchrun_command
from syncbn_dist import run
from tests.sessions import run_in_session

# Left out of make test-quick (docs/testing.md, "The quick tier"): the python -m syncbn_dist.run launcher under
# torchrun.
pytestmark = pytest.mark.plumbing

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PATCHED = "syncbn_dist.integrations.torch_patch"


def _python(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_usage_error_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert run.main([]) == 2
    assert run.main(["-m"]) == 2
    assert "usage: python -m syncbn_dist.run" in capsys.readouterr().err


@pytest.mark.slow
def test_script_and_module_targets_run_as_python_runs_them_and_children_inherit(tmp_path: Path) -> None:
    shadowed = tmp_path / "site"  # an interpreter's own sitecustomize, which the start-up hook must still run
    shadowed.mkdir()
    (shadowed / "sitecustomize.py").write_text("import os\nos.environ['SHADOWED_SITECUSTOMIZE_RAN'] = 'yes'\n")
    env = env_outside_torchrun(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(shadowed), str(ROOT)]))
    env.pop("SYNCBN_PATCH_TORCH", None)

    script_out = tmp_path / "script.json"
    done = _python(["-m", "syncbn_dist.run", "tests/run_probe.py", str(script_out), "3", "children"], ROOT, env)
    assert done.returncode == 3, done.stderr[-3000:]  # the target's exit status, passed through
    seen = json.loads(script_out.read_text())
    assert seen["argv"] == ["tests/run_probe.py", str(script_out), "3", "children"]
    assert seen["path0"] == str(HERE)  # the script's directory, as `python tests/run_probe.py` gives
    assert seen["forward_module"] == PATCHED and seen["shadowed_sitecustomize"] == "yes"
    assert seen["spawn_child"] == {"forward_module": PATCHED, "shadowed_sitecustomize": "yes"}
    assert seen["subprocess_child"] == PATCHED

    module_out = tmp_path / "module.json"
    done = _python(["-m", "syncbn_dist.run", "-m", "run_probe", str(module_out), "0"], HERE, env)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(module_out.read_text())
    assert seen["argv"] == [str(HERE / "run_probe.py"), str(module_out), "0"]  # `python -m`: argv[0] is the file
    assert seen["path0"] == str(HERE) and seen["main_file"] == str(HERE / "run_probe.py")
    assert seen["forward_module"] == PATCHED


@pytest.mark.distributed
@pytest.mark.slow
def test_plain_nn_syncbatchnorm_script_under_torchrun_gives_global_batch_statistics(tmp_path: Path) -> None:
    sys.path.insert(0, str(HERE))
    try:
        from plain_syncbn_ddp import LR, ROWS, build, global_batch
    finally:
        sys.path.remove(str(HERE))
    command = torchrun_command(2, "syncbn_dist.run", ["tests/plain_syncbn_ddp.py", str(tmp_path)])
    env = env_outside_torchrun(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = run_in_session(command, cwd=ROOT, env=env, timeout=150)  # a hang kills torchrun's workers too
    assert done.returncode == 0, done.stdout[-6000:]

    reference = build()  # nn.BatchNorm in one process on the global batch
    x, weights = global_batch()
    x = x.requires_grad_()
    expected = reference(x)
    (expected * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in reference.named_parameters()}
    with torch.no_grad():
        for p in reference.parameters():
            p -= LR * p.grad
    for rank in range(len(ROWS)):
        report = torch.load(tmp_path / f"rank{rank}.pt")
        rows = slice(sum(ROWS[:rank]), sum(ROWS[: rank + 1]))
        assert report["forward_module"] == PATCHED and report["classes"][1::4] == ["SyncBatchNorm", "SyncBatchNorm"]
        # float64; the global sums are merged from two ranks' partial sums: rounding only.
        tol = dict(rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(report["out"], expected[rows].detach(), **tol)
        torch.testing.assert_close(report["x_grad"], x.grad[rows], **tol)
        for name, grad in grads.items():
            torch.testing.assert_close(report["grads"][name], grad, **tol, msg=f"rank {rank} {name}")
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(report["state"][key], value, **tol, msg=f"rank {rank} {key}")
