"""An exchange with one peer uses both directions at once, on real gloo ranks: each rank posts
its receive before its send, and the two directions travel on two different gloo transports.

Why (``runtime/executor.py`` and ``runtime/directions.py`` have the details): gloo writes
everything a rank sends to one peer on one transport, payloads and "my receive is posted"
notices alike, through one first-in first-out queue, and a payload leaves only once the peer's
notice has arrived. A rank that posts its send first can put its own notice behind its whole
payload; the peer's half of the exchange then starts only when this half has crossed the link
(twice as long on a network: ``docs/benchmarks.md``). And on one transport both payloads take
turns at one lock.

Timing shows it only on a shaped network, so this test checks the causes: each rank records
the point-to-point operations it posts (the group's own ``send`` and ``recv`` and those of the
exchanging pairs' gloo backends, wrapped to note the peer and the transport before they run), for
the schedules made of exchanges only: the ring at 2 ranks, halving-doubling at 4, hierarchical
as 2 nodes x 2. Every send to a peer must come after the receive from that peer of the same
step, for every slice of a pipelined call; messages from a lower to a higher rank must go on the
pair's own transport (one per peer) and the others on the group; and the results are still right
and bit-identical on every rank.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist

from ddp_ring_hooks.schedules import checked_schedule
from tests._dist import run_ranks
from tests.conftest import digest, rank_input, within_summation_bound

WORLD_SIZE = 4
NUMEL = 1000  # float32; with SLICE_BYTES below, several slices per chunk (two in flight)
SLICE_BYTES = 256
#: (algorithm, options, ranks of the group): every step of each is an exchange with one peer.
EXCHANGES = (
    ("ring", {}, 2),
    ("halving_doubling", {}, 4),
    ("hierarchical", {"local_size": 2}, 4),
)
#: The classes whose ``send``/``recv`` the executor calls: the group, and each pair's gloo backend.
TRANSPORTS = (dist.ProcessGroup, dist.ProcessGroupGloo)


def _record_posts(rank: int, world_size: int) -> dict:
    from ddp_ring_hooks.runtime import context_of, run_schedule

    posted: list[tuple[str, int, str]] = []  # (operation, peer in the group, transport)
    real = {(cls, op): getattr(cls, op) for cls in TRANSPORTS for op in ("send", "recv")}

    def spy(cls, operation):
        def call(transport, tensors, peer, tag):
            if transport is group:
                posted.append((operation, peer, "group"))
            else:  # a pair's transport: its ranks are 0 (the lower) and 1; name the group's peer
                peer_in_group = next(p for p, t in context_of(group).upward().items() if t is transport)
                posted.append((operation, peer_in_group, f"pair {id(transport)}"))
            return real[cls, operation](transport, tensors, peer, tag)
        return call

    report = {}
    for algorithm, options, size in EXCHANGES:
        group = dist.new_group(list(range(size)))  # collective: every rank calls it
        if rank >= size:
            continue
        schedule = checked_schedule(algorithm, size, **options)
        inputs = [rank_input(r, NUMEL, torch.float32) for r in range(size)]
        result = inputs[rank].clone()
        posted.clear()
        for cls, operation in real:
            setattr(cls, operation, spy(cls, operation))
        try:
            run_schedule(schedule, result, group=group, slice_bytes=SLICE_BYTES)
        finally:
            for (cls, operation), method in real.items():
                setattr(cls, operation, method)
        report[algorithm] = {
            "posted": list(posted),
            "error": within_summation_bound(result, inputs, torch.float32, size),  # <= 1 passes
            "digest": digest(result),
        }
    return report


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return run_ranks(_record_posts, WORLD_SIZE, timeout=120)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("algorithm, options, size", EXCHANGES, ids=[case[0] for case in EXCHANGES])
def test_every_send_to_a_peer_follows_the_receive_from_it(reports, algorithm, options, size):
    schedule = checked_schedule(algorithm, size, **options)
    for rank in range(size):
        # The premise: every step of this schedule exchanges with one peer, both ways.
        for step in schedule.plan_for(rank):
            assert {s.peer for s in step.sends} == {r.peer for r in step.receives}, (algorithm, rank, step)
        posted = reports[rank][algorithm]["posted"]
        received, sent = Counter(), Counter()
        for operation, peer, _ in posted:
            if operation == "recv":
                received[peer] += 1
            else:
                sent[peer] += 1
                assert received[peer] >= sent[peer], (
                    f"{algorithm}: rank {rank} posted send #{sent[peer]} to rank {peer} before its "
                    f"receive from that peer; posts: {posted}"
                )
        assert sent == received and sum(sent.values()) > len(schedule.steps), posted  # several slices


@pytest.mark.timeout(150)
@pytest.mark.parametrize("algorithm, options, size", EXCHANGES, ids=[case[0] for case in EXCHANGES])
def test_the_exchanges_still_sum_right_and_agree_bit_for_bit(reports, algorithm, options, size):
    results = [reports[rank][algorithm] for rank in range(size)]
    assert all(result["error"] <= 1 for result in results), [result["error"] for result in results]
    assert len({result["digest"] for result in results}) == 1


@pytest.mark.timeout(150)
@pytest.mark.parametrize("algorithm, options, size", EXCHANGES, ids=[case[0] for case in EXCHANGES])
def test_the_two_directions_of_a_pair_travel_on_two_transports(reports, algorithm, options, size):
    for rank in range(size):
        posted = reports[rank][algorithm]["posted"]
        # (source, destination) of every message this rank posted -> the transports it went on
        transports = {}
        for operation, peer, transport in posted:
            source, destination = (rank, peer) if operation == "send" else (peer, rank)
            transports.setdefault(source < destination, set()).add(transport)
        upward, downward = transports[True], transports[False]
        assert downward == {"group"}, (algorithm, rank, posted)  # higher -> lower: the group itself
        assert "group" not in upward, (algorithm, rank, posted)  # lower -> higher: the pairs' own
        by_peer = {}
        for operation, peer, transport in posted:
            if transport != "group":
                by_peer.setdefault(peer, set()).add(transport)
        assert all(len(used) == 1 for used in by_peer.values()), by_peer  # one transport per pair
        assert len(set().union(*by_peer.values())) == len(by_peer), by_peer  # ... and a pair's alone


def _upward_timeout(rank: int, world_size: int) -> float:
    from datetime import timedelta

    from ddp_ring_hooks.runtime import Needs, context_of

    group = dist.new_group([0, 1], timeout=timedelta(seconds=7))
    context_of(group).prepare(Needs(pairs=frozenset({(0, 1)})))
    return context_of(group).upward()[1 - rank].options._timeout.total_seconds()


@pytest.mark.timeout(90)
def test_a_pairs_transport_keeps_the_groups_timeout():
    """A hung peer must fail after the same time on either transport."""
    assert run_ranks(_upward_timeout, 2, timeout=60) == [7.0, 7.0]
