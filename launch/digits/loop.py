"""The training loop of the digits job: steps from a resumable position, evaluation, and the cross-rank check."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import sys
from dataclasses import dataclass
from typing import Any, Callable, TextIO

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.join import Join
from torch.utils.data import DataLoader
from tqdm import tqdm

import syncbn_dist
from launch.digits.model import bn_transports
from launch.digits.runtime import Runtime
from launch.digits.stop import StopRequest


def _sum_over_ranks(values: list[float], runtime: Runtime) -> list[float]:
    totals = torch.tensor(values, dtype=torch.float64, device=runtime.device)
    if runtime.world_size > 1:
        dist.all_reduce(totals)
    return totals.tolist()


@dataclass
class EpochProgress:
    """This rank's position in the epoch in progress and its running sums (what a mid-epoch resume needs)."""

    step: int = 0  # completed steps of this epoch
    loss_sum: float = 0.0
    correct: int = 0
    count: int = 0


def sgd_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, images: Tensor, labels: Tensor
) -> tuple[Tensor, Tensor]:
    """One optimizer step on the cross-entropy of ``model(images)``; the logits (N, classes) and the mean loss,
    both detached."""
    logits = model(images)
    loss = nn.functional.cross_entropy(logits, labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return logits.detach(), loss.detach()


def train_steps(
    model: nn.Module,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    runtime: Runtime,
    progress: EpochProgress,
    stop: StopRequest | None = None,
    desc: str = "",
    progress_bar: bool | str = False,
    checkpoint_every: int = 0,
    checkpoint: Callable[[], None] | None = None,
    steps: int | None = None,
    uneven: bool = False,
) -> int:
    """Run the epoch's steps from ``progress.step`` on, updating ``progress`` after each.

    Before every step (the first included) all ranks agree whether to stop; the batches already done are
    skipped (the sampler's order is fixed for the epoch), so the sums continue exactly where they stopped.
    With ``checkpoint_every`` > 0, ``checkpoint()`` runs on every rank after each ``checkpoint_every``-th step of
    the epoch but its last (the epoch's own checkpoint follows that). ``progress_bar``: see :func:`show_progress_bar`.

    ``steps``: this rank's steps in the epoch (default ``len(loader)``). ``uneven`` (the same on every rank: ranks
    may run different numbers of steps) runs them under torch's ``Join`` with the model, its synchronized layers
    (:func:`syncbn_dist.join_layers`) and ``stop``'s agreement as joinables, so the ranks that are done shadow the
    collectives of those still training.

    Returns:
        0 when the epoch is complete, else the number of the signal that stopped it.
    """
    model.train()
    steps = len(loader) if steps is None else steps
    batches = itertools.islice(loader, progress.step, steps)
    show = runtime.is_main and show_progress_bar(progress_bar)
    bar = tqdm(batches, desc=desc, total=steps, initial=progress.step, leave=False, disable=not show)
    with _uneven_join(model, stop, runtime, uneven):
        return _run_steps(model, bar, optimizer, runtime, progress, stop, checkpoint_every, checkpoint, len(loader))


def _uneven_join(model: nn.Module, stop: StopRequest | None, runtime: Runtime, uneven: bool) -> Any:
    """torch's ``Join`` over the stop agreement (first: it notifies before its collective), the DDP model and its
    synchronized layers; a no-op context for even shards."""
    if not uneven or runtime.world_size == 1:
        return contextlib.nullcontext()
    joinables: list[Any] = [] if stop is None else [stop]
    joinables.append(model)
    if any(isinstance(m, syncbn_dist.SyncBatchNorm) for m in model.modules()):
        joinables.append(syncbn_dist.join_layers(model))
    return Join(joinables)


def _run_steps(
    model: nn.Module,
    bar: Any,
    optimizer: torch.optim.Optimizer,
    runtime: Runtime,
    progress: EpochProgress,
    stop: StopRequest | None,
    checkpoint_every: int,
    checkpoint: Callable[[], None] | None,
    epoch_steps: int,
) -> int:
    for images, labels in bar:
        signum = stop.agreed(runtime) if stop is not None else 0
        if signum:
            bar.close()
            return signum
        images, labels = images.to(runtime.device), labels.to(runtime.device)
        logits, loss = sgd_step(model, optimizer, images, labels)
        progress.loss_sum += loss.item() * len(labels)
        progress.correct += (logits.argmax(1) == labels).sum().item()
        progress.count += len(labels)
        progress.step += 1
        bar.set_postfix(loss=f"{loss.item():.4f}")
        if checkpoint is not None and checkpoint_every and progress.step % checkpoint_every == 0:
            if progress.step < epoch_steps:
                checkpoint()
    return 0


def show_progress_bar(setting: bool | str, stream: TextIO | None = None) -> bool:
    """Whether to draw tqdm's bar (on ``stream``, default stderr, where tqdm writes): ``True``, ``False``, or
    ``"auto"``: only when ``stream`` is a terminal. Redirected to a file, each redraw would be a line of the log."""
    if setting == "auto":
        stream = sys.stderr if stream is None else stream
        return bool(getattr(stream, "isatty", lambda: False)())
    return bool(setting)


def epoch_means(progress: EpochProgress, runtime: Runtime) -> tuple[float, float]:
    """The epoch's mean loss and accuracy over all ranks' samples (a collective)."""
    loss_sum, correct, count = _sum_over_ranks([progress.loss_sum, progress.correct, progress.count], runtime)
    return loss_sum / count, correct / count


@torch.no_grad()
def evaluate(net: nn.Module, loader: DataLoader, device: torch.device) -> float:
    """Accuracy of the bare model in eval mode on the whole test set.

    Every rank evaluates the full (small) test set itself: eval-mode BatchNorm uses the running
    statistics and never communicates, the ranks hold identical models so they agree, and no rank
    idles in a collective waiting for rank 0 to finish evaluating.
    """
    net.eval()
    correct, count = 0, 0
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        correct += (net(images).argmax(1) == labels).sum().item()
        count += len(labels)
    assert all(t == "local" for t in bn_transports(net)), "eval-mode BatchNorm must not communicate"
    return correct / count


def _sha256(flat: Tensor) -> str:
    return hashlib.sha256(flat.cpu().numpy().tobytes()).hexdigest()


def check_same_on_all_ranks(net: nn.Module) -> list[str]:
    """All-gather every parameter and buffer (running statistics included) and compare them across ranks.

    Returns:
        Every rank's state digest, in rank order: the SHA-256 of its state_dict as one float64 vector
        (one digest without a process group). Equal digests mean bit-identical states.

    Raises:
        RuntimeError: on every rank, naming the tensors that differ from rank 0's, if any do.
    """
    state = net.state_dict()
    # float64 holds float32 values and step counts exactly, so the comparison below is bit-for-bit.
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in state.values()])
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [_sha256(flat)]
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    sizes = [t.numel() for t in state.values()]
    differing = []
    for rank, other in enumerate(gathered[1:], start=1):
        for name, mine, theirs in zip(state, gathered[0].split(sizes), other.split(sizes)):
            if not torch.equal(mine, theirs):
                gap = (mine - theirs).abs().max().item()
                differing.append(f"{name} (rank {rank}, max abs difference {gap:.3g})")
    if differing:
        raise RuntimeError(
            f"model state differs across ranks; {len(differing)} tensor(s) differ from rank 0's: "
            + ", ".join(differing[:8])
            + (" ..." if len(differing) > 8 else "")
        )
    return [_sha256(other) for other in gathered]
