"""Which way of a rank's link an all-reduce holds, and when: what the replay's link is made of.

A link is full duplex: a rank sends on its way out while it receives on its way in, each at
the link's rate. The algorithms use the two ways differently (the busiest rank's view)::

    ring, hierarchical, double binary tree,   sends and receives in every step  [====== both ======]
    halving-doubling (p a power of two)
    tree, naive (the root)                     the reduce comes in, then the     [=== in ===][== out ==]
                                               broadcast goes out
    halving-doubling (p not a power of two)    fold in, exchange, unfold out     [in][=== both ===][out]

So two buckets of a tree share the link better than two of a ring: one's broadcast goes out
while the next one's reduce comes in. The replay (:mod:`.replay`) holds each way as its own
resource, and a bucket's link time as parts in order, each holding the way out, the way in,
or both, for its share of the time.

Counted on the schedule itself (:func:`counted_directions`): the busiest rank (the most time on
its link, a step's time being the larger of what it sends and what it receives in that step),
per step whether it sends, receives or both, consecutive steps of one pattern merged, each
part's share its steps' time over the whole. The shares split the link time
:func:`~.network.bucket_cost` prices, so a bucket's total never moves: only what it can run
beside. An algorithm whose schedules grow too big to count at the advisor's large world sizes
(a ring of 512 ranks is half a million transfers) has a closed form in its registry record
(``Algorithm.link_directions``: both ways for the ring and the hierarchy); the counts are
cached per algorithm, world size and shaping options.

On two tiers (``advise --placement``) the same parts split the bucket's link time, uplink and
links inside the node together: the root's node receives the reduce and sends the broadcast as
the root does, and every phase of the hierarchy is a ring, both ways.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from ..schedules import (
    BOTH, IN, OUT, Schedule, algorithm_names, build_schedule, formula_for, get_algorithm, resolve_options, shape_options,
)

#: What one bucket's link time is made of, in order: ``(OUT, IN or BOTH, share of the time)``.
Directions = tuple[tuple[str, float], ...]

#: The whole link time both ways at once (the ring's; and the replay's default).
BOTH_WAYS: Directions = ((BOTH, 1.0),)

#: Which of the link's two ways each part holds.
HOLDS = {OUT: (OUT,), IN: (IN,), BOTH: (OUT, IN)}


def link_directions(algorithm: str, world_size: int, *, nbytes: float = 0, environment: Mapping[str, str] | None = None,
                    **options) -> Directions:
    """The parts of one all-reduce's link time for ``algorithm`` on ``world_size`` ranks with
    ``options`` (those chosen by size for an ``nbytes`` buffer; those not given from
    ``environment``, a run's as it recorded them, or this process's by default, as the registry
    resolves them; else their defaults). An algorithm without a schedule
    is the one it is priced as (``native``: the ring); a run that mixed them (``auto``, not a
    registered name) is priced as the ring, both ways::

        >>> link_directions("tree", 2)
        (('in', 0.5), ('out', 0.5))
    """
    if world_size < 2 or algorithm not in algorithm_names():
        return BOTH_WAYS
    algorithm = formula_for(algorithm)
    record = get_algorithm(algorithm)
    resolved = resolve_options(algorithm, options, nbytes=int(nbytes), environment=environment)
    shaping = shape_options(algorithm, resolved)
    if record.link_directions is not None:
        return record.link_directions(world_size, **shaping)
    frozen = tuple(sorted((key, tuple(value) if isinstance(value, list) else value) for key, value in shaping.items()))
    return _counted(algorithm, world_size, frozen)


def ways_held(directions: Directions) -> float:
    """The ways of the link held on average over ``directions`` (2 both at once, 1 one way)."""
    return sum(share * len(HOLDS[way]) for way, share in directions)


@functools.lru_cache(maxsize=256)
def _counted(algorithm: str, world_size: int, options: tuple) -> Directions:
    return counted_directions(build_schedule(algorithm, world_size, **dict(options)))


def counted_directions(schedule: Schedule) -> Directions:
    """The busiest rank's parts, counted on ``schedule`` (the module docstring)."""
    p, chunk = schedule.world_size, 1.0 / schedule.num_chunks
    sent = [[0.0] * p for _ in schedule.steps]
    received = [[0.0] * p for _ in schedule.steps]
    for index, step in enumerate(schedule.steps):
        for transfer in step.transfers:
            sent[index][transfer.src] += chunk
            received[index][transfer.dst] += chunk

    def busy(rank: int) -> float:
        return sum(max(out[rank], into[rank]) for out, into in zip(sent, received))

    busiest = max(range(p), key=busy)  # the first of equals
    parts: list[list] = []
    for out, into in zip(sent, received):
        out, into = out[busiest], into[busiest]
        if not (out or into):
            continue
        way = BOTH if out and into else OUT if out else IN
        if parts and parts[-1][0] == way:
            parts[-1][1] += max(out, into)
        else:
            parts.append([way, max(out, into)])
    total = sum(time for _, time in parts)
    return tuple((way, time / total) for way, time in parts) if total else BOTH_WAYS
