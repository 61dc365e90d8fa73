"""Every synchronized collective checks itself: ranks that part at any step raise on every rank, never mix statistics.

syncbn_dist.comm.tags: each payload carries ``[1, f, f**2, g, g**2]`` of its layer and direction, and every member
tests the sums. The unit tests hold the arithmetic (exact, and passing exactly when every member sent one tag); the
gloo tests run the three ways ranks part that silently mixed statistics before (two heads at a first call, a
data-dependent branch at a later step, an extra forward under ``no_grad`` on one rank), each beside a run where the
ranks agree, which must stay exact against float64 BatchNorm on the global batch: eagerly at world sizes 2 and 3,
compiled (aot_eager and inductor), with DataParallel replicas inside 2 processes, and under ``Join`` after a rank has
joined. In every case every rank raises LayerMismatchError naming its own layer and direction, and nobody is left
inside a collective.
"""

from __future__ import annotations

import copy
import random
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from closeness import assert_close
from torch import Tensor, nn
from torch.distributed.algorithms.join import Join

import syncbn_dist
from launch.common.spawn import run_distributed
from syncbn_dist import DataParallelWithCallback, LayerMismatchError
from syncbn_dist.comm.tags import TAG_SIZE, CollectiveTag, layer_tags, summed_tags_agree, tag_for

C = 3
CASES = ["first call", "later branch", "no_grad pass"]

# ---------------------------------------------------------------------------------------------------------------
# The arithmetic
# ---------------------------------------------------------------------------------------------------------------


def _summed(tags: list[CollectiveTag]) -> Tensor:
    """The float64 sum of the members' tags, as an all_reduce gives it."""
    return torch.stack([torch.tensor(t.values, dtype=torch.float64) for t in tags]).sum(0)


def _passes(tag: CollectiveTag, summed: Tensor) -> bool:
    try:
        tag.verify(summed)
    except LayerMismatchError:
        return False
    return True


def test_tags_are_small_integers_that_tell_layers_and_directions_apart() -> None:
    forward, backward = layer_tags("layer1.0.bn1", "layer 'layer1.0.bn1'")
    other = tag_for("layer1.0.bn2", "forward", "layer 'layer1.0.bn2'")
    no_grad = tag_for("layer1.0.bn1", "forward without backward", "layer 'layer1.0.bn1'")
    values = {t.values for t in (forward, backward, other, no_grad)}
    assert len(values) == 4
    for one, f, f_square, g, g_square in values:
        assert one == 1.0 and f_square == f * f and g_square == g * g
        assert all(v == int(v) and 0 <= v < 2**16 for v in (f, g))
    # The same identity and direction give the same object (every layer of every rank hashes alike).
    assert tag_for("layer1.0.bn1", "forward", "anything") is forward


def test_the_check_passes_exactly_when_every_member_sent_the_same_tag() -> None:
    rng = random.Random(0)
    tags = [tag_for(f"layer{i}", direction, "") for i in range(12) for direction in ("forward", "backward")]
    for _ in range(400):
        members = rng.randint(1, 9)
        chosen = [rng.choice(tags) for _ in range(members)]
        agree = all(t is chosen[0] for t in chosen)
        summed = _summed(chosen)
        assert _passes(chosen[0], summed) == agree
        assert all(_passes(t, summed) == agree for t in chosen)  # every member reaches the same verdict
        assert summed_tags_agree(summed.tolist()) == agree  # and so does a joined rank that sent nothing
    # A joined rank's zeros change nothing.
    tag = tags[0]
    assert _passes(tag, torch.cat([_summed([tag, tag]) + torch.zeros(TAG_SIZE, dtype=torch.float64)]))


def test_the_check_is_exact_at_two_million_members_with_the_largest_tags() -> None:
    """2**21 members of the largest values the hash gives (f = g = 2**16 - 1): every sum and product is an integer
    below 2**53, so a single member at another collective (f - 1) is still seen."""
    members = 2**21
    big = CollectiveTag("any layer", "forward", "layer 'any'", -1)
    big.values = (1.0, 65535.0, 65535.0**2, 65535.0, 65535.0**2)  # the largest 16-bit hashes
    one_off = (1.0, 65534.0, 65534.0**2, 65535.0, 65535.0**2)
    agreeing = torch.tensor(big.values, dtype=torch.float64) * members
    assert agreeing.max().item() < 2**53
    assert _passes(big, agreeing)
    parted = agreeing - torch.tensor(big.values, dtype=torch.float64) + torch.tensor(one_off, dtype=torch.float64)
    assert not _passes(big, parted)
    assert not summed_tags_agree(parted.tolist())


# ---------------------------------------------------------------------------------------------------------------
# Ranks that part, over gloo
# ---------------------------------------------------------------------------------------------------------------


# How a model's synchronized layers are built, and the class errors name them by: by convert_model, directly in the
# model's __init__ (as norm_layer= constructors do), or as torch's own class under syncbn_dist's patch (as frameworks
# and ``python -m syncbn_dist.run`` build them).
BUILDS = {
    "convert_model": "SynchronizedBatchNorm1d",
    "directly": "SynchronizedBatchNorm1d",
    "torch's class": "SyncBatchNorm",
}


class _Heads(nn.Module):
    """Two synchronized heads of the same width, as a multi-task model: ``forward(x, head)`` runs one."""

    def __init__(self, group: Optional[Any] = None, built: str = "convert_model") -> None:
        super().__init__()
        torch.manual_seed(0)
        if built == "convert_model":
            self.heads = nn.ModuleDict({"a": nn.BatchNorm1d(C), "b": nn.BatchNorm1d(C)})
            syncbn_dist.convert_model(self, process_group=group)
        else:
            synchronized = syncbn_dist.SynchronizedBatchNorm1d if built == "directly" else nn.SyncBatchNorm
            self.heads = nn.ModuleDict({name: synchronized(C, process_group=group) for name in ("a", "b")})
        self.double()

    def forward(self, x: Tensor, head: str) -> Tensor:
        return self.heads[head](x)


def _shard(rank: int, step: int, head: str) -> tuple[Tensor, Tensor]:
    """Rank ``rank``'s input and output gradient at ``step`` for ``head``: uneven shard sizes, float64."""
    generator = torch.Generator().manual_seed(1000 * step + 10 * rank + (head == "b"))
    n = 2 + (rank + step) % 3
    x = torch.randn(n, C, generator=generator, dtype=torch.float64) * 2.0 + 3.0
    return x, torch.randn(n, C, generator=generator, dtype=torch.float64)


def _agreeing_steps(model: nn.Module, run: Any, rank: int, world_size: int, steps: int) -> None:
    """``steps`` steps of both heads on every rank, each equal to float64 nn.BatchNorm on the global batch (outputs,
    input and parameter gradients, running statistics, num_batches_tracked)."""
    reference = {name: nn.BatchNorm1d(C).double() for name in ("a", "b")}
    for name, layer in reference.items():
        layer.load_state_dict(model.heads[name].state_dict())
    for step in range(steps):
        for name in ("a", "b"):
            head = model.heads[name]
            head.zero_grad(set_to_none=True)
            x, dy = _shard(rank, step, name)
            x.requires_grad_()
            y = run(x, name)
            y.backward(dy)
            shards = [_shard(r, step, name) for r in range(world_size)]
            x_all = torch.cat([s[0] for s in shards]).requires_grad_()
            ref = reference[name]
            ref.zero_grad(set_to_none=True)
            y_all = ref(x_all)
            y_all.backward(torch.cat([s[1] for s in shards]))
            rows = slice(sum(s[0].size(0) for s in shards[:rank]), None)
            what = f"agreeing step {step}, head {name}"
            # float64 throughout: float64 rounding of O(1) values.
            assert_close(y.detach(), y_all[rows][: x.size(0)].detach(), f"{what}: output", rtol=1e-10, atol=1e-10)
            assert_close(x.grad, x_all.grad[rows][: x.size(0)], f"{what}: grad_input", rtol=1e-10, atol=1e-10)
            grads = torch.cat([head.weight.grad, head.bias.grad])
            dist.all_reduce(grads)  # parameter gradients stay local (DDP would average them)
            expected = torch.cat([ref.weight.grad, ref.bias.grad])
            assert_close(grads, expected, f"{what}: parameter gradients", rtol=1e-10, atol=1e-10)
            for key, value in ref.state_dict().items():
                assert_close(head.state_dict()[key], value, f"{what}: {key}", rtol=1e-10, atol=1e-10)


def _parting_step(run: Any, rank: int, case: str) -> None:
    """The step where rank 0 parts from the others: its own head (first call or later branch), or an extra forward
    of head a under no_grad while the others train head a."""
    if case == "no_grad pass" and rank == 0:
        with torch.no_grad():
            run(_shard(rank, 9, "a")[0], "a")
        return
    head = "a" if rank == 0 or case == "no_grad pass" else "b"
    x, dy = _shard(rank, 9, head)
    run(x.requires_grad_(), head).backward(dy)


def _mismatch(error: BaseException) -> Optional[str]:
    """The text of the LayerMismatchError in ``error``'s chain (compiled graphs wrap it), or None."""
    seen = []
    while error is not None and error not in seen:
        if isinstance(error, LayerMismatchError):
            return str(error)
        seen.append(error)
        error = error.__cause__ or error.__context__
    return None


def _expect_mismatch(fn: Any) -> str:
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the chain is inspected
        text = _mismatch(error)
        if text is None:
            raise
        return text
    raise AssertionError("the ranks parted and nothing was raised")


def _own(rank: int, case: str, built: str = "convert_model") -> tuple[str, str]:
    """The layer and direction rank ``rank`` was at when the ranks parted."""
    head = "a" if rank == 0 or case == "no_grad pass" else "b"
    direction = "forward without backward" if case == "no_grad pass" and rank == 0 else "forward"
    return f"layer 'heads.{head}' ({BUILDS[built]})", direction


def _case(rank: int, world_size: int, case: str, backend: Optional[str], built: str = "convert_model") -> str:
    """One case on a new process group (a first step of its own): the agreeing steps, then the parting one."""
    group = dist.new_group(list(range(world_size)))
    model = _Heads(group, built)
    run = model if backend is None else torch.compile(model, backend=backend)
    if case != "first call":
        _agreeing_steps(model, run, rank, world_size, 2)
    message = _expect_mismatch(lambda: _parting_step(run, rank, case))
    dist.barrier()  # nobody is left inside a collective
    return message


def _check(messages: list[str], case: str, built: str = "convert_model") -> None:
    for rank, message in enumerate(messages):
        layer, direction = _own(rank, case, built)
        assert layer in message and direction in message, f"rank {rank} ({case}): {message}"


def _worker_eager(rank: int, world_size: int) -> list[str]:
    return [_case(rank, world_size, case, None) for case in CASES]


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_that_part_raise_on_every_rank(world_size: int) -> None:
    results = run_distributed(_worker_eager, world_size, timeout=120, collective_timeout=20)
    for i, case in enumerate(CASES):
        _check([result[i] for result in results], case)
    # At the first call the group's first-step gather names every rank's layer; later, the tag's own gather does.
    for result in results:
        assert "rank 0: layer 'heads.a'" in result[0] and "rank 1: layer 'heads.b'" in result[0], result[0]
        assert "rank 0: layer 'heads.a'" in result[1] and "rank 1: layer 'heads.b'" in result[1], result[1]


def _worker_builds(rank: int, world_size: int) -> dict[str, list[str]]:
    messages = {}
    for built in BUILDS:
        if built == "torch's class":
            syncbn_dist.patch_torch_sync_batchnorm()
        try:
            messages[built] = [_case(rank, world_size, case, None, built) for case in CASES]
        finally:
            syncbn_dist.unpatch_torch_sync_batchnorm()
    return messages


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_that_part_raise_on_every_rank_whoever_built_the_layers(world_size: int) -> None:
    """A layer is named by its place in the model, whoever built it: two heads of one width built directly (or as
    torch's class under the patch) are told apart at their first call and later. Before, they were named by class and
    width alone, and the later branch mixed both heads' statistics with no error."""
    results = run_distributed(_worker_builds, world_size, timeout=200, collective_timeout=20)
    for built in BUILDS:
        for i, case in enumerate(CASES):
            _check([result[built][i] for result in results], case, built)


def _gan(group: Any) -> tuple[nn.Module, nn.Module]:
    """A generator and a discriminator, each converted on its own: both have a synchronized layer named '1'."""
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(C, C), nn.BatchNorm1d(C), nn.ReLU())
    discriminator = nn.Sequential(nn.Linear(C, C), nn.BatchNorm1d(C), nn.LeakyReLU(0.2), nn.Linear(C, 1))
    return tuple(syncbn_dist.convert_model(m, process_group=group).double() for m in (generator, discriminator))


def _worker_two_models(rank: int, world_size: int) -> list[str]:
    """Rank 0 trains the generator's layer '1' where the others train the discriminator's: at the group's first call,
    and after a step that trains both on every rank."""
    messages = []
    for agreeing_steps in (0, 1):
        generator, discriminator = _gan(dist.new_group(list(range(world_size))))
        for step in range(agreeing_steps):
            for model in (generator, discriminator):
                model(_shard(rank, step, "a")[0]).sum().backward()
        model = generator if rank == 0 else discriminator
        messages.append(_expect_mismatch(lambda: model(_shard(rank, 9, "a")[0]).sum().backward()))  # noqa: B023
        dist.barrier()
    return messages


@pytest.mark.distributed
def test_two_models_converted_separately_are_told_apart() -> None:
    """Two models whose layers share a qualified name ('1') but whose structures differ: a layer's identity holds its
    model's structure. Before, rank 0 at the generator's layer and rank 1 at the discriminator's mixed statistics."""
    for messages in run_distributed(_worker_two_models, 2, timeout=120, collective_timeout=20):
        for message in messages:
            assert "rank 0: layer '1'" in message and "rank 1: layer '1'" in message, message


def _worker_extra_models(rank: int, world_size: int) -> None:
    """Rank 0 builds more models than the others before the one they train, and in another order (a deep copy, a
    model of another structure), and wraps the trained one in torch.compile for a validation it never runs: every rank
    names the trained model's layers alike, and the steps are exact."""
    for built in BUILDS:
        if built == "torch's class":
            syncbn_dist.patch_torch_sync_batchnorm()
        try:
            group = dist.new_group(list(range(world_size)))
            extra = []
            if rank == 0:
                extra = [_gan(group), _Heads(group, built)]
                extra.append(copy.deepcopy(extra[0][0]))
            model = _Heads(group, built)
            if rank == 0:
                extra.append(torch.compile(model))
            _agreeing_steps(model, model, rank, world_size, 2)
        finally:
            syncbn_dist.unpatch_torch_sync_batchnorm()


@pytest.mark.distributed
def test_a_rank_that_builds_more_models_first_trains_exactly() -> None:
    run_distributed(_worker_extra_models, 2, timeout=120, collective_timeout=20)


def _worker_hybrid(rank: int, world_size: int) -> list[str]:
    """Rank 0 runs the model in two DataParallel replicas, rank 1 runs it directly: at the group's first call, and
    after steps where both ran replicas."""
    messages = []
    for agreeing_steps in (0, 2):
        model = _Heads(dist.new_group(list(range(world_size))))
        replicas = DataParallelWithCallback(model, cpu_replicas=2)
        for step in range(agreeing_steps):  # (tests/test_replicate.py: exact)
            x, dy = _shard(rank, step, "a")
            replicas(x.requires_grad_(), "a").backward(dy)
        run = replicas if rank == 0 else model
        x, dy = _shard(rank, 9, "a")
        messages.append(_expect_mismatch(lambda: run(x.requires_grad_(), "a").backward(dy)))  # noqa: B023
        dist.barrier()
    return messages


@pytest.mark.distributed
def test_a_process_with_replicas_beside_one_without_raises_on_every_rank() -> None:
    """The replica exchange sums the gradients of the totals, the process group the layer's backward payload: their
    collectives' tags name the exchange, so they never pass for each other. Before, both ranks trained on with input
    gradients off by up to 30 and no error."""
    for rank, messages in enumerate(run_distributed(_worker_hybrid, 2, timeout=120, collective_timeout=20)):
        for message in messages:
            assert "rank 0: layer 'heads.a' (SynchronizedBatchNorm1d): " in message, f"rank {rank}: {message}"
            assert "forward through the replica exchange" in message, f"rank {rank}: {message}"
            assert "Run replicas on every process or on none" in message, f"rank {rank}: {message}"


def _worker_compiled(rank: int, world_size: int, backend: str) -> list[str]:
    torch._dynamo.reset()
    return [_case(rank, world_size, case, backend) for case in CASES]


@pytest.mark.distributed
@pytest.mark.parametrize(
    "backend",
    [
        "aot_eager",
        pytest.param("inductor", marks=[pytest.mark.slow, pytest.mark.over_budget("inductor compiles 12 graphs")]),
    ],
)
def test_ranks_that_part_raise_on_every_rank_under_compile(backend: str) -> None:
    """The layer traced into a user's graph: a first compilation checks while Dynamo traces; later steps check the
    tags inside the graph (the custom op syncbn_dist::tag_checked), a recompilation under no_grad included.

    Inductor compiles each head's forward and backward for the agreeing steps of two cases and the no_grad forward,
    about 12 graphs from a cold cache."""
    results = run_distributed(_worker_compiled, 2, backend, timeout=280, collective_timeout=60)
    for i, case in enumerate(CASES):
        _check([result[i] for result in results], case)
    # The graph's check gathers every member's record as eager mode's does (a member whose layer fell back to eager
    # and one whose layer runs compiled run the same collectives on a mismatch): each names both ranks' layers.
    for result in results:
        assert "rank 0: layer 'heads.a'" in result[1] and "rank 1: layer 'heads.b'" in result[1], result[1]


def _worker_replicas(rank: int, world_size: int) -> list[str]:
    messages = []
    for case in CASES:
        group = dist.new_group(list(range(world_size)))
        model = _Heads(group)
        replicas = DataParallelWithCallback(model, cpu_replicas=2)
        if case != "first call":  # both heads on both replicas of both processes (tests/test_replicate.py: exact)
            for step in range(2):
                for head in ("a", "b"):
                    x, dy = _shard(rank, step, head)
                    replicas(x.requires_grad_(), head).backward(dy)
        messages.append(_expect_mismatch(lambda: _parting_step(replicas, rank, case)))  # noqa: B023
        dist.barrier()
    return messages


@pytest.mark.distributed
def test_ranks_that_part_raise_with_dataparallel_replicas_inside_each_process() -> None:
    results = run_distributed(_worker_replicas, 2, timeout=120, collective_timeout=20)
    for i, case in enumerate(CASES):
        _check([result[i] for result in results], case)


def _join_epoch(model: nn.Module, joinable: Any, rank: int, case: str) -> None:
    with Join([joinable]):
        if rank == 2:
            return
        for step in range(2 if case != "first call" else 0):
            for head in ("a", "b"):
                x, dy = _shard(rank, step, head)
                model(x.requires_grad_(), head).backward(dy)
        _parting_step(model, rank, case)


def _worker_join(rank: int, world_size: int) -> list[Optional[str]]:
    """World of 3: rank 2 has no batch and joins at once; ranks 0 and 1 run two agreeing steps under Join, then
    part. The joined rank's listener sees the disagreement too (controls or tags) and raises it when the Join ends."""
    messages: list[Optional[str]] = []
    for case in CASES:
        group = dist.new_group(list(range(world_size)))
        model = _Heads(group)
        joinable = syncbn_dist.join_layers(model, group)
        messages.append(_expect_mismatch(lambda: _join_epoch(model, joinable, rank, case)))  # noqa: B023
        dist.barrier()
    return messages


@pytest.mark.distributed
def test_ranks_that_part_under_join_raise_on_every_rank_the_joined_one_included() -> None:
    results = run_distributed(_worker_join, 3, timeout=200, collective_timeout=20)
    for i, case in enumerate(CASES):
        _check([result[i] for result in results[:2]], case)
        assert "under Join" in results[2][i] or "disagree" in results[2][i], results[2][i]


# ---------------------------------------------------------------------------------------------------------------
# After a caught mismatch: every buffer as it was before the failed call, on every rank
# ---------------------------------------------------------------------------------------------------------------

# Which check stops the failed call: the first-step gather (other heads, or a peer's bad input: that rank raises its
# own ValueError), the tag of a later step's collective (other heads, a forward under no_grad), debug mode's gather.
RECOVERY_CASES = ["first call", "bad input", "later branch", "no_grad pass", "debug"]
BEFORE, AFTER = 2, 2  # agreeing steps before the failed call (none for a first call) and after it


def _steps_before(case: str) -> list[int]:
    return [] if case in ("first call", "bad input") else list(range(BEFORE))


def _steps_after() -> list[int]:
    return list(range(10, 10 + AFTER))


def _failed_call(model: nn.Module, rank: int, case: str) -> str:
    """The call where rank 0 parts from the others, caught: the error's type."""
    try:
        if case == "bad input" and rank == 0:
            model(torch.randn(4, C + 1, dtype=torch.float64), "a")
        elif case == "bad input":
            model(_shard(rank, 9, "a")[0].requires_grad_(), "a")
        else:
            _parting_step(model, rank, "later branch" if case == "debug" else case)
    except ValueError as error:  # LayerMismatchError, or the bad input's own ValueError
        return type(error).__name__
    raise AssertionError("the ranks parted and nothing was raised")


def _recovery_case(rank: int, world_size: int, case: str, momentum: Optional[float]) -> dict[str, Any]:
    """On a new group: agreeing steps, the failed call, agreeing steps again; each head's buffers at the end."""
    syncbn_dist.set_debug(case == "debug")
    try:
        group = dist.new_group(list(range(world_size)))
        model = _Heads(group)
        for head in model.heads.values():
            head.momentum = momentum
        for step in _steps_before(case):
            for name in ("a", "b"):
                x, dy = _shard(rank, step, name)
                model(x.requires_grad_(), name).backward(dy)
        error = _failed_call(model, rank, case)
        dist.barrier()  # nobody is left inside a collective
        for step in _steps_after():
            for name in ("a", "b"):
                x, dy = _shard(rank, step, name)
                model(x.requires_grad_(), name).backward(dy)
    finally:
        syncbn_dist.set_debug(False)
    buffers = {name: {key: value.clone() for key, value in head.named_buffers()} for name, head in model.heads.items()}
    return {"error": error, "buffers": buffers}


def _worker_recovery(rank: int, world_size: int) -> list[dict[str, Any]]:
    return [_recovery_case(rank, world_size, case, momentum) for case in RECOVERY_CASES for momentum in (0.1, None)]


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_after_a_caught_mismatch_every_buffer_is_as_if_the_failed_call_never_ran(world_size: int) -> None:
    """Rank 0 parts from the others once (first-step gather, tag, debug mode, a bad input), every rank catches the
    error and training goes on: num_batches_tracked equals the number of successful steps on every rank, and the
    running statistics equal float64 nn.BatchNorm over the successful steps' union of batches, with a momentum and
    with the cumulative average (momentum=None), whose factor reads num_batches_tracked."""
    results = run_distributed(_worker_recovery, world_size, timeout=120, collective_timeout=20)
    index = 0
    for case in RECOVERY_CASES:
        for momentum in (0.1, None):
            for rank, result in enumerate(results):
                expected_error = "ValueError" if case == "bad input" and rank == 0 else "LayerMismatchError"
                assert result[index]["error"] == expected_error, (case, rank, result[index]["error"])
            steps = _steps_before(case) + _steps_after()
            for name in ("a", "b"):
                torch.manual_seed(0)
                reference = nn.BatchNorm1d(C, momentum=momentum).double()
                for step in steps:
                    reference(torch.cat([_shard(rank, step, name)[0] for rank in range(world_size)]))
                for rank, result in enumerate(results):
                    got = result[index]["buffers"][name]
                    what = f"{case}, momentum={momentum}, head {name}, rank {rank}"
                    assert int(got["num_batches_tracked"]) == len(steps), f"{what}: {got['num_batches_tracked']}"
                    for key in ("running_mean", "running_var"):
                        # float64 throughout: float64 rounding of O(1) values.
                        assert_close(got[key], getattr(reference, key), f"{what}: {key}", rtol=1e-10, atol=1e-10)
            index += 1


# ---------------------------------------------------------------------------------------------------------------
# Where our collectives meet DDP's, and what no tag can catch (docs/troubleshooting.md, "What is caught, and when")
# ---------------------------------------------------------------------------------------------------------------


def _ddp_model() -> nn.Module:
    torch.manual_seed(0)
    return syncbn_dist.convert_model(nn.Sequential(nn.Linear(4, C), nn.BatchNorm1d(C), nn.Linear(C, 2)))


def _ddp_step(ddp: nn.Module, rank: int, step: int) -> None:
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(100 * step + rank))
    ddp(x).square().sum().backward()


def _worker_logging_pass(rank: int, world_size: int, how: str) -> Optional[str]:
    """Two DDP steps (DDP's defaults: broadcast_buffers=True), then rank 0 runs a logging pass before the third:
    ``how`` is "no_grad" (the DDP model in train mode under no_grad), "grad" (the same with grad enabled) or "eval"
    (the remedy: ``ddp.module`` in eval mode). Returns the error's text, or None when training went on."""
    model = _ddp_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    for step in range(2):
        _ddp_step(ddp, rank, step)
    try:
        if rank == 0:
            x = torch.randn(6, 4)
            if how == "eval":
                ddp.module.eval()
                ddp.module(x)
                ddp.module.train()
            else:
                with torch.set_grad_enabled(how == "grad"):
                    ddp(x)
        for step in range(2, 4):
            _ddp_step(ddp, rank, step)
    except Exception as error:  # noqa: BLE001 - the text is checked by the parent
        return f"{type(error).__name__}: {error}"
    return None


@pytest.mark.distributed
def test_a_logging_pass_under_no_grad_on_one_rank_raises_on_every_rank() -> None:
    for message in run_distributed(_worker_logging_pass, 2, "no_grad", timeout=60, collective_timeout=20):
        assert message is not None and message.startswith("LayerMismatchError"), message
        assert "rank 0: layer '1' (SynchronizedBatchNorm1d): forward without backward" in message, message
        assert "rank 1: layer '1' (SynchronizedBatchNorm1d): forward" in message, message


@pytest.mark.distributed
def test_the_logging_pass_remedy_trains_on() -> None:
    assert run_distributed(_worker_logging_pass, 2, "eval", timeout=60, collective_timeout=20) == [None, None]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_logging_pass_with_grad_on_one_rank_waits_for_the_process_group_timeout() -> None:
    """What no check can catch: the logging forward looks like the next training forward to the other rank (it mixes
    statistics with it), then DDP's buffer broadcast meets the backward's collectives. Both ranks wait for the
    process group's timeout (5 s here; 30 minutes by default on gloo) and raise gloo's timeout error (the second of
    them, "Application timeout caused pair closure" or "Connection closed by peer", when the first closed the
    connection first: which one depends on the timing)."""
    messages = run_distributed(_worker_logging_pass, 2, "grad", timeout=90, collective_timeout=5, fresh=True)
    assert any("Timed out waiting 5000ms" in str(message) for message in messages), messages
    for message in messages:
        assert message is not None and message.startswith("RuntimeError"), message
        closed = "Application timeout" in message or "Connection closed by peer" in message
        assert "Timed out waiting 5000ms" in message or closed, message


def _worker_other_widths_later(rank: int, world_size: int) -> str:
    """Heads of different widths, both run on every rank for one step, then one each: payloads of different sizes,
    which gloo aborts on (the tags never meet). TORCH_DISTRIBUTED_DEBUG=DETAIL (torch's wrapper of a group created
    under it) names the shapes at that collective, on every rank."""
    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        group = dist.new_group(list(range(world_size)))
    finally:
        dist.set_debug_level(level)
    heads = syncbn_dist.convert_model(nn.ModuleDict({"a": nn.BatchNorm1d(3), "b": nn.BatchNorm1d(5)}), group)
    for name in ("a", "b"):
        heads[name](torch.randn(4, heads[name].num_features, requires_grad=True)).sum().backward()
    name = "a" if rank == 0 else "b"
    try:
        heads[name](torch.randn(4, heads[name].num_features))
    except RuntimeError as error:
        return str(error)
    raise AssertionError("different payload sizes ran through")


@pytest.mark.distributed
def test_payloads_of_other_sizes_later_are_named_by_torchs_detail_debug_level() -> None:
    for message in run_distributed(_worker_other_widths_later, 2, timeout=60, collective_timeout=20):
        assert "Detected mismatch between collectives on ranks" in message, message
        assert "TensorShape=[12]" in message and "TensorShape=[16]" in message, message
