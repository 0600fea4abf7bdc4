"""Every algorithm on real gloo ranks: equal to ``dist.all_reduce``, identical on every rank,
and DDP trained with it equals plain DDP.

Starting processes is the slow part (each imports torch), so one spawn of 8 ranks serves
every world size: the first ``p`` ranks form a subgroup for ``p = 1..6, 8`` (the executor
runs on subgroups like on WORLD), and each test reads its share of the results.

Tolerance, as in ``test_all_reduce``: each result is within ``p · u · Σ|x_i|`` of the exact
float64 sum (``u`` the dtype's unit roundoff), the bound for any order of ``p - 1``
additions, which is all the algorithms differ in; and every rank's result is bit-identical.
DDP parameters after a few SGD steps agree with plain DDP to ``rtol=1e-5, atol=1e-6`` (float32).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_ring_hooks
from tests._dist import run_ranks
from tests.conftest import DTYPES, Net, algorithm_cases, digest, rank_input, sgd_steps, within_summation_bound

WORLD_SIZES = (1, 2, 3, 4, 5, 6, 8)
DDP_WORLD_SIZE = 4  # every algorithm applies, hierarchical as 2 nodes x 2
DDP_STEPS = 3


def algorithms_for(world_size: int) -> list[tuple[str, dict]]:
    """Every registry example but the plain ring (its own grid is in test_all_reduce): the ring
    in another order, the trees pipelined too, hierarchical in every shape with at least 2
    nodes of 2 ranks."""
    return [(name, options) for name, options in algorithm_cases(world_size) if (name, options) != ("ring", {})]


def cases_for(world_size: int) -> list[tuple[int, torch.dtype]]:
    """Every dtype on an odd count; the edge counts (empty chunks, fewer elements than ranks)
    and a large prime in float32."""
    cases = [(world_size + 1, dtype) for dtype in DTYPES]
    return cases + [(n, torch.float32) for n in sorted({0, 1, max(world_size - 1, 1), 10_007})]


def run_on_every_world_size(rank: int, world_size: int) -> dict:
    report = {}
    for p in WORLD_SIZES:
        group = dist.new_group(list(range(p)))  # collective: every rank calls it
        if rank >= p:
            continue
        for algorithm, options in algorithms_for(p):
            name = f"{algorithm}{options or ''}"
            for numel, dtype in cases_for(p):
                inputs = [rank_input(r, numel, dtype) for r in range(p)]
                ours, native = inputs[rank].clone(), inputs[rank].clone()
                ddp_ring_hooks.all_reduce(ours, algorithm=algorithm, group=group, **options)
                dist.all_reduce(native, group=group)
                report[(p, name, numel, str(dtype))] = (
                    within_summation_bound(ours, inputs, dtype, p),
                    within_summation_bound(native, inputs, dtype, p),
                    digest(ours),
                )
            if p == DDP_WORLD_SIZE:
                report[(p, name, "ddp")] = train(rank, group, algorithm, options)
        if p == DDP_WORLD_SIZE:
            report[(p, "plain", "ddp")] = train(rank, group, None, {})
    return report


def train(rank: int, group, algorithm: str | None, options: dict) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = DDP(Net(), process_group=group, bucket_cap_mb=0.02)  # ~20 KB buckets: a few per step
    if algorithm is not None:
        ddp_ring_hooks.register(model, algorithm=algorithm, **options)
    return sgd_steps(model, rank, DDP_STEPS)


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return run_ranks(run_on_every_world_size, max(WORLD_SIZES), timeout=300)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_algorithm_matches_native_and_is_identical_across_ranks(reports, world_size):
    mine = {case: value for case, value in reports[0].items() if case[0] == world_size and case[-1] != "ddp"}
    assert {case[1] for case in mine} == {f"{a}{o or ''}" for a, o in algorithms_for(world_size)}
    assert len(mine) == len(algorithms_for(world_size)) * len(cases_for(world_size))
    for case, (ours, native, _) in mine.items():
        assert ours <= 1.0, f"{case}: ours off by {ours:.2f} x the bound"
        assert native <= 1.0, f"{case}: native off by {native:.2f} x the bound"
        assert len({report[case][2] for report in reports[:world_size]}) == 1, f"{case}: ranks differ bit-wise"


def test_hierarchical_runs_on_two_nodes_of_two_and_three_nodes_of_two(reports):
    assert any(case[:2] == (4, "hierarchical{'local_size': 2}") for case in reports[0])
    assert any(case[:2] == (6, "hierarchical{'local_size': 2}") for case in reports[0])


def test_ddp_with_every_algorithm_matches_plain_ddp(reports):
    plain = reports[0][(DDP_WORLD_SIZE, "plain", "ddp")]
    trained = [case for case in reports[0] if case[-1] == "ddp" and case[1] != "plain"]
    assert {case[1].split("{")[0] for case in trained} == set(ddp_ring_hooks.ALGORITHMS)  # the ring: in another order
    for case in trained:
        for ours, reference in zip(reports[0][case], plain):
            torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6, msg=f"{case[1]} vs plain DDP")
        for other in reports[1:DDP_WORLD_SIZE]:
            assert all(torch.equal(a, b) for a, b in zip(other[case], reports[0][case])), f"{case[1]}: ranks differ"
