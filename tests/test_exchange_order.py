"""An exchange with one peer posts its receive before its send, on real gloo ranks.

Why the order matters (``runtime/executor.py`` has the details): gloo writes everything a
rank sends to one peer, payloads and "my receive is posted" notices alike, through one
first-in first-out queue, and a payload leaves only once the peer's notice has arrived. A
rank that posts its send first can put its own notice behind its whole payload; the peer's
half of the exchange then starts only when this half has crossed the link, and the exchange
runs one direction after the other (twice as long on a network: ``docs/benchmarks.md``).

Timing shows it only on a shaped network, so this test checks the cause: each rank records
the point-to-point operations it posts on its real gloo group (the group's own ``send`` and
``recv``, wrapped to note the peer before they run), for the schedules made of exchanges
only: the ring at 2 ranks, halving-doubling at 4, hierarchical as 2 nodes x 2. Every send to
a peer must come after the receive from that peer of the same step, for every slice of a
pipelined call; and the results are still right and bit-identical on every rank.
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


def _record_posts(rank: int, world_size: int) -> dict:
    from ddp_ring_hooks.runtime import run_schedule

    posted: list[tuple[str, int]] = []
    real_send, real_recv = dist.ProcessGroup.send, dist.ProcessGroup.recv

    def send(group, tensors, peer, tag):
        posted.append(("send", peer))
        return real_send(group, tensors, peer, tag)

    def recv(group, tensors, peer, tag):
        posted.append(("recv", peer))
        return real_recv(group, tensors, peer, tag)

    report = {}
    for algorithm, options, size in EXCHANGES:
        group = dist.new_group(list(range(size)))  # collective: every rank calls it
        if rank >= size:
            continue
        schedule = checked_schedule(algorithm, size, **options)
        inputs = [rank_input(r, NUMEL, torch.float32) for r in range(size)]
        result = inputs[rank].clone()
        posted.clear()
        dist.ProcessGroup.send, dist.ProcessGroup.recv = send, recv
        try:
            run_schedule(schedule, result, group=group, slice_bytes=SLICE_BYTES)
        finally:
            dist.ProcessGroup.send, dist.ProcessGroup.recv = real_send, real_recv
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
        for operation, peer in posted:
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
