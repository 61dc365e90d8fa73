"""The agreement check: every member of a group is at the same synchronized layer, or all of them raise.

Run once per (layer, process group) by default, and before every collective in debug mode.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["LayerMismatchError", "is_debug_enabled", "set_debug", "verify_group_agreement"]

# Debug-mode call numbers per process group (this process's count of synchronized collectives on it).
_DEBUG_CALLS: dict[Any, int] = {}
_DEBUG = os.environ.get("SYNCBN_DEBUG", "0").strip().lower() not in ("", "0", "false", "no", "off")
# Bytes per rank in the debug/handshake record gathered from every member, and its field separator.
_RECORD_BYTES = 256
_SEPARATOR = "\x1f"


def set_debug(enabled: bool) -> None:
    """Turn debug mode on or off for this process (also on with the environment variable ``SYNCBN_DEBUG=1``).

    In debug mode every synchronized collective is preceded by one small ``all_gather`` that checks that
    all members are at the same layer (call number, layer name, num_features, dtype); on a mismatch every
    member raises :class:`LayerMismatchError` naming each rank's layer, instead of hanging or mixing
    statistics. Off by default; when off it costs nothing.
    """
    global _DEBUG
    _DEBUG = bool(enabled)


def is_debug_enabled() -> bool:
    """Whether debug mode is on (see :func:`set_debug`)."""
    return _DEBUG


class LayerMismatchError(ValueError):
    """Members of a synchronization group reached different synchronized layers (raised on every member)."""


def _gather_records(record: str, group: Any) -> list[str]:
    """All-gather one short string per member as a fixed-size byte tensor (one collective)."""
    data = record.encode("utf-8")[:_RECORD_BYTES]
    mine = torch.zeros(_RECORD_BYTES, dtype=torch.uint8)
    mine[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    mine = mine.to(device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return [bytes(t.cpu().tolist()).rstrip(b"\0").decode("utf-8", "replace") for t in gathered]


def _describe_disagreement(records: list[list[str]], group: Any) -> str:
    """One line per member from ``[compared, display]`` records, then which ranks differ from the first."""
    ranks = [dist.get_global_rank(group, i) if group is not None else i for i in range(len(records))]
    lines = [f"  rank {rank}: {record[-1]}" for rank, record in zip(ranks, records)]
    differing = [rank for rank, record in zip(ranks, records) if record[0] != records[0][0]]
    return "\n".join(lines) + f"\nranks {differing} differ from rank {ranks[0]}"


def verify_group_agreement(group: Any, key: str, description: str, verified: set[Any]) -> None:
    """Raise :class:`LayerMismatchError` on every member of ``group`` unless all present the same ``key``.

    Without debug mode the check runs once per (process group, caller): ``verified`` remembers the groups
    already checked, so the steady state costs nothing. In debug mode it runs at every call, prefixed with
    this group's call number, so a member that skipped or reordered a layer is caught at the next call.
    Every member compares the same gathered records (one fixed-size ``all_gather``), so all reach the same
    verdict.

    Args:
        group: the process group, or None for the world group.
        key: what must agree (e.g. num_features and dtype), short text.
        description: names the caller in the error (e.g. the layer's qualified name).
        verified: the caller's record of groups already checked; updated in place.

    Raises:
        LayerMismatchError: on every member, naming each rank's record, if the keys differ.
    """
    group_key = "world" if group is None else id(group)
    if not _DEBUG and group_key in verified:
        return
    display = f"{description}: {key}"
    compared = key
    if _DEBUG:
        # The call number catches a member that skipped or added a layer; the name, one that reordered.
        call = _DEBUG_CALLS.get(group_key, 0) + 1
        _DEBUG_CALLS[group_key] = call
        display = f"call #{call} at {display}"
        compared = display
    records = [r.split(_SEPARATOR, 1) for r in _gather_records(f"{compared}{_SEPARATOR}{display}", group)]
    if any(record[0] != records[0][0] for record in records):
        hint = "" if _DEBUG else " (set SYNCBN_DEBUG=1 to check every call)"
        raise LayerMismatchError(
            "synchronized BatchNorm layers disagree across the members of the process group" + hint + ":\n"
            + _describe_disagreement(records, group)
        )
    verified.add(group_key)



# (layer id, group key) pairs already verified by verify_agreement_while_tracing.
_VERIFIED_WHILE_TRACING: set[tuple[int, Any]] = set()


def verify_agreement_while_tracing(group: Any, key: str, description: str, layer_id: int) -> None:
    """:func:`verify_group_agreement` for code that ``torch.compile`` traces.

    The check runs once per (layer, group), eagerly, while dynamo traces the layer, and is left out of the graph:
    every member traces its first call of a layer at the same point (the graph is compiled on the first call), so
    all of them take part in the gather, and later recompilations (a new batch shape on one rank only) find the
    pair verified and gather nothing. Debug mode's per-call check cannot be traced; debug mode runs the layer
    eagerly.

    Args:
        group: the process group, or None for the world group.
        key: what must agree; description: names the layer in the error.
        layer_id: ``id()`` of the calling layer, which identifies it across recompilations.

    Raises:
        LayerMismatchError: as :func:`verify_group_agreement`, at compile time, on every member.
    """
    _verify_once(group, key, description, layer_id)


@torch._dynamo.assume_constant_result
def _verify_once(group: Any, key: str, description: str, layer_id: int) -> bool:
    # assume_constant_result: dynamo calls this while tracing, with real arguments, and keeps only the result;
    # the registry is plain Python state, which the traced code never sees.
    marker = (layer_id, "world" if group is None else id(group))
    if marker not in _VERIFIED_WHILE_TRACING:
        verify_group_agreement(group, key, description, set())
        _VERIFIED_WHILE_TRACING.add(marker)
    return True
