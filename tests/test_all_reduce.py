"""``all_reduce`` on real gloo ranks: equal to ``dist.all_reduce``, bit-identical across ranks.

Tolerance: the ring sums in a different order than gloo, so results differ in the last bits.
Both are compared with the exact float64 sum of all ranks' inputs, within the textbook
bound for recursive summation, ``p · u · Σ|x_i|`` (``u`` = unit roundoff of the dtype,
``p`` = world size; one rounding per addition plus the final conversion).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ddp_ring_hooks
from tests._dist import run_ranks
from tests.conftest import DTYPES, UNIT_ROUNDOFF, digest, rank_input, within_summation_bound

LARGE_PRIME = 100_003
ABOUT_25_MB = 25 * 2**20 // 4 + 7  # fp32 elements, a little over 25 MiB, not a multiple of p


def element_counts(world_size: int) -> list[int]:
    return sorted({0, 1, max(world_size - 1, 0), world_size, world_size + 1, LARGE_PRIME})


def compare_with_native(rank: int, world_size: int, cases) -> dict:
    """Run every (numel, dtype) case with ours and with gloo's; return errors and digests."""
    report = {}
    for numel, dtype in cases:
        inputs = [rank_input(r, numel, dtype) for r in range(world_size)]
        ours, native = inputs[rank].clone(), inputs[rank].clone()
        assert ddp_ring_hooks.all_reduce(ours) is ours
        dist.all_reduce(native)
        report[(numel, str(dtype))] = (
            within_summation_bound(ours, inputs, dtype, world_size),
            within_summation_bound(native, inputs, dtype, world_size),
            digest(ours),
        )
    return report


@pytest.mark.parametrize("world_size", range(1, 7))
def test_all_reduce_matches_native_and_is_identical_across_ranks(world_size):
    cases = [(n, dtype) for n in element_counts(world_size) for dtype in DTYPES]
    if world_size in (2, 3):
        cases.append((ABOUT_25_MB, torch.float32))
    reports = run_ranks(compare_with_native, world_size, cases, timeout=240)
    for case in reports[0]:
        ours, native, _ = reports[0][case]
        assert ours <= 1.0, f"{case}: ours off by {ours:.2f} x the bound"
        assert native <= 1.0, f"{case}: native off by {native:.2f} x the bound (bound too tight?)"
        assert len({report[case][2] for report in reports}) == 1, f"{case}: ranks differ bit-wise"


def reduce_on_subgroups(rank: int, world_size: int) -> tuple[float, float]:
    evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
    mine = evens if rank % 2 == 0 else odds
    values = torch.full((5,), float(rank + 1))
    ddp_ring_hooks.all_reduce(values, group=mine)
    shaped = torch.arange(12.0).reshape(3, 4).t() * (rank + 1)  # non-contiguous input
    ddp_ring_hooks.all_reduce(shaped, group=mine)
    return float(values[0]), float(shaped[3, 2])


def test_all_reduce_on_subgroups_and_non_contiguous_tensors():
    results = run_ranks(reduce_on_subgroups, 4, timeout=120)
    # evens hold ranks 0 and 2 (values 1 and 3), odds ranks 1 and 3 (values 2 and 4).
    assert [r[0] for r in results] == [4.0, 6.0, 4.0, 6.0]
    assert [r[1] for r in results] == [11.0 * 4, 11.0 * 6, 11.0 * 4, 11.0 * 6]


@pytest.mark.fast
def test_unknown_algorithm_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown algorithm 'rign' \\(did you mean 'ring'\\?\\); choose one of ring"):
        ddp_ring_hooks.HookState(algorithm="rign")


def average_with_every_algorithm(rank: int, world_size: int) -> dict:
    """``run_schedule(divisor=p)``: the fused divide-then-sum of the DDP hook, in many lanes."""
    from ddp_ring_hooks.runtime import run_schedule
    from ddp_ring_hooks.schedules import ALGORITHMS, checked_schedule

    report = {}
    for algorithm in ALGORITHMS:
        options = {"local_size": 1} if algorithm == "hierarchical" else {}
        schedule = checked_schedule(algorithm, world_size, **options)
        for dtype in (torch.float32, torch.float16):
            inputs = [rank_input(r, 1009, dtype) for r in range(world_size)]
            averaged = run_schedule(schedule, inputs[rank].clone(), divisor=world_size, slice_bytes=256)
            # Each x_r / p rounds once more than a plain sum: (p + 1) roundings in the bound.
            scaled = [x.double() / world_size for x in inputs]
            bound = (world_size + 1) * UNIT_ROUNDOFF[dtype] * torch.stack(scaled).abs().sum(0)
            error = float(((averaged.double() - torch.stack(scaled).sum(0)).abs() / bound).max())
            # Near fp16's largest value (65504) a sum overflows; dividing first must not.
            large = torch.full((7,), 60000.0, dtype=torch.float16)
            run_schedule(schedule, large, divisor=world_size)
            report[(algorithm, str(dtype))] = (error, digest(averaged), large.tolist())
    return report


def test_divisor_averages_every_algorithm_without_fp16_overflow():
    reports = run_ranks(average_with_every_algorithm, 3, timeout=120)
    for case, (error, _, large) in reports[0].items():
        assert error <= 1.0, f"{case}: off by {error:.2f} x the rounding bound"
        assert large == [60000.0] * 7, f"{case}: {large}"
        assert len({report[case][1] for report in reports}) == 1, f"{case}: ranks differ bit-wise"
