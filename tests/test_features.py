"""The beyond-parity features (issue 6) against float64 ``nn.BatchNorm`` on the global batch.

- Mixed precision: CPU bfloat16 autocast over a conv -> SyncBN model, and whole models cast with
  ``.bfloat16()`` / ``.half()``; exact counts past 2^24 values per channel; an empty float16 rank sends the
  same payload as the others.
- channels_last / channels_last_3d: outputs and input gradients keep the layout, no hidden copy of the
  activations (saved tensors and dispatched ops are observed, never replaced).
- torch.compile: compiled equals eager (local path in-process, distributed path over gloo).
- Activation checkpointing (``use_reentrant=False``): running statistics updated once, outputs and gradients
  equal to the non-checkpointed run; plain ``nn.BatchNorm2d`` double-counts (asserted, as the docs say so).

Each feature runs on the local path (this process), the distributed path (gloo, 2 processes, uneven and
empty shards; one launch for all of them) and the DataParallel path
(``DataParallelWithCallback(cpu_replicas=2)``). Workers return what each member saw as float64 numpy arrays
plus dtype/layout tags; the comparisons with the float64 reference run in the test process.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from closeness import assert_close
from moments import combine_moments, local_moments
from step_record import step_record
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

import syncbn_dist
from launch.common.counting import CollectiveCounter
from launch.common.spawn import run_distributed
from syncbn_dist import DataParallelWithCallback, SynchronizedBatchNorm2d, SynchronizedBatchNorm3d
from syncbn_dist.comm import DistributedTransport

C = 3  # channels of every synchronized layer here
SEED = 1234
# Per-member batch sizes of each training step: uneven, and an empty second rank in the last step.
DIST_SPLITS = [(3, 2), (4, 0), (1, 4)]
# Global batch sizes of the DataParallel steps (scattered as ceil(N / 2) + rest: 3 + 2, 2 + 2).
DP_BATCHES = [5, 4]
LOCAL_BATCHES = [5, 3]

# precision name -> (parameter dtype, input dtype, CPU autocast dtype or None)
PRECISIONS: dict[str, tuple[torch.dtype, torch.dtype, torch.dtype | None]] = {
    "autocast-bf16": (torch.float32, torch.float32, torch.bfloat16),
    "bf16": (torch.bfloat16, torch.bfloat16, None),
    "fp16": (torch.float16, torch.float16, None),
}


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


# ---------------------------------------------------------------------------------------------------------
# Shared pieces: wire format, observation modules, the float64 reference.
# ---------------------------------------------------------------------------------------------------------


def _wire(obj: Any) -> Any:
    """Tensors -> float64 numpy arrays (exact for every float dtype used here), recursively; picklable."""
    if isinstance(obj, Tensor):
        return obj.detach().double().cpu().numpy().copy()
    if isinstance(obj, dict):
        return {k: _wire(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_wire(v) for v in obj)
    return obj


def _t(array: np.ndarray) -> Tensor:
    return torch.from_numpy(np.asarray(array, dtype=np.float64))


class _Tap(nn.Module):
    """Identity that keeps what passes through it and the gradient that comes back, per DataParallel replica.

    The dicts are shared by the replicas (DataParallel copies ``__dict__`` shallowly); ``copy_id`` comes from
    the replication callback. The gradient hook keeps the gradient (values are needed) but no extra reference
    reaches autograd's buffers, so it changes nothing about the computation.
    """

    def __init__(self) -> None:
        super().__init__()
        self.copy_id = 0
        self.values: dict[int, Tensor] = {}
        self.grads: dict[int, Tensor] = {}

    def __data_parallel_replicate__(self, ctx: Any, copy_id: int) -> None:
        self.copy_id = copy_id

    def forward(self, x: Tensor) -> Tensor:
        copy_id = self.copy_id
        self.values[copy_id] = x
        if x.requires_grad:
            x.register_hook(lambda g: self.grads.__setitem__(copy_id, g.detach().clone()))
        return x

    def clear(self) -> None:
        self.values.clear()
        self.grads.clear()

    def ordered(self, which: str) -> list[Tensor]:
        store = self.values if which == "values" else self.grads
        return [store[i] for i in sorted(store)]


def _init_params(model: nn.Module, seed: int) -> None:
    """Non-trivial, reproducible parameters and running statistics (identical on every member).

    Synchronized layers also get a short replica timeout, so a broken exchange fails in seconds, not 300 s.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, syncbn_dist.SyncBatchNorm):
                module.replica_timeout = 20.0
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                if module.affine:
                    module.weight.copy_(1.0 + 0.5 * torch.randn(module.weight.shape, generator=gen))
                    module.bias.copy_(0.5 * torch.randn(module.bias.shape, generator=gen))
                if module.track_running_stats:
                    module.running_mean.copy_(0.3 * torch.randn(module.running_mean.shape, generator=gen))
                    module.running_var.copy_(0.5 + torch.rand(module.running_var.shape, generator=gen))
            elif isinstance(module, (nn.Conv2d, nn.Conv3d)):
                module.weight.copy_(0.3 * torch.randn(module.weight.shape, generator=gen))
                module.bias.copy_(0.3 * torch.randn(module.bias.shape, generator=gen))


def _global_data(shape: Sequence[int], step: int, mean: float = 0.5) -> tuple[Tensor, Tensor]:
    """Global float32 input (per-channel offsets of alternating sign) and a grad_output for a C-channel output.

    Reproducible per step, so every member can cut its own rows out of the same global batch.
    """
    gen = torch.Generator().manual_seed(SEED + 17 * step)
    offsets = torch.tensor([mean * (1.0 + 0.5 * c) * (-1) ** c for c in range(shape[1])])
    x = torch.randn(*shape, generator=gen) + offsets.view([1, -1] + [1] * (len(shape) - 2))
    return x, torch.randn(shape[0], C, *shape[2:], generator=gen)


def _rows(t: Tensor, sizes: Sequence[int], member: int) -> Tensor:
    return t[sum(sizes[:member]) : sum(sizes[: member + 1])]


def _bn_reference(ndim: int, state: dict[str, Tensor], momentum: float | None = 0.1) -> nn.Module:
    cls = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[ndim]
    ref = cls(C, momentum=momentum, dtype=torch.float64)
    with torch.no_grad():
        for name in ("weight", "bias", "running_mean", "running_var"):
            getattr(ref, name).copy_(state[name])
    return ref


def _bn_state(bn: nn.Module) -> dict[str, Tensor]:
    names = ("weight", "bias", "running_mean", "running_var")
    return {name: getattr(bn, name).detach().double().clone() for name in names}


# ---------------------------------------------------------------------------------------------------------
# Mixed precision
# ---------------------------------------------------------------------------------------------------------


def _conv_bn(precision: str) -> nn.Sequential:
    """conv -> tap -> SynchronizedBatchNorm2d -> tap, parameters in the precision's dtype."""
    param_dtype, _, _ = PRECISIONS[precision]
    model = nn.Sequential(nn.Conv2d(2, C, 3, padding=1), _Tap(), SynchronizedBatchNorm2d(C), _Tap())
    _init_params(model, SEED)
    return model.to(param_dtype)


def _mixed_precision_steps(
    precision: str, model: nn.Sequential, forward: Callable[[Tensor], Tensor], batches: Sequence[tuple[Tensor, Tensor]]
) -> dict[str, Any]:
    """Train ``forward`` (the model itself or a wrapper) on each (x, grad_output) pair; record what the BN saw.

    Returns the initial BN state and, per step, the BN's inputs, outputs, their gradients (concatenated over
    replicas in copy_id order), the parameter gradients, the buffers, and the dtypes of all of them.
    """
    _, input_dtype, autocast_dtype = PRECISIONS[precision]
    tap_in, bn, tap_out = model[1], model[2], model[3]
    record: dict[str, Any] = {"initial": _bn_state(bn), "steps": []}
    for x, grad_output in batches:
        tap_in.clear()
        tap_out.clear()
        model.zero_grad(set_to_none=True)
        x = x.to(input_dtype)
        with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            y = forward(x)
        y.backward(grad_output.to(y.dtype))
        ins, outs = tap_in.ordered("values"), tap_out.ordered("values")
        grad_ins, grad_outs = tap_in.ordered("grads"), tap_out.ordered("grads")
        record["steps"].append(
            {
                "x": torch.cat(ins),
                "y": torch.cat(outs),
                "dy": torch.cat(grad_outs),
                "dx": torch.cat(grad_ins),
                "grad_weight": bn.weight.grad,
                "grad_bias": bn.bias.grad,
                "running_mean": bn.running_mean.clone(),
                "running_var": bn.running_var.clone(),
                "num_batches_tracked": int(bn.num_batches_tracked),
                "transport": bn.last_transport,
                "dtypes": {
                    "x": str(ins[0].dtype),
                    "y": {str(t.dtype) for t in outs},
                    "dx": {str(t.dtype) for t in grad_ins},
                    "grad_param": {str(bn.weight.grad.dtype), str(bn.bias.grad.dtype)},
                    "running": {str(bn.running_mean.dtype), str(bn.running_var.dtype)},
                },
            }
        )
    return record


def _check_mixed_precision(precision: str, members: Sequence[dict[str, Any]], transport: str) -> None:
    """Compare the members' records (one per rank, or one for local/DataParallel) with float64 BN."""
    param_dtype, input_dtype, autocast_dtype = PRECISIONS[precision]
    compute_dtype = autocast_dtype or input_dtype
    ref = _bn_reference(4, {k: _t(v) for k, v in members[0]["initial"].items()})
    for step in range(len(members[0]["steps"])):
        records = [member["steps"][step] for member in members]
        what = f"{precision} {transport} step {step}"
        for r in records:
            assert r["transport"] == transport, f"{what}: took the {r['transport']} path"
            assert r["dtypes"]["x"] == str(compute_dtype), f"{what}: the BN saw {r['dtypes']['x']}"
            # Outputs and input grads come back in the input dtype, parameter grads and buffers in theirs.
            assert r["dtypes"]["y"] <= {str(compute_dtype)}, f"{what}: output dtypes {r['dtypes']['y']}"
            assert r["dtypes"]["dx"] <= {str(compute_dtype)}, f"{what}: input grad dtypes {r['dtypes']['dx']}"
            assert r["dtypes"]["grad_param"] == {str(param_dtype)}, f"{what}: {r['dtypes']['grad_param']}"
            assert r["dtypes"]["running"] == {str(param_dtype)}, f"{what}: {r['dtypes']['running']}"
        x = torch.cat([_t(r["x"]) for r in records]).requires_grad_()
        dy = torch.cat([_t(r["dy"]) for r in records])
        ref.zero_grad(set_to_none=True)
        y_ref = ref(x)
        y_ref.backward(dy)
        eps_in = torch.finfo(compute_dtype).eps  # 2^-7 (bfloat16), 2^-10 (float16): one ulp at 1.0
        eps_param = torch.finfo(param_dtype).eps
        var, mean = torch.var_mean(x.detach(), dim=(0, 2, 3), correction=0)
        invstd = torch.rsqrt(var + ref.eps)
        x_hat = ((x.detach() - mean.view(1, -1, 1, 1)) * invstd.view(1, -1, 1, 1)).abs().max().item()
        scale = (ref.weight.detach().abs() * invstd).max().item()
        # Output: normalized in float32 from exact float64 statistics, then rounded once to the input dtype.
        assert_close(
            torch.cat([_t(r["y"]) for r in records]),
            y_ref,
            f"{what} output",
            rtol=eps_in,
            atol=eps_in * y_ref.detach().abs().max().item() / 4,
        )
        # Input grad: a * dy + (b * x + c) with a rounded to the input dtype and (b * x + c) rounded before the
        # add, each at most half an ulp of terms bounded by scale * |dy| * (1 + max |x_hat|).
        grad_scale = scale * dy.abs().max().item() * (1.0 + x_hat)
        assert_close(
            torch.cat([_t(r["dx"]) for r in records]),
            x.grad,
            f"{what} grad_input",
            rtol=0.0,
            atol=2 * eps_in * grad_scale,
        )
        # Parameter grads: float32 sums of count terms |dy| * |x_hat|, then rounded to the parameter dtype on
        # each member (summed over members here, as DDP would).
        count = x.size(0) * x.size(2) * x.size(3)
        accumulation = 1e-6 * count * dy.abs().max().item() * (1.0 + x_hat)
        for name, expected in (("grad_weight", ref.weight.grad), ("grad_bias", ref.bias.grad)):
            total = sum(_t(r[name]) for r in records)
            assert_close(
                total,
                expected,
                f"{what} {name}",
                rtol=len(records) * eps_param,
                atol=accumulation + eps_param * expected.abs().max().item(),
            )
        # Running stats: float64 statistics of the exact low-precision data; float32 buffers get one rounding
        # (1e-6 relative), low-precision buffers the mul_/add_ roundings of the momentum update (2 ulps).
        running_tol = 1e-6 if param_dtype == torch.float32 else 2 * eps_param
        for r in records:
            for name in ("running_mean", "running_var"):
                assert_close(_t(r[name]), getattr(ref, name), f"{what} {name}", rtol=running_tol, atol=1e-7)
            assert r["num_batches_tracked"] == int(ref.num_batches_tracked), what


def _local_batches(sizes: Sequence[int], tail: Sequence[int] = (5, 4)) -> list[tuple[Tensor, Tensor]]:
    return [_global_data((n, 2, *tail), step) for step, n in enumerate(sizes)]


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_mixed_precision_local_matches_float64_batchnorm(precision: str) -> None:
    model = _conv_bn(precision)
    record = _mixed_precision_steps(precision, model, model, _local_batches(LOCAL_BATCHES))
    _check_mixed_precision(precision, [_wire(record)], "local")


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_mixed_precision_dataparallel_matches_float64_batchnorm(precision: str) -> None:
    model = _conv_bn(precision)
    wrapped = DataParallelWithCallback(model, cpu_replicas=2)
    record = _mixed_precision_steps(precision, model, wrapped, _local_batches(DP_BATCHES))
    _check_mixed_precision(precision, [_wire(record)], "dataparallel")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_count_stays_exact_past_2_24_values_per_channel(dtype: torch.dtype) -> None:
    """2^24 + 3 values in one channel (32 MiB): float32 would round the count to 2^24 + 4."""
    n = 2**24 + 3
    gen = torch.Generator().manual_seed(SEED)
    x = (torch.randn(n, 1, generator=gen) * 2.0 + 3.0).to(dtype)
    count, moments = local_moments(x)
    assert count.dtype == torch.float64 and count.item() == n
    assert float(torch.tensor(float(n), dtype=torch.float32)) != n  # what a float32 count would have given
    mean, var = combine_moments(count, moments)
    values = x.double()
    ref_var, ref_mean = torch.var_mean(values, dim=0, correction=0)
    # Statistics are accumulated in (at least) float32 over bounded chunks and merged in float64: the mean to
    # ~1e-7 relative (one serial float32 sum of 2^24 values around 3 drifts by ~1e-2).
    assert_close(mean, ref_mean, "mean", rtol=1e-6, atol=0.0)
    # Variance: the same (~1e-6 relative); the unchunked float32 kernel is off by ~3e-2 here.
    assert_close(var, ref_var, "variance", rtol=1e-5, atol=0.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_autocast_outputs_and_running_stats_match_float64_batchnorm(dtype: torch.dtype) -> None:
    """CUDA autocast (fp16 and bf16) on the local path: the conv emits ``dtype``, the BN keeps it."""
    model = nn.Sequential(nn.Conv2d(2, C, 3, padding=1), SynchronizedBatchNorm2d(C))
    _init_params(model, SEED)
    initial = _bn_state(model[1])
    model = model.cuda()
    x, dy = _global_data((6, 2, 5, 4), 0)
    with torch.autocast("cuda", dtype=dtype):
        h = model[0](x.cuda())
        h.retain_grad()
        y = model[1](h)
    y.backward(dy.cuda().to(y.dtype))
    assert h.dtype == y.dtype == h.grad.dtype == dtype and model[1].weight.grad.dtype == torch.float32
    ref = _bn_reference(4, initial)
    h64 = h.detach().double().cpu().requires_grad_()
    y_ref = ref(h64)
    y_ref.backward(dy.to(dtype).double())
    eps = torch.finfo(dtype).eps
    # Output rounded once to ``dtype``; input grad a few roundings of terms of size |w * invstd * dy| (<~ 30 here).
    assert_close(y.cpu(), y_ref, "output", rtol=eps, atol=eps * y_ref.abs().max().item() / 4)
    assert_close(h.grad.cpu(), h64.grad, "grad_input", rtol=0.0, atol=4 * eps * h64.grad.abs().max().item())
    # Buffers are float32, statistics float64 over the exact low-precision values: one float32 rounding.
    assert_close(model[1].running_var.cpu(), ref.running_var, "running_var", rtol=1e-6, atol=0.0)
    assert_close(model[1].running_mean.cpu(), ref.running_mean, "running_mean", rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------------------
# channels_last: observe the layout, the saved tensors and every activation-sized op
# ---------------------------------------------------------------------------------------------------------

# Ops that copy or allocate an activation-sized buffer without computing anything: a hidden .contiguous()
# shows up as clone (or empty_like/new_empty_strided + copy_).
_COPY_OPS = {
    "clone",
    "copy_",
    "_to_copy",
    "_copy_from",
    "_copy_from_and_resize",
    "contiguous",
    "empty_like",
    "new_empty_strided",
    "empty_strided",
    "new_empty",
    "as_strided_copy",
}


def _format_of(t: Tensor) -> torch.memory_format:
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


class _ActivationOps(TorchDispatchMode):
    """Logs the name of every dispatched op that touches a floating tensor with at least ``numel`` elements."""

    def __init__(self, numel: int, log: list[str]) -> None:
        super().__init__()
        self.numel = numel
        self.log = log

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_flatten((args, kwargs or {}, out))[0] if isinstance(t, Tensor)]
        if any(t.is_floating_point() and t.numel() >= self.numel for t in tensors):
            name = func._overloadpacket.__name__
            if name == "_to_copy" and out.dtype == torch.float64 and out.is_contiguous(memory_format=_format_of(out)):
                # The statistics pass reads a float64 conversion of the shard, in the shard's own layout: a dtype
                # change the statistics need (see syncbn_dist.kernels.native.local_payload), not a re-laid-out copy.
                name = "_to_copy(float64, same layout)"
            self.log.append(name)
        return out


class _Watched(nn.Module):
    """Runs ``inner`` while recording the saved tensors and the activation-sized ops of its forward.

    Saved-tensor hooks and dispatch modes are thread-local, so they are entered here, inside each DataParallel
    replica's thread. Shared lists (appends are atomic) collect the observations of every replica.
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.input_ptrs: list[int] = []
        self.input_numels: list[int] = []
        self.saved: list[tuple[int, int]] = []  # (data_ptr, numel) of every tensor saved for backward
        self.ops: list[str] = []
        self.grad_layouts: list[tuple[bool, bool]] = []  # (in the input's layout, plain contiguous)
        self.output_layouts: list[tuple[bool, bool]] = []

    def forward(self, x: Tensor) -> Tensor:
        fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        self.input_ptrs.append(x.data_ptr())
        self.input_numels.append(x.numel())

        def pack(t: Tensor) -> Tensor:
            self.saved.append((t.data_ptr(), t.numel()))
            return t

        if x.requires_grad:
            x.register_hook(lambda g: self.grad_layouts.append((g.is_contiguous(memory_format=fmt), g.is_contiguous())))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _ActivationOps(x.numel(), self.ops):
            y = self.inner(x)
        self.output_layouts.append((y.is_contiguous(memory_format=fmt), y.is_contiguous()))
        return y


def _memory_format_steps(
    ndim: int, forward: Callable[[Tensor], Tensor], watched: _Watched, batches: Sequence[tuple[Tensor, Tensor]]
) -> dict[str, Any]:
    """Train on channels_last(_3d) batches; record layouts, saved tensors, ops, and values for the reference."""
    fmt = torch.channels_last if ndim == 4 else torch.channels_last_3d
    bn = watched.inner
    record: dict[str, Any] = {"initial": _bn_state(bn), "steps": []}
    for x, grad_output in batches:
        for log in (
            watched.input_ptrs,
            watched.input_numels,
            watched.saved,
            watched.ops,
            watched.grad_layouts,
            watched.output_layouts,
        ):
            log.clear()
        bn.zero_grad(set_to_none=True)
        x = x.contiguous(memory_format=fmt).requires_grad_()
        y = forward(x)
        forward_ops = list(watched.ops)
        watched.ops.clear()
        # The smallest replica input bounds what counts as activation-sized (C-sized statistics are far below).
        grad_output = grad_output.contiguous(memory_format=fmt)  # as a channels-last consumer would send it
        with _ActivationOps(min(watched.input_numels), watched.ops):
            y.backward(grad_output)
        activation_saved = [(ptr, n) for ptr, n in watched.saved if n >= min(watched.input_numels)]
        record["steps"].append(
            {
                "x": x.detach(),
                "dy": grad_output,
                "y": y.detach(),
                "dx": x.grad,
                "input_ptrs": list(watched.input_ptrs),
                "activation_saved": activation_saved,
                "forward_ops": forward_ops,
                "backward_ops": list(watched.ops),
                "output_layouts": list(watched.output_layouts),
                "grad_layouts": list(watched.grad_layouts),
                "grad_weight": bn.weight.grad,
                "grad_bias": bn.bias.grad,
                "running_mean": bn.running_mean.clone(),
                "running_var": bn.running_var.clone(),
                "transport": bn.last_transport,
            }
        )
    return record


def _check_memory_format(ndim: int, members: Sequence[dict[str, Any]], transport: str) -> None:
    ref = _bn_reference(ndim, {k: _t(v) for k, v in members[0]["initial"].items()})
    dims = [0] + list(range(2, ndim))
    for step in range(len(members[0]["steps"])):
        records = [member["steps"][step] for member in members]
        what = f"{ndim}D {transport} step {step}"
        for r in records:
            if r["x"].size == 0:
                continue
            assert r["transport"] == transport, f"{what}: took the {r['transport']} path"
            # (in channels_last(_3d), also plain contiguous): exactly the channels-last layout, never the other.
            assert r["output_layouts"] and all(lay == (True, False) for lay in r["output_layouts"]), what
            assert r["grad_layouts"] and all(lay == (True, False) for lay in r["grad_layouts"]), what
            # What autograd keeps is the input itself (same storage), never a re-laid-out copy of it.
            assert r["activation_saved"], f"{what}: no saved activation observed"
            saved_ptrs = {ptr for ptr, _ in r["activation_saved"]}
            assert saved_ptrs <= set(r["input_ptrs"]), f"{what}: saved {saved_ptrs}, inputs at {r['input_ptrs']}"
            copies = (set(r["forward_ops"]) | set(r["backward_ops"])) & _COPY_OPS
            # One float64 conversion per statistics pass, in the channels-last layout, and none in backward.
            conversions = r["forward_ops"].count("_to_copy(float64, same layout)")
            assert conversions == r["forward_ops"].count("batch_norm_update_stats"), f"{what}: {r['forward_ops']}"
            assert "_to_copy(float64, same layout)" not in r["backward_ops"], f"{what}: {r['backward_ops']}"
            assert not copies, (
                f"{what}: activation-sized copies {copies} (forward {r['forward_ops']}, backward {r['backward_ops']})"
            )
        x = torch.cat([_t(r["x"]) for r in records]).requires_grad_()
        dy = torch.cat([_t(r["dy"]) for r in records])
        ref.zero_grad(set_to_none=True)
        y_ref = ref(x)
        y_ref.backward(dy)
        # float32 data of O(1) (|mean|/std <= 1.25): outputs and grads to a few float32 ulps of their scale.
        var = torch.var(x.detach(), dim=dims, correction=0)
        scale = (ref.weight.detach().abs() * torch.rsqrt(var + ref.eps)).max().item()
        assert_close(torch.cat([_t(r["y"]) for r in records]), y_ref, f"{what} output", rtol=0.0, atol=1e-5)
        assert_close(
            torch.cat([_t(r["dx"]) for r in records]),
            x.grad,
            f"{what} grad_input",
            rtol=0.0,
            atol=1e-5 * scale * dy.abs().max().item(),
        )
        for name, expected in (("grad_weight", ref.weight.grad), ("grad_bias", ref.bias.grad)):
            # Sums of ~count O(1) float32 terms per member.
            assert_close(sum(_t(r[name]) for r in records), expected, f"{what} {name}", rtol=1e-5, atol=1e-4)
        for r in records:
            for name in ("running_mean", "running_var"):
                assert_close(_t(r[name]), getattr(ref, name), f"{what} {name}", rtol=1e-6, atol=1e-7)


MEMORY_FORMAT_CASES = {4: (SynchronizedBatchNorm2d, (4, 6)), 5: (SynchronizedBatchNorm3d, (2, 3, 4))}


def _watched_bn(ndim: int) -> _Watched:
    cls, _ = MEMORY_FORMAT_CASES[ndim]
    bn = cls(C)
    _init_params(bn, SEED)
    return _Watched(bn)


@pytest.mark.parametrize("ndim", [4, 5])
def test_channels_last_dataparallel_keeps_layout_without_copies(ndim: int) -> None:
    watched = _watched_bn(ndim)
    tail = MEMORY_FORMAT_CASES[ndim][1]
    batches = [_global_data((n, C, *tail), step) for step, n in enumerate(DP_BATCHES)]
    wrapped = DataParallelWithCallback(watched, cpu_replicas=2)
    record = _memory_format_steps(ndim, wrapped, watched, batches)
    # The gathered output is a torch.cat of channels-last replica outputs, so it keeps the layout too.
    for step in record["steps"]:
        fmt = torch.channels_last if ndim == 4 else torch.channels_last_3d
        assert step["y"].is_contiguous(memory_format=fmt)
    _check_memory_format(ndim, [_wire(record)], "dataparallel")


# ---------------------------------------------------------------------------------------------------------
# Activation checkpointing
# ---------------------------------------------------------------------------------------------------------


def _block(momentum: float | None, bn_cls: type[nn.Module] = SynchronizedBatchNorm2d) -> nn.Sequential:
    """BN -> ReLU -> conv -> BN: the first BN sees the block input, so it has a global float64 reference."""
    block = nn.Sequential(
        bn_cls(C, momentum=momentum), nn.ReLU(), nn.Conv2d(C, C, 3, padding=1), bn_cls(C, momentum=momentum)
    )
    _init_params(block, SEED)
    return block


class _Checkpointed(nn.Module):
    """Runs ``block`` under activation checkpointing (non-reentrant unless asked)."""

    def __init__(self, block: nn.Module, use_reentrant: bool = False) -> None:
        super().__init__()
        self.block = block
        self.use_reentrant = use_reentrant

    def forward(self, x: Tensor) -> Tensor:
        return checkpoint(self.block, x, use_reentrant=self.use_reentrant)


def _checkpoint_steps(
    block: nn.Module, forward: Callable[[Tensor], Tensor], batches: Sequence[tuple[Tensor, Tensor]]
) -> dict[str, Any]:
    """Train and record outputs, input grads, every parameter grad and every BN buffer after each step."""
    first_bn = next(m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))
    record: dict[str, Any] = {"initial": _bn_state(first_bn), "steps": []}
    for x, grad_output in batches:
        block.zero_grad(set_to_none=True)
        x = x.clone().requires_grad_()
        y = forward(x)
        y.backward(grad_output)
        step = {"x": x.detach(), "dy": grad_output, "y": y.detach(), "dx": x.grad}
        for name, p in block.named_parameters():
            step[f"grad {name}"] = p.grad
        for name, b in block.named_buffers():
            step[name] = b.clone()
        step["transport"] = getattr(first_bn, "last_transport", None)
        record["steps"].append(step)
    return record


def _assert_checkpointed_equals_plain(
    checkpointed: Sequence[dict[str, Any]], plain: Sequence[dict[str, Any]], step: int, what: str
) -> None:
    for member, (ck, pl) in enumerate(zip(checkpointed, plain)):
        ck, pl = ck["steps"][step], pl["steps"][step]
        assert ck.keys() == pl.keys()
        assert ck["transport"] == pl["transport"], what
        for key in ck:
            if key != "transport":
                # Same data, same ops, same statistics (recomputed identically or replayed): bitwise equal.
                assert_close(_t(ck[key]), _t(pl[key]), f"{what} member {member} {key}", rtol=0.0, atol=0.0)


def _check_checkpoint(
    checkpointed: Sequence[dict[str, Any]], plain: Sequence[dict[str, Any]], momentum: float | None, transport: str
) -> None:
    """Checkpointed equals non-checkpointed exactly; the first BN also equals float64 BN on the global batch."""
    ref = _bn_reference(4, {k: _t(v) for k, v in checkpointed[0]["initial"].items()}, momentum)
    for step in range(len(checkpointed[0]["steps"])):
        what = f"checkpoint {transport} momentum={momentum} step {step}"
        _assert_checkpointed_equals_plain(checkpointed, plain, step, what)
        for member in checkpointed:
            record = member["steps"][step]
            assert record["transport"] == transport, what
            assert record["0.num_batches_tracked"] == record["3.num_batches_tracked"] == step + 1, what
        x = torch.cat([_t(m["steps"][step]["x"]) for m in checkpointed])
        ref(x)
        for name in ("running_mean", "running_var"):
            for member in checkpointed:
                # float64 statistics rounded into float32 buffers (see test_batchnorm's _RUNNING_TOL).
                assert_close(
                    _t(member["steps"][step][f"0.{name}"]), getattr(ref, name), f"{what} {name}", rtol=1e-6, atol=1e-7
                )


class _SharedBlock(nn.Module):
    """One synchronized layer applied twice (bn -> relu -> conv -> bn): its recomputations must replay in order."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = SynchronizedBatchNorm2d(C)
        self.conv = nn.Conv2d(C, C, 3, padding=1)
        _init_params(self, SEED)

    def forward(self, x: Tensor) -> Tensor:
        return self.bn(self.conv(F.relu(self.bn(x))))


def _check_shared_checkpoint(
    checkpointed: Sequence[dict[str, Any]], plain: Sequence[dict[str, Any]], transport: str
) -> None:
    for step in range(len(checkpointed[0]["steps"])):
        what = f"checkpoint shared layer {transport} step {step}"
        _assert_checkpointed_equals_plain(checkpointed, plain, step, what)
        for member in checkpointed:
            assert member["steps"][step]["transport"] == transport, what
            assert member["steps"][step]["bn.num_batches_tracked"] == 2 * (step + 1), what


def _checkpoint_batches(sizes: Sequence[int]) -> list[tuple[Tensor, Tensor]]:
    return [_global_data((n, C, 4, 5), step) for step, n in enumerate(sizes)]


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_checkpoint_local_updates_running_stats_once_and_matches(momentum: float | None, use_reentrant: bool) -> None:
    block = _block(momentum)
    plain_block = copy.deepcopy(block)
    batches = _checkpoint_batches(LOCAL_BATCHES + [4])
    checkpointed = _checkpoint_steps(block, _Checkpointed(block, use_reentrant), batches)
    plain = _checkpoint_steps(plain_block, plain_block, batches)
    _check_checkpoint([_wire(checkpointed)], [_wire(plain)], momentum, "local")


@pytest.mark.parametrize("momentum", [0.1, None])
def test_checkpoint_dataparallel_updates_running_stats_once_and_matches(momentum: float | None) -> None:
    block = _block(momentum)
    plain_block = copy.deepcopy(block)
    batches = _checkpoint_batches(DP_BATCHES + [5])
    checkpointed = _checkpoint_steps(block, DataParallelWithCallback(_Checkpointed(block), cpu_replicas=2), batches)
    plain = _checkpoint_steps(plain_block, DataParallelWithCallback(plain_block, cpu_replicas=2), batches)
    _check_checkpoint([_wire(checkpointed)], [_wire(plain)], momentum, "dataparallel")


@pytest.mark.parametrize("transport", ["local", "dataparallel"])
def test_checkpoint_layer_applied_twice_recomputes_both_applications(transport: str) -> None:
    block = _SharedBlock()
    plain_block = copy.deepcopy(block)
    batches = _checkpoint_batches([5, 4])
    if transport == "local":
        checkpointed = _checkpoint_steps(block, _Checkpointed(block), batches)
        plain = _checkpoint_steps(plain_block, plain_block, batches)
    else:
        checkpointed = _checkpoint_steps(block, DataParallelWithCallback(_Checkpointed(block), cpu_replicas=2), batches)
        plain = _checkpoint_steps(plain_block, DataParallelWithCallback(plain_block, cpu_replicas=2), batches)
    _check_shared_checkpoint([_wire(checkpointed)], [_wire(plain)], transport)


def test_plain_batchnorm_double_counts_under_checkpoint() -> None:
    """The peer behaviour the docs describe: nn.BatchNorm2d updates its buffers again in the recomputation."""
    block = _block(0.1, nn.BatchNorm2d)
    plain_block = copy.deepcopy(block)
    batches = _checkpoint_batches(LOCAL_BATCHES)
    checkpointed = _checkpoint_steps(block, _Checkpointed(block), batches)
    plain = _checkpoint_steps(plain_block, plain_block, batches)
    for step, (ck, pl) in enumerate(zip(checkpointed["steps"], plain["steps"])):
        assert int(pl["0.num_batches_tracked"]) == step + 1
        assert int(ck["0.num_batches_tracked"]) == 2 * (step + 1)
        # The recomputation applied the momentum update a second time, so the buffers moved further.
        assert not torch.allclose(ck["0.running_mean"], pl["0.running_mean"], rtol=1e-3, atol=1e-4)
        # Gradients are still right: the recomputation used the same batch statistics.
        torch.testing.assert_close(ck["dx"], pl["dx"], rtol=0.0, atol=0.0)


# ---------------------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------------------


def _compile_model() -> nn.Sequential:
    model = nn.Sequential(
        nn.Conv2d(2, C, 3, padding=1),
        SynchronizedBatchNorm2d(C),
        nn.ReLU(),
        nn.Conv2d(C, C, 1),
        SynchronizedBatchNorm2d(C, momentum=None),
    )
    _init_params(model, SEED)
    return model


def _compile_steps(
    model: nn.Module,
    forward: Callable[[Tensor], Tensor],
    batches: Sequence[tuple[Tensor, Tensor]],
) -> list[dict[str, Any]]:
    """Two training steps, then one eval step; outputs, input/parameter grads and buffers after each."""
    steps = []
    for i, (x, grad_output) in enumerate(batches):
        model.train(i < len(batches) - 1)
        step: dict[str, Any] = step_record(model, forward, x, grad_output)
        step["transports"] = [m.last_transport for m in model.modules() if isinstance(m, syncbn_dist.SyncBatchNorm)]
        steps.append(step)
    return steps


def _graph_breaks() -> list[str]:
    return [reason.split("\n")[0] for reason in torch._dynamo.utils.counters["graph_break"]]


def _check_compiled_equals_eager(
    compiled: Sequence[dict[str, Any]], eager: Sequence[dict[str, Any]], what: str, transport: str
) -> None:
    for i, (c, e) in enumerate(zip(compiled, eager)):
        assert c.keys() == e.keys()
        expected_transports = [transport] * 2 if i < len(compiled) - 1 else ["local"] * 2
        assert c["transports"] == e["transports"] == expected_transports, f"{what} step {i}: {c['transports']}"
        for key in c:
            if key == "transports":
                continue
            # The compiled graph may reorder or fuse float32 ops (aot_eager decomposes, inductor generates
            # kernels): a few float32 ulps of O(1) values; num_batches_tracked is exact. Parameter gradients are
            # float32 sums of 100 O(1) products per channel, which inductor reorders: a few ulps of the partial
            # sums (~1e-6 each, up to ~1e-5 in all), so they get 1e-4 absolute.
            atol = 1e-4 if key.startswith("grad ") else 1e-5
            assert_close(_t(c[key]), _t(e[key]), f"{what} step {i} {key}", rtol=1e-5, atol=atol)


def _has_cxx_compiler() -> bool:
    return any(shutil.which(cc) for cc in ("g++", "c++", "clang++"))


@pytest.mark.parametrize(
    "backend",
    [
        "aot_eager",
        pytest.param(
            "inductor",
            marks=[
                pytest.mark.slow,
                pytest.mark.skipif(not _has_cxx_compiler(), reason="inductor needs a C++ compiler on CPU"),
            ],
        ),
    ],
)
def test_compile_local_path_equals_eager(backend: str) -> None:
    torch._dynamo.reset()
    eager_model = _compile_model()
    model = copy.deepcopy(eager_model)
    compiled = torch.compile(model, backend=backend)
    batches = [_global_data((n, 2, 4, 5), step) for step, n in enumerate([5, 4, 3])]
    _check_compiled_equals_eager(
        _compile_steps(model, compiled, batches), _compile_steps(eager_model, eager_model, batches), backend, "local"
    )


def test_compile_eval_mode_has_no_graph_break() -> None:
    """In eval mode the layer is F.batch_norm with running statistics: one graph for the whole model."""
    torch._dynamo.reset()
    model = _compile_model().eval()
    x, _ = _global_data((4, 2, 4, 5), 0)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # raises on any graph break
    with torch.no_grad():
        assert_close(compiled(x), model(x), "eval output", rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# The distributed launches
# ---------------------------------------------------------------------------------------------------------


def _large_count_check(rank: int, world_size: int) -> dict[str, Any]:
    """Both ranks hold more than 2^24 float16 values of one channel; the combined count must be exact."""
    n = 2**24 + 3 + rank
    gen = torch.Generator().manual_seed(SEED + rank)
    x = (torch.randn(n, 1, generator=gen) * 2.0 + 3.0 + rank).half()
    count, moments = local_moments(x)
    total_count, total_moments = DistributedTransport().all_reduce([count, moments])
    mean, var = combine_moments(total_count, total_moments)
    # Independent float64 reference: exact per-shard sums and two-pass squared deviations, merged exactly.
    values = x.double()
    shard_sum = values.sum().item()
    shard_m2 = ((values - shard_sum / n) ** 2).sum().item()
    del values
    shards: list[Any] = [None] * world_size
    dist.all_gather_object(shards, (n, shard_sum, shard_m2))
    # The module itself on the same shards: float16 buffers and output.
    bn = syncbn_dist.SynchronizedBatchNorm1d(1, momentum=1.0).half()
    with torch.no_grad():
        y = bn(x)
    return {
        "count": total_count.item(),
        "mean": mean.item(),
        "var": var.item(),
        "shards": shards,
        "running_mean": bn.running_mean.item(),
        "running_var": bn.running_var.item(),
        "output_dtype": str(y.dtype),
        "output_sample": y[:1000].double().numpy().copy(),
        "input_sample": x[:1000].double().numpy().copy(),
    }


def _shard_batches(
    rank: int, splits: Sequence[Sequence[int]], channels: int, tail: Sequence[int]
) -> list[tuple[Tensor, Tensor]]:
    """This rank's rows of each step's global (input, grad_output); ``splits[step][rank]`` rows each."""
    return [
        tuple(_rows(t, sizes, rank) for t in _global_data((sum(sizes), channels, *tail), step))
        for step, sizes in enumerate(splits)
    ]


def _compile_check(rank: int) -> dict[str, Any]:
    """A compiled model (aot_eager) against the same model in eager mode, both synchronizing over gloo."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager_model = _compile_model()
    model = copy.deepcopy(eager_model)
    compiled = torch.compile(model, backend="aot_eager")
    sizes_per_step = [(3, 2), (1, 4), (2, 3)]
    batches = _shard_batches(rank, sizes_per_step, 2, (4, 5))
    compiled_steps = _compile_steps(model, compiled, batches)
    breaks = _graph_breaks()
    return {
        "compiled": _wire(compiled_steps),
        "eager": _wire(_compile_steps(eager_model, eager_model, batches)),
        "graph_breaks": breaks,
    }


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    """Every feature over one gloo group: mixed precision, payloads, counts, layouts, checkpointing, compile."""
    torch.manual_seed(SEED)
    out: dict[str, Any] = {"mixed": {}, "payloads": {}, "memory_format": {}, "checkpoint": {}}
    for precision in PRECISIONS:
        model = _conv_bn(precision)
        batches = _shard_batches(rank, DIST_SPLITS, 2, (5, 4))
        with CollectiveCounter() as log:
            record = _mixed_precision_steps(precision, model, model, batches)
        out["mixed"][precision] = _wire(record)
        # Not the first call's agreement check, whose record is uint8 (syncbn_dist.comm.agreement).
        calls = [call for call in log.calls if call["dtype"] != "uint8"]
        out["payloads"][precision] = [(call["dtype"], call["bytes"] // 8) for call in calls]
    for ndim, (_, tail) in MEMORY_FORMAT_CASES.items():
        watched = _watched_bn(ndim)
        batches = _shard_batches(rank, [(3, 2), (4, 1)], C, tail)  # N == 1 on rank 1: degenerate strides
        out["memory_format"][ndim] = _wire(_memory_format_steps(ndim, watched, watched, batches))
    for momentum in (0.1, None):
        block = _block(momentum)
        plain_block = copy.deepcopy(block)
        batches = _shard_batches(rank, DIST_SPLITS, C, (4, 5))
        out["checkpoint"][momentum] = (
            _wire(_checkpoint_steps(block, _Checkpointed(block), batches)),
            _wire(_checkpoint_steps(plain_block, plain_block, batches)),
        )
    block = _SharedBlock()
    plain_block = copy.deepcopy(block)
    batches = _shard_batches(rank, DIST_SPLITS, C, (4, 5))
    out["checkpoint"]["shared"] = (
        _wire(_checkpoint_steps(block, _Checkpointed(block), batches)),
        _wire(_checkpoint_steps(plain_block, plain_block, batches)),
    )
    out["large_count"] = _large_count_check(rank, world_size)
    out["compile"] = _compile_check(rank)
    return out


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_distributed_features() -> None:
    """One launch (start-up is the expensive part); each part names itself in its assertion messages."""
    results = run_distributed(_worker, 2, timeout=240)
    for precision in PRECISIONS:
        _check_mixed_precision(precision, [r["mixed"][precision] for r in results], "distributed")
        # Every rank, the empty one included, sends the same payloads: float64 [sum(C), sumsq(C), count] forward,
        # float64 [sum(dy), sum(dy * x_hat), 0] backward, each with its collective tag (5 values), one all_reduce each
        # per step. Ranks sending
        # different collectives would hang or leave wrong statistics.
        payloads = [r["payloads"][precision] for r in results]
        assert payloads[0] == payloads[1], f"{precision}: payloads differ across ranks: {payloads}"
        expected = [("float64", 2 * C + 6), ("float64", 2 * C + 6)] * len(DIST_SPLITS)
        assert payloads[0] == expected, payloads
    for ndim in MEMORY_FORMAT_CASES:
        _check_memory_format(ndim, [r["memory_format"][ndim] for r in results], "distributed")
    for momentum in (0.1, None):
        _check_checkpoint(
            [r["checkpoint"][momentum][0] for r in results],
            [r["checkpoint"][momentum][1] for r in results],
            momentum,
            "distributed",
        )
    _check_shared_checkpoint(
        [r["checkpoint"]["shared"][0] for r in results], [r["checkpoint"]["shared"][1] for r in results], "distributed"
    )
    large = [r["large_count"] for r in results]
    n_total = sum(n for n, _, _ in large[0]["shards"])
    assert n_total == 2 * (2**24 + 3) + 1 and n_total > 2**25
    total_sum = sum(s for _, s, _ in large[0]["shards"])
    ref_mean = total_sum / n_total
    ref_m2 = sum(m2 + n * (s / n - ref_mean) ** 2 for n, s, m2 in large[0]["shards"])  # Chan et al. 1979
    ref_var = ref_m2 / n_total
    for r in large:
        assert r["count"] == n_total  # exact in float64; float32 would round it
        assert r["mean"] == pytest.approx(ref_mean, rel=1e-6)  # float32 chunk accumulation, float64 merge
        assert r["var"] == pytest.approx(ref_var, rel=1e-5)  # float32 over bounded chunks, merged in float64
        assert r["output_dtype"] == "torch.float16"
        # float16 buffers after one update with momentum 1: the statistics rounded once to float16.
        assert r["running_mean"] == pytest.approx(ref_mean, rel=2**-10)
        assert r["running_var"] == pytest.approx(ref_var * n_total / (n_total - 1), rel=2**-10)
        expected = (r["input_sample"] - ref_mean) / np.sqrt(ref_var + 1e-5)
        # Output normalized in float32 and rounded once to float16 (|y| <= ~5: 2^-11 * 5 < 3e-3).
        np.testing.assert_allclose(r["output_sample"], expected, rtol=0.0, atol=4e-3)
    for rank, r in enumerate(results):
        _check_compiled_equals_eager(r["compile"]["compiled"], r["compile"]["eager"], f"rank {rank}", "distributed")
        # The synchronized path is traced whole: no graph break (tests/test_compile.py covers fullgraph=True).
        breaks = r["compile"]["graph_breaks"]
        assert breaks == [], breaks
