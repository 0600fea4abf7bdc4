"""Odd but valid input gives the same answer as native all-reduce.

- world size 1 (the hook is a division by one: gradients unchanged);
- empty buckets and buckets with fewer elements than ranks (some chunks are empty);
- NaN and Inf, which must land where ``dist.all_reduce`` puts them (Inf - Inf = NaN too);
- complex buckets (averaged like real ones);
- DDP's ``Join`` with uneven inputs: ranks that ran out of data call the hook with zero
  buckets until the last rank finishes; parameters must match native DDP under ``Join``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_ranks

WORLD_SIZE = 3  # odd, and larger than the smallest buckets below


def _native_average(tensor: torch.Tensor) -> torch.Tensor:
    """What PyTorch's ``allreduce_hook`` returns: divide first, then ``dist.all_reduce``."""
    average = tensor / dist.get_world_size()
    dist.all_reduce(average)
    return average


def _odd_buckets(rank: int) -> dict[str, torch.Tensor]:
    nan, inf = math.nan, math.inf
    non_finite = torch.tensor(
        [
            [nan, 1.0, 2.0, 3.0, 4.0, 2e38],   # NaN on rank 0 only; 3 x 2e38 overflows fp32 ...
            [5.0, inf, 6.0, -inf, 7.0, 2e38],  # +Inf and -Inf
            [8.0, 9.0, -inf, inf, 1.0, 2e38],  # ... but not after dividing first
        ]
    )[rank]
    return {
        "empty": torch.empty(0),
        "one element": torch.tensor([float(rank + 1)]),
        "two elements": torch.tensor([float(rank), -2.0 * rank]),
        "nan and inf": non_finite,
    }


def _try_odd_buckets(rank: int, world_size: int) -> dict:
    from ddp_ring_hooks import HookState

    state = HookState()
    results = {}
    for name, bucket in _odd_buckets(rank).items():
        native = _native_average(bucket) if bucket.numel() else bucket.clone()
        ours = state.reduce_bucket(bucket.clone(), is_last=True).wait()
        results[name] = (ours, native)
    complex_bucket = torch.tensor([complex(rank, 1), complex(-1, rank * rank)], dtype=torch.complex64)
    results["complex"] = (state.reduce_bucket(complex_bucket, is_last=True).wait(), None)
    state.close()
    return {"results": results, "join": _train_with_join(rank), "alone": _train_alone(rank, world_size)}


def _train_with_join(rank: int) -> dict:
    """Rank r has 2 + r batches; native DDP and the hook, both under Join, from the same start."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel

    import ddp_ring_hooks

    params, iterations = {}, None
    for use_hook in (False, True):
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 2)))
        state = ddp_ring_hooks.register(model) if use_hook else None
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(rank)
        with Join([model]):
            for _ in range(2 + rank):
                optimizer.zero_grad()
                model(torch.randn(4, 6, generator=generator)).square().mean().backward()
                optimizer.step()
        params[use_hook] = torch.cat([p.detach().view(-1) for p in model.parameters()])
        if state is not None:
            iterations = state.iteration
            state.close()
    return {"native": params[False], "hook": params[True], "iterations": iterations}


@pytest.fixture(scope="module")
def outcomes() -> list[dict]:
    return run_ranks(_try_odd_buckets, WORLD_SIZE, timeout=120)


@pytest.mark.parametrize("name", ["empty", "one element", "two elements", "nan and inf"])
def test_odd_buckets_match_native_all_reduce_bit_identically_on_every_rank(outcomes, name):
    ours_on_rank0 = outcomes[0]["results"][name][0]
    for rank in range(WORLD_SIZE):
        ours, native = outcomes[rank]["results"][name]
        assert ours.shape == native.shape
        torch.testing.assert_close(ours, native, equal_nan=True)  # NaN/Inf in the same places
        assert torch.equal(ours.nan_to_num(0.0), ours_on_rank0.nan_to_num(0.0))
        assert torch.equal(ours.isnan(), ours_on_rank0.isnan())


def test_nan_and_inf_propagate_like_native(outcomes):
    ours = outcomes[0]["results"]["nan and inf"][0]
    assert ours[0].isnan()               # NaN on one rank poisons the element
    assert ours[1] == math.inf           # +Inf on one rank
    assert ours[2] == -math.inf          # -Inf on one rank
    assert ours[3].isnan()               # +Inf meets -Inf
    assert torch.isfinite(ours[5])       # divided before summing: 3 x (2e38 / 3) does not overflow


def test_complex_bucket_is_averaged(outcomes):
    expected = torch.tensor(
        [sum(complex(r, 1) for r in range(WORLD_SIZE)), sum(complex(-1, r * r) for r in range(WORLD_SIZE))],
        dtype=torch.complex64,
    ) / WORLD_SIZE
    for rank in range(WORLD_SIZE):
        torch.testing.assert_close(outcomes[rank]["results"]["complex"][0], expected)


def test_join_with_uneven_inputs_matches_native_ddp(outcomes):
    for rank in range(WORLD_SIZE):
        join = outcomes[rank]["join"]
        torch.testing.assert_close(join["hook"], join["native"], rtol=1e-5, atol=1e-6)
        assert torch.equal(join["hook"], outcomes[0]["join"]["hook"])  # same on every rank
        # Ranks that joined early still took part in every reduction (with zeros).
        assert join["iterations"] == 2 + WORLD_SIZE - 1


def _train_alone(rank: int, world_size: int) -> dict:
    """World size 1, without another spawn: each rank trains on a group of its own."""
    from torch.nn.parallel import DistributedDataParallel

    import ddp_ring_hooks

    alone = [dist.new_group([r]) for r in range(world_size)][rank]  # every rank creates every group
    torch.manual_seed(rank)
    net = torch.nn.Linear(5, 3)
    inputs = torch.randn(4, 5)
    model = DistributedDataParallel(net, process_group=alone)
    state = ddp_ring_hooks.register(model)
    model(inputs).sum().backward()
    expected = torch.autograd.grad(net(inputs).sum(), list(net.parameters()))
    alone = state.reduce_bucket(torch.arange(4.0), is_last=True).wait()
    state.close()
    return {"grads": [p.grad for p in net.parameters()], "expected": list(expected), "bucket": alone}


def test_world_size_one_leaves_gradients_unchanged(outcomes):
    for rank in range(WORLD_SIZE):
        outcome = outcomes[rank]["alone"]
        for grad, expected in zip(outcome["grads"], outcome["expected"]):
            assert torch.equal(grad, expected)
        assert torch.equal(outcome["bucket"], torch.arange(4.0))
