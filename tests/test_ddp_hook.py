"""DDP with the ring hook trains exactly like plain DDP, on real gloo ranks.

Tolerance: the ring adds the ranks' gradients in a different order than gloo, so parameters
agree to ``rtol=1e-5, atol=1e-6`` (float32) after several steps, while every rank holds
bit-identical parameters (each chunk is summed once, then copied).
"""

from __future__ import annotations

import pickle
import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_wrapper
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_ring_hooks
from ddp_ring_hooks.runtime import ExecutionObserver
from tests._dist import run_ranks
from tests.conftest import Net

STEPS = 4
MICRO_BATCHES = 2  # for the no_sync variant


VARIANTS = {
    "default": {},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
    "static_graph": {"static_graph": True},
    "find_unused_parameters": {"find_unused_parameters": True},
    "no_sync": {},
    "fp16_compress_wrapper": {},
    "one_bucket_at_a_time": {},  # concurrent_buckets=1 (the default reduces two at once)
}


def train(rank: int, variant: str, hook: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = DDP(Net(), bucket_cap_mb=0.01, **VARIANTS[variant])  # ~10 KB buckets: several of them
    if hook == "ring" and variant == "fp16_compress_wrapper":
        model.register_comm_hook(ddp_ring_hooks.HookState(), fp16_compress_wrapper(ddp_ring_hooks.ring_hook))
    elif hook == "ring" and variant == "one_bucket_at_a_time":
        ddp_ring_hooks.register(model, concurrent_buckets=1)
    elif hook == "ring":
        ddp_ring_hooks.register(model)
    elif variant == "fp16_compress_wrapper":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        model.register_comm_hook(None, fp16_compress_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(rank)
    use_all = variant != "find_unused_parameters"
    for _ in range(STEPS):
        optimizer.zero_grad()
        if variant == "no_sync":
            with model.no_sync():
                model(torch.randn(8, 32, generator=generator)).square().mean().backward()
        model(torch.randn(8, 32, generator=generator), use_all).square().mean().backward()
        optimizer.step()
    if hook == "ring":
        assert model._get_ddp_logging_data()["comm_hook"].endswith("hook")
    if hook == "ring" and variant == "default":  # two buckets in flight: two lanes ran
        names = {thread.name for thread in threading.enumerate()}
        assert {"ddp-ring-hooks-comm-0", "ddp-ring-hooks-comm-1"} <= names, names
    return [p.detach().clone() for p in model.parameters()]


def train_all_variants(rank: int, world_size: int) -> dict:
    return {(variant, hook): train(rank, variant, hook) for variant in VARIANTS for hook in ("ring", "plain")}


@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_hook_matches_plain_ddp(world_size):
    results = run_ranks(train_all_variants, world_size, timeout=240)
    for variant in VARIANTS:
        tolerance = {"rtol": 1e-3, "atol": 1e-4} if variant == "fp16_compress_wrapper" else {"rtol": 1e-5, "atol": 1e-6}
        for rank in range(world_size):
            ring, plain = results[rank][(variant, "ring")], results[rank][(variant, "plain")]
            for ours, theirs, first in zip(ring, plain, results[0][(variant, "ring")]):
                torch.testing.assert_close(ours, theirs, **tolerance, msg=lambda m: f"{variant}: {m}")
                assert torch.equal(ours, first), f"{variant}: rank {rank} differs from rank 0"


class Exploding(ExecutionObserver):
    """An observer whose bucket's communication fails as it starts, to see the failure reach
    ``backward``."""

    def on_phase(self, phase: str) -> None:
        raise RuntimeError("simulated link failure")


def hook_counts_and_failures(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = DDP(Net(), bucket_cap_mb=0.01)
    state = ddp_ring_hooks.register(model)
    for _ in range(3):
        with model.no_sync():
            model(torch.randn(4, 32)).sum().backward()
        model(torch.randn(4, 32)).sum().backward()
    # A pickled state (as in a checkpoint) comes back on the default group, without its thread.
    restored = pickle.loads(pickle.dumps(state))
    second = DDP(Net(), bucket_cap_mb=0.01)
    second.register_comm_hook(restored, ddp_ring_hooks.ring_hook)
    second(torch.randn(4, 32)).sum().backward()
    failing = DDP(Net(), bucket_cap_mb=0.01)
    failing.register_comm_hook(ddp_ring_hooks.HookState(observers=(Exploding(),)), ddp_ring_hooks.ring_hook)
    try:
        failing(torch.randn(4, 32)).sum().backward()
        error = None
    except RuntimeError as raised:
        error = str(raised)
    try:
        ddp_ring_hooks.register(model)
        twice = None
    except RuntimeError as raised:
        twice = str(raised)
    return {
        "iterations": state.iteration,
        "restored_iterations": restored.iteration,
        "restored_group_is_world": restored.group is dist.group.WORLD,
        "error": error,
        "twice": twice,
    }


def test_step_counting_pickling_failures_and_double_registration():
    for result in run_ranks(hook_counts_and_failures, 2, timeout=120):
        assert result["iterations"] == 3  # no_sync micro-batches do not call the hook
        assert result["restored_iterations"] == 4
        assert result["restored_group_is_world"]
        assert "simulated link failure" in result["error"]
        assert "already has the communication hook 'ring_hook'" in result["twice"]


def two_models_in_one_backward(rank: int, world_size: int) -> dict:
    """Two DDP models on one group, both hooked, reduced by the same backward (GAN, distillation)."""
    results = {}
    for hooked in (True, False):
        torch.manual_seed(0)
        first, second = DDP(Net(), bucket_cap_mb=0.01), DDP(Net(), bucket_cap_mb=0.01)
        if hooked:
            states = [ddp_ring_hooks.register(first), ddp_ring_hooks.register(second)]
        generator = torch.Generator().manual_seed(rank)
        for _ in range(3):
            x = torch.randn(8, 32, generator=generator)
            (first(x).square().mean() + second(x).abs().mean()).backward()
        results[hooked] = [p.grad.clone() for p in [*first.parameters(), *second.parameters()]]
    assert states[0].iteration == states[1].iteration == 3
    return results


def test_two_hooked_models_share_one_worker_and_match_plain_ddp():
    results = run_ranks(two_models_in_one_backward, 2, timeout=120)
    for rank in range(2):
        for ours, theirs, first in zip(results[rank][True], results[rank][False], results[0][True]):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
            assert torch.equal(ours, first)
