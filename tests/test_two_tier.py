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
    Links, RingCrossings, TwoTier, hierarchical_uplink_cost, price, ring_crossings, ring_uplink_cost, simulate, two_tier_terms,
    uplink_terms, uplink_traffic,
)
from ddp_ring_hooks.schedules import build_schedule, schedule_nodes, schedule_order

pytestmark = pytest.mark.fast  # no test here starts a process

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
    tiers = Links(80e-6, 8e-9, 3e-11, local=Links(5e-6, 1e-10))
    simulated = simulate(schedule, N, tiers, placement=placement, shared_uplinks=True)
    assert price(closed, N, tiers) == pytest.approx(simulated, rel=1e-12)


@pytest.mark.parametrize("segments", [1, 3])
@pytest.mark.parametrize("world_size, local_size", [(4, 2), (6, 2), (6, 3), (8, 2), (8, 4), (12, 3), (16, 4), (16, 8)])
def test_hierarchical_closed_form_equals_the_schedule_when_a_nodes_ranks_share_its_uplink(world_size, local_size, segments):
    closed = hierarchical_uplink_cost(world_size, ranks_per_node=local_size, segments=segments)
    tiers = Links(80e-6, 8e-9, 3e-11, local=Links(5e-6, 1e-10))
    # Placed node by node, and misplaced but fixed by ring_order="hosts": the same cost.
    misplaced = interleaved(world_size, world_size // local_size)
    for schedule in (
        build_schedule("hierarchical", world_size, local_size=local_size, segments=segments),
        build_schedule("hierarchical", world_size, local_size=local_size, segments=segments, ring_order="hosts",
                       node_of=misplaced),
    ):
        placement = schedule_nodes(schedule)
        _same(uplink_terms(schedule, placement), closed)
        simulated = simulate(schedule, N, tiers, placement=placement, shared_uplinks=True)
        assert price(closed, N, tiers) == pytest.approx(simulated, rel=1e-12)


def test_on_the_issue_network_hierarchical_takes_two_thirds_of_the_placed_ring_and_a_third_of_the_misplaced():
    uplink = Links(0.0, 1 / 50e6, local=Links(0.0, 0.0))  # 400 Mbit/s uplinks
    placed, misplaced = blocks(4, 2), interleaved(4, 2)
    ring = price(ring_uplink_cost(4, crossings=ring_crossings(range(4), placed)), N, uplink)
    crossing = price(ring_uplink_cost(4, crossings=ring_crossings(range(4), misplaced)), N, uplink)
    hierarchical = price(hierarchical_uplink_cost(4, ranks_per_node=2), N, uplink)
    assert crossing / ring == pytest.approx(2.0)
    assert hierarchical / ring == pytest.approx(2 / 3)


@pytest.mark.parametrize("world_size, local_size, segments", [(4, 2, 4), (6, 3, 4), (8, 2, 3), (16, 8, 2)])
def test_pipelined_hierarchical_keeps_the_uplink_busy_with_one_segment_at_a_time(world_size, local_size, segments):
    """Segment j starts 2(N-1) steps after segment j-1: in the inter-node phase every step moves
    one segment's shard pieces through each uplink, n/(kN) each way, and nothing else crosses;
    only the first and the last G-1 steps stay inside the nodes."""
    k, nodes = segments, world_size // local_size
    schedule = build_schedule("hierarchical", world_size, local_size=local_size, segments=k)
    placement = blocks(world_size, local_size)
    assert [(name, stop - start) for name, start, stop in schedule.phases] == [
        ("intra-node reduce-scatter", local_size - 1), ("inter-node all-reduce", 2 * (nodes - 1) * k),
        ("intra-node all-gather", local_size - 1),
    ]
    chunk = N / schedule.num_chunks
    for name, start, stop in schedule.phases:
        for step in schedule.steps[start:stop]:
            leaving = {node: 0.0 for node in range(nodes)}
            for t in step.transfers:
                if placement[t.src] != placement[t.dst]:
                    leaving[placement[t.src]] += chunk
            expected = N / (k * nodes) if name == "inter-node all-reduce" else 0.0
            assert list(leaving.values()) == pytest.approx([expected] * nodes), (name, leaving)
    assert uplink_traffic(schedule, N, placement).busiest == pytest.approx(2 * (nodes - 1) / nodes * N)


def test_segments_follow_the_buffer_unless_given():
    sized = {n: dict(build_schedule("hierarchical", 4, local_size=2, nbytes=n).options)["segments"]
             for n in (0, 4096, 1 << 20, 3 << 20, 4 << 20, 16 << 20, 1 << 30)}
    assert sized == {0: 1, 4096: 1, 1 << 20: 1, 3 << 20: 3, 4 << 20: 4, 16 << 20: 8, 1 << 30: 8}
    assert dict(build_schedule("hierarchical", 4, local_size=2, segments=2, nbytes=16 << 20).options)["segments"] == 2
    dbt = {n: dict(build_schedule("double_binary_tree", 4, nbytes=n).options)["segments"] for n in (0, 64 << 10, 16 << 20)}
    assert dbt == {0: 1, 64 << 10: 1, 16 << 20: 32}


LAB = Links(200e-6, 1 / 50e6, local=Links(50e-6, 1 / 1e9))  # 400 Mbit/s uplinks


@pytest.mark.parametrize("world_size, local_size", [(4, 2), (6, 3), (8, 2)])
def test_two_tier_network_prices_every_algorithm_from_its_schedule_or_the_closed_form_that_equals_it(world_size, local_size):
    network = TwoTier(LAB, ranks_per_node=local_size)
    placement = network.nodes(world_size)
    misplaced = interleaved(world_size, world_size // local_size)
    cases = [(a, {}) for a in ("ring", "tree", "double_binary_tree", "halving_doubling", "naive")] + [
        ("ring", {"ring_order": "hosts", "node_of": misplaced}),
        ("hierarchical", {"local_size": local_size}),
        ("hierarchical", {"local_size": local_size, "segments": 3}),
        ("hierarchical", {"local_size": local_size, "ring_order": "hosts", "node_of": misplaced}),  # counted
    ]
    for algorithm, options in cases:
        counted = uplink_terms(build_schedule(algorithm, world_size, nbytes=int(N), **options), placement)
        _same(two_tier_terms(algorithm, world_size, placement, nbytes=N, **options), counted)
        assert network.predict(algorithm, N, world_size, **options) == pytest.approx(price(counted, N, LAB), rel=1e-12)
    assert network.predict("native", N, world_size) == network.predict("ring", N, world_size)  # priced as the ring


def test_on_the_lab_network_hierarchical_wins_and_a_misplaced_ring_loses_by_its_crossings():
    placed, misplaced = TwoTier(LAB, ranks_per_node=2), TwoTier(LAB, placement=(0, 1, 0, 1))
    n = 16 << 20
    assert placed.predict("hierarchical", n, 4, local_size=2) / placed.predict("ring", n, 4) == pytest.approx(0.68, abs=0.02)
    assert misplaced.predict("ring", n, 4) / placed.predict("ring", n, 4) == pytest.approx(2.0, abs=0.01)
    fixed = misplaced.predict("ring", n, 4, ring_order="hosts", node_of=(0, 1, 0, 1))
    assert fixed == pytest.approx(placed.predict("ring", n, 4))
    # Large world sizes come from the closed forms at once, not from 500-rank schedules.
    assert TwoTier(LAB, ranks_per_node=8).predict("hierarchical", n, 512, local_size=8) > 0


def test_a_two_tier_network_must_know_the_ranks_nodes():
    with pytest.raises(ValueError, match="give placement=.* or ranks_per_node=G, not both"):
        TwoTier(LAB)
    with pytest.raises(ValueError, match="this network places 4 ranks, not 6"):
        TwoTier(LAB, placement=(0, 0, 1, 1)).predict("ring", N, 6)
    with pytest.raises(ValueError, match="nodes of 4 ranks do not divide 6 ranks"):
        TwoTier(LAB, ranks_per_node=4).nodes(6)


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
