"""The totals a DataParallel replica's forward exchanged, replayed when activation checkpointing recomputes it.

Each replica records, for every forward call of a synchronized layer, its own payload beside the total the exchange
returned; the recomputation, where no exchange is possible, replays the total recorded with its payload. Why, why
keyed by the payload, and what raises: docs/design.md, "Activation checkpointing".
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import torch
from torch import Tensor
from torch.autograd import Function

from ..comm.tags import TAG_SIZE

__all__ = ["RecordingTransport", "ReplayTransport"]

# Relative difference below which two payloads are the same shard's (float64 sums of float32 values in another
# order differ by about 1e-16 * sqrt(count) relative; distinct activations differ in the leading digits).
_SAME_SHARD_RTOL = 1e-9


class _Record(NamedTuple):
    payload: Tensor
    totals: list[Tensor]


class RecordingTransport:
    """A replica's transport that records the payload and totals of every call, in every grad mode.

    Args:
        transport: the replica's :class:`~syncbn_dist.comm.DataParallelTransport`.
        records: the layer replica's list of records, which :class:`ReplayTransport` reads.
    """

    differentiable_exchange = True
    # Even a lone replica's process group collective takes the exchange's autograd shape (its backward sums the
    # gradients of the totals): its tags say so.
    exchange_name = "replica exchange"

    def __init__(self, transport: Any, records: list[_Record]) -> None:
        self.name = transport.name
        self._transport = transport
        self._records = records

    def all_reduce(self, tensors: Sequence[Tensor], tags: Optional[tuple[Any, Any, bool]] = None) -> list[Tensor]:
        totals = self._transport.all_reduce(tensors, tags=tags)
        self._records.append(_Record(tensors[0].detach(), [total.detach() for total in totals]))
        return totals

    def agreement_group(self) -> Any:
        return self._transport.agreement_group()


class ReplayTransport:
    """The transport of a replica's recomputation: the totals recorded with this call's payload, without talking.

    Args:
        name: the transport name the layer reports (``"dataparallel"``).
        records: the layer replica's records (see :class:`RecordingTransport`).
        description: names the layer and the replica in errors.

    Raises:
        RuntimeError: from ``all_reduce``, if no recorded call had this payload, or several had it with different
            totals; from backward, under ``use_reentrant=True`` checkpointing.
    """

    differentiable_exchange = True
    exchange_name = "replica exchange"

    def __init__(self, name: str, records: list[_Record], description: str) -> None:
        self.name = name
        self._records = records
        self._description = description

    def all_reduce(self, tensors: Sequence[Tensor], tags: Optional[tuple[Any, Any, bool]] = None) -> list[Tensor]:
        payload = tensors[0]
        matches = [record for record in self._records if _same_shard(record.payload, payload.detach())]
        if not matches:
            raise RuntimeError(
                f"activation checkpointing recomputed {self._description} with an input that none of its forward "
                f"calls in this step had ({len(self._records)} recorded): the checkpointed function must recompute "
                "the same activations (keep preserve_rng_state=True for dropout)"
            )
        totals = matches[0].totals
        if any(not all(map(_same_values, totals, other.totals)) for other in matches[1:]):
            raise RuntimeError(
                f"activation checkpointing recomputed {self._description}, which ran {len(matches)} times in this "
                "step on the same shard of this replica while the other replicas' shards differed: the recomputation "
                "cannot tell which call's statistics to replay. Checkpoint those calls in one segment, or train "
                "over torch.distributed processes, whose recomputation runs the collective again"
            )
        # The recorded total's tags were verified when it was summed; it is replayed with this call's own (a reentrant
        # checkpoint's original forward ran under no_grad, with the tag of a forward without backward).
        total = totals[0]
        members = total.narrow(0, total.numel() - TAG_SIZE, 1)
        retagged = torch.cat([total.narrow(0, 0, total.numel() - TAG_SIZE), members * payload.detach()[-TAG_SIZE:]])
        return [_ReplayedTotal.apply(payload, retagged, self._description), *totals[1:]]

    def agreement_group(self) -> None:
        return None


def _same_shard(recorded: Tensor, payload: Tensor) -> bool:
    """Whether two payloads ``[sum (C), sum of squares (C), count, tag]`` are one shard's: equal counts, and sums equal
    up to float64 rounding of the values' magnitude (``sqrt(count * sum of squares)`` bounds ``sum(|x|)``). The tags
    may differ: a reentrant checkpoint's original forward runs under ``no_grad``, its recomputation with grad."""
    if recorded.shape != payload.shape or recorded.device != payload.device:
        return False
    num_features = (payload.numel() - 1 - TAG_SIZE) // 2
    sums, squares, count, _ = payload.split([num_features, num_features, 1, TAG_SIZE])
    recorded_sums, recorded_count, _ = recorded.split([2 * num_features, 1, TAG_SIZE])
    if torch.equal(recorded_sums, payload[: 2 * num_features]) and torch.equal(recorded_count, count):
        return True
    if not torch.equal(recorded_count, count):
        return False
    magnitude = torch.cat([torch.sqrt(count * squares), squares])
    return bool(((recorded_sums - payload[: 2 * num_features]).abs() <= _SAME_SHARD_RTOL * magnitude).all())


def _same_values(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=_SAME_SHARD_RTOL, atol=0.0))


class _ReplayedTotal(Function):
    """``payload -> total`` (a recorded constant) that keeps the payload in the graph, so that a backward through the
    recomputation's own graph (``use_reentrant=True``) raises instead of dropping the statistics' gradient."""

    @staticmethod
    def forward(payload: Tensor, total: Tensor, description: str) -> Tensor:
        return total.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.description = inputs[2]

    @staticmethod
    def backward(ctx: Any, grad_total: Optional[Tensor]) -> tuple[None, None, None]:
        raise RuntimeError(
            f"activation checkpointing with use_reentrant=True recomputed {ctx.description} in a backward of its "
            "own, where the other DataParallel replicas' gradients are out of reach: the global-batch gradient "
            "cannot be formed there. Use torch.utils.checkpoint.checkpoint(..., use_reentrant=False) (torch's "
            "recommended mode), or train over torch.distributed processes"
        )
