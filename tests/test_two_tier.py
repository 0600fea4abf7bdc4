"""Two tiers of links: bytes through each node's uplink, ring crossings, and the closed forms.

Pure tests. Every expected number is the uplink argument worked out by hand (2 nodes x 2
ranks: the flat ring pushes 1.5 n through each uplink direction, the misplaced ring 3 n,
hierarchical n) or a closed form checked against the step-by-step simulation with shared
uplinks on many node shapes.
"""

from __future__ import annotations

import random

import pytest

from ddp_ring_hooks.cost_model import (
    RingCrossings, hierarchical_uplink_cost, price, ring_crossings, ring_uplink_cost, simulate, uplink_terms,
    uplink_traffic,
)
from ddp_ring_hooks.schedules import build_schedule, schedule_nodes, schedule_order

N = 3.0e6


def blocks(world_size: int, local_size: int) -> tuple[int, ...]:
    return tuple(rank // local_size for rank in range(world_size))


def interleaved(world_size: int, nodes: int) -> tuple[int, ...]:
    return tuple(rank % nodes for rank in range(world_size))


def test_uplink_bytes_of_the_issue_example_two_nodes_of_two():
    placed, misplaced = blocks(4, 2), interleaved(4, 2)
    ring = build_schedule("ring", 4)
    assert uplink_traffic(ring, N, placed).sent == {0: 1.5 * N, 1: 1.5 * N}
    assert uplink_traffic(ring, N, placed).received == {0: 1.5 * N, 1: 1.5 * N}
    assert uplink_traffic(ring, N, misplaced).busiest == pytest.approx(3 * N)
    fixed = build_schedule("ring", 4, ring_order="hosts", node_of=misplaced)
    assert uplink_traffic(fixed, N, misplaced).busiest == pytest.approx(1.5 * N)
    hierarchical = build_schedule("hierarchical", 4, local_size=2)
    assert uplink_traffic(hierarchical, N, placed).busiest == pytest.approx(N)
    # Inside one node nothing crosses.
    assert uplink_traffic(ring, N, (0, 0, 0, 0)).busiest == 0


def test_ring_crossings_count_the_hops_between_nodes():
    assert ring_crossings((0, 1, 2, 3), (0, 0, 1, 1)) == RingCrossings(total=2, busiest=1)
    assert ring_crossings((0, 1, 2, 3), (0, 1, 0, 1)) == RingCrossings(total=4, busiest=2)
    assert ring_crossings((0, 2, 1, 3), (0, 1, 0, 1)) == RingCrossings(total=2, busiest=1)
    assert ring_crossings((0, 1, 2), (0, 0, 0)) == RingCrossings(total=0, busiest=0)
    assert ring_crossings(tuple(range(12)), interleaved(12, 3)) == RingCrossings(total=12, busiest=4)
    with pytest.raises(ValueError, match="not an order of the 4 ranks"):
        ring_crossings((0, 1, 2), (0, 0, 1, 1))


def node_shapes():
    """(world_size, placement, ring_order) for placed and misplaced ranks, several node sizes."""
    for p, g in ((4, 2), (6, 2), (6, 3), (8, 2), (8, 4), (9, 3), (12, 4)):
        for placement in (blocks(p, g), interleaved(p, p // g)):
            yield p, g, placement, "rank"
            yield p, g, placement, tuple(random.Random(p * g).sample(range(p), p))
    yield 5, 5, (0,) * 5, "rank"


@pytest.mark.parametrize("world_size, local_size, placement, order", list(node_shapes()))
def test_ring_closed_form_equals_the_schedule_counted_and_simulated_with_shared_uplinks(world_size, local_size, placement, order):
    schedule = build_schedule("ring", world_size, ring_order=order)
    crossings = ring_crossings(schedule_order(schedule), placement)
    closed = ring_uplink_cost(world_size, crossings=crossings)
    _same(uplink_terms(schedule, placement), closed)
    tiers = {"alpha": 80e-6, "beta": 8e-9, "local_alpha": 5e-6, "local_beta": 1e-10, "gamma": 3e-11}
    simulated = simulate(schedule, N, placement=placement, shared_uplinks=True, **tiers)
    assert price(closed, N, **tiers) == pytest.approx(simulated, rel=1e-12)


@pytest.mark.parametrize("world_size, local_size", [(4, 2), (6, 2), (6, 3), (8, 2), (8, 4), (12, 3), (16, 4)])
def test_hierarchical_closed_form_equals_the_schedule_when_a_nodes_ranks_share_its_uplink(world_size, local_size):
    closed = hierarchical_uplink_cost(world_size, ranks_per_node=local_size)
    tiers = {"alpha": 80e-6, "beta": 8e-9, "local_alpha": 5e-6, "local_beta": 1e-10, "gamma": 3e-11}
    # Placed node by node, and misplaced but fixed by ring_order="hosts": the same cost.
    misplaced = interleaved(world_size, world_size // local_size)
    for schedule in (
        build_schedule("hierarchical", world_size, local_size=local_size),
        build_schedule("hierarchical", world_size, local_size=local_size, ring_order="hosts", node_of=misplaced),
    ):
        placement = schedule_nodes(schedule)
        _same(uplink_terms(schedule, placement), closed)
        simulated = simulate(schedule, N, placement=placement, shared_uplinks=True, **tiers)
        assert price(closed, N, **tiers) == pytest.approx(simulated, rel=1e-12)


def test_on_the_issue_network_hierarchical_takes_two_thirds_of_the_placed_ring_and_a_third_of_the_misplaced():
    uplink = {"alpha": 0.0, "beta": 1 / 50e6, "local_alpha": 0.0, "local_beta": 0.0}  # 400 Mbit/s uplinks
    placed, misplaced = blocks(4, 2), interleaved(4, 2)
    ring = price(ring_uplink_cost(4, crossings=ring_crossings(range(4), placed)), N, **uplink)
    crossing = price(ring_uplink_cost(4, crossings=ring_crossings(range(4), misplaced)), N, **uplink)
    hierarchical = price(hierarchical_uplink_cost(4, ranks_per_node=2), N, **uplink)
    assert crossing / ring == pytest.approx(2.0)
    assert hierarchical / ring == pytest.approx(2 / 3)


def test_one_nic_per_rank_is_every_rank_its_own_node():
    schedule = build_schedule("tree", 8)
    per_link = simulate(schedule, N, alpha=1e-5, beta=1e-9)
    per_nic = simulate(schedule, N, alpha=1e-5, beta=1e-9, placement=tuple(range(8)), shared_uplinks=True)
    assert per_nic == pytest.approx(per_link)  # one message per rank and step: nothing shares a NIC
    pipelined = build_schedule("tree", 8, segments=4)  # the root feeds several children at once
    assert simulate(pipelined, N, alpha=1e-5, beta=1e-9, placement=tuple(range(8)), shared_uplinks=True) > simulate(
        pipelined, N, alpha=1e-5, beta=1e-9
    )


def test_bad_node_maps_are_named():
    with pytest.raises(ValueError, match="placement names the nodes of 3 ranks but the ring schedule has 4"):
        uplink_traffic(build_schedule("ring", 4), N, (0, 0, 1))
    with pytest.raises(ValueError, match="shared_uplinks needs placement"):
        simulate(build_schedule("ring", 4), N, alpha=1.0, beta=1.0, shared_uplinks=True)


def _same(counted, closed) -> None:
    for field in ("messages", "bytes", "reduced", "local_messages", "local_bytes"):
        assert getattr(counted, field) == pytest.approx(getattr(closed, field), rel=1e-12), field
