"""DataParallel integration: replication callbacks, DataParallelWithCallback, and CPU thread replicas."""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import torch
import torch.utils._pytree
from torch import Tensor, nn

from ..comm.replica import Replication, SyncMaster, run_replicas_in_threads

__all__ = [
    "CallbackContext",
    "DataParallelWithCallback",
    "execute_replication_callbacks",
    "patch_replication_callback",
]


class CallbackContext:
    """Shared by the replicas of one submodule in a replication (e.g. holds its SyncMaster); ``replication`` by every
    context of it, whose exchanges fail together."""

    def __init__(self, replication: Optional[Replication] = None) -> None:
        self.replication = replication


def execute_replication_callbacks(replicas: Sequence[nn.Module]) -> None:
    """Call ``__data_parallel_replicate__(ctx, copy_id)`` on every replica submodule that defines it.

    Submodules at the same position in ``modules()`` order share one :class:`CallbackContext`, so the master (replica 0,
    called first) can leave its :class:`~syncbn_dist.comm.SyncMaster` there for the slaves. On any device and runner, a
    synchronized layer that raises makes every peer of the replication raise ``ReplicaSyncError`` naming it
    ([the DataParallel exchange](../design.md#the-dataparallel-exchange)).

    Args:
        replicas: the replica modules, all structurally identical, replica 0 first.

    Raises:
        ValueError: if the replicas do not have the same number of submodules.
    """
    if not replicas:
        return
    module_lists = [list(replica.modules()) for replica in replicas]
    if len({len(modules) for modules in module_lists}) != 1:
        raise ValueError(
            f"expected structurally identical replicas (got submodule counts {[len(m) for m in module_lists]})"
        )
    replication = Replication()
    contexts = [CallbackContext(replication) for _ in module_lists[0]]
    for copy_id, modules in enumerate(module_lists):
        for ctx, module in zip(contexts, modules):
            if hasattr(module, "__data_parallel_replicate__"):
                module.__data_parallel_replicate__(ctx, copy_id)


def _abort_exchanges(replicas: Sequence[nn.Module], error: BaseException) -> None:
    """Wake every replica blocked in a synchronized layer of this replication with ``error``."""
    for module in replicas[0].modules():
        exchange = module.__dict__.get("_replica_exchange")
        if isinstance(exchange, SyncMaster):
            exchange.abort(error)


class _AbortPeersOnError:
    """Calls a replica; if it raises, aborts the replication's exchanges before re-raising."""

    def __init__(self, replica: nn.Module, replicas: Sequence[nn.Module]) -> None:
        self.replica = replica
        self.replicas = replicas

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.replica(*args, **kwargs)
        except BaseException as error:
            _abort_exchanges(self.replicas, error)
            raise


def _replicate_on_cpu(module: nn.Module, num_replicas: int) -> list[nn.Module]:
    """Shallow replicas of ``module`` that alias its parameters and buffers, as nn.DataParallel's do."""
    originals = list(module.modules())
    index = {id(m): i for i, m in enumerate(originals)}
    replicas = []
    for _ in range(num_replicas):
        copies = [m._replicate_for_data_parallel() for m in originals]
        for original, copy in zip(originals, copies):
            copy._parameters = dict(original._parameters)
            for name, child in original._modules.items():
                copy._modules[name] = None if child is None else copies[index[id(child)]]
        replicas.append(copies[0])
    return replicas


def _scatter(obj: Any, num_chunks: int, dim: int) -> list[Any]:
    """Split tensors along ``dim`` as nn.DataParallel's scatter does, repeating other leaves (fewer parts if small)."""
    if isinstance(obj, Tensor):
        return list(obj.chunk(num_chunks, dim))
    if isinstance(obj, (list, tuple)) and obj:
        parts = [_scatter(item, num_chunks, dim) for item in obj]
        count = min(len(p) for p in parts)
        if hasattr(obj, "_fields"):  # namedtuple
            return [type(obj)(*(p[i] for p in parts)) for i in range(count)]
        return [type(obj)(p[i] for p in parts) for i in range(count)]
    if isinstance(obj, dict) and obj:
        parts = {key: _scatter(value, num_chunks, dim) for key, value in obj.items()}
        count = min(len(p) for p in parts.values())
        return [type(obj)((key, p[i]) for key, p in parts.items()) for i in range(count)]
    return [obj] * num_chunks


def _gather(outputs: Sequence[Any], dim: int) -> Any:
    """Concatenate replica outputs along ``dim`` (recursively through tuples, lists and dicts)."""
    first = outputs[0]
    if isinstance(first, Tensor):
        if all(output.dim() == 0 for output in outputs):
            # Scalars (e.g. a per-replica loss) become a vector, as nn.DataParallel's gather makes them.
            return torch.stack(list(outputs))
        return torch.cat(list(outputs), dim)
    if first is None:
        return None
    if isinstance(first, dict):
        return type(first)((key, _gather([o[key] for o in outputs], dim)) for key in first)
    if isinstance(first, (list, tuple)):
        gathered = [_gather(parts, dim) for parts in zip(*outputs)]
        return type(first)(*gathered) if hasattr(first, "_fields") else type(first)(gathered)
    return first


def _refuse_functorch_transforms(inputs: Any, kwargs: Any) -> None:
    """Raise ``RuntimeError`` for inputs of a ``torch.func`` transform, whose per-thread state replica threads drop."""
    leaves = torch.utils._pytree.tree_leaves((inputs, kwargs))
    if any(isinstance(leaf, Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(leaf) for leaf in leaves):
        raise RuntimeError(
            "DataParallel replicas run in threads outside torch.func transforms (jvp, grad, vjp, vmap), which would "
            "drop their tangents and gradients: use torch.autograd.grad or torch.autograd.forward_ad with "
            "DataParallel, or a torch.distributed process group with torch.func"
        )


class DataParallelWithCallback(nn.DataParallel):
    """``nn.DataParallel`` whose replicate step runs the replication callbacks.

    Synchronized layers build their in-process exchange there, so their statistics cover the call's whole batch (and
    every process's, under ``torch.distributed``); a replica that raises wakes its peers.

    Args:
        module: the module to parallelize.
        device_ids: CUDA devices. Default: all visible devices.
        output_device: where outputs are gathered. Default: ``device_ids[0]``.
        dim: the batch dimension to scatter along. Default: 0
        cpu_replicas: run this many replicas of a CPU module in threads instead of on CUDA devices, to test
            DataParallel training code without a GPU, not for speed. Default: ``None``

    Raises:
        ValueError: if ``cpu_replicas`` is not a positive integer.

    Examples::

        >>> model = DataParallelWithCallback(convert_model(net), device_ids=[0, 1])
        >>> model = DataParallelWithCallback(convert_model(net), cpu_replicas=2)  # no GPU needed
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Optional[Sequence[Any]] = None,
        output_device: Optional[Any] = None,
        dim: int = 0,
        cpu_replicas: Optional[int] = None,
    ) -> None:
        if cpu_replicas is not None and (
            not isinstance(cpu_replicas, int) or isinstance(cpu_replicas, bool) or cpu_replicas < 1
        ):
            raise ValueError(f"expected cpu_replicas to be a positive integer (got {cpu_replicas!r})")
        if cpu_replicas is None:
            super().__init__(module, device_ids, output_device, dim)
        else:
            # Skip nn.DataParallel's CUDA set-up: with one visible GPU it would move the module there.
            nn.Module.__init__(self)
            self.module = module
            self.device_ids = []
        self.dim = dim
        self.cpu_replicas = cpu_replicas

    def replicate(self, module: nn.Module, device_ids: Sequence[Any]) -> list[nn.Module]:
        replicas = super().replicate(module, device_ids)
        execute_replication_callbacks(replicas)
        return replicas

    def parallel_apply(self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        return super().parallel_apply([_AbortPeersOnError(r, replicas) for r in replicas], inputs, kwargs)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Scatter, run the replicas (threads), gather.

        Raises:
            RuntimeError: inside a ``torch.func`` transform (jvp, grad, vjp, vmap), whose state replica threads drop.
            ValueError: with ``cpu_replicas``, for a module with a parameter or buffer off the CPU.
        """
        _refuse_functorch_transforms(inputs, kwargs)
        if self.cpu_replicas is None:
            return super().forward(*inputs, **kwargs)
        return self._forward_cpu_replicas(inputs, kwargs)

    def _forward_cpu_replicas(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        for tensor in list(self.module.parameters()) + list(self.module.buffers()):
            if tensor.device.type != "cpu":
                raise ValueError(f"cpu_replicas needs a module on the CPU (found a tensor on {tensor.device})")
        scattered_inputs = _scatter(inputs, self.cpu_replicas, self.dim)
        scattered_kwargs = _scatter(kwargs, self.cpu_replicas, self.dim) if kwargs else []
        num = len(scattered_inputs) if not kwargs else min(len(scattered_inputs), len(scattered_kwargs))
        if num == 0:
            return self.module(*inputs, **kwargs)
        scattered_kwargs = scattered_kwargs[:num] if kwargs else [{}] * num
        replicas = _replicate_on_cpu(self.module, num)
        execute_replication_callbacks(replicas)
        outputs = run_replicas_in_threads(
            replicas, scattered_inputs[:num], scattered_kwargs, functools.partial(_abort_exchanges, replicas)
        )
        return _gather(outputs, self.dim)


def patch_replication_callback(data_parallel: nn.DataParallel) -> None:
    """Make an existing ``nn.DataParallel`` behave as :class:`DataParallelWithCallback`, in place; a no-op if it does.

    Args:
        data_parallel: the instance to patch.

    Raises:
        TypeError: if ``data_parallel`` is not an ``nn.DataParallel``.

    Examples::

        >>> model = nn.DataParallel(convert_model(net), device_ids=[0, 1])
        >>> patch_replication_callback(model)
    """
    if not isinstance(data_parallel, nn.DataParallel):
        raise TypeError(f"expected an nn.DataParallel (got {type(data_parallel).__name__})")
    if isinstance(data_parallel, DataParallelWithCallback) or getattr(data_parallel, "_replication_patched", False):
        return  # already runs the callbacks; running them twice would register every slave twice
    data_parallel._replication_patched = True
    old_replicate = data_parallel.replicate
    old_parallel_apply = data_parallel.parallel_apply

    @functools.wraps(old_replicate)
    def new_replicate(module: nn.Module, device_ids: Sequence[Any]) -> list[nn.Module]:
        replicas = old_replicate(module, device_ids)
        execute_replication_callbacks(replicas)
        return replicas

    @functools.wraps(old_parallel_apply)
    def new_parallel_apply(replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        _refuse_functorch_transforms(inputs, kwargs)
        return old_parallel_apply([_AbortPeersOnError(r, replicas) for r in replicas], inputs, kwargs)

    data_parallel.replicate = new_replicate
    data_parallel.parallel_apply = new_parallel_apply
