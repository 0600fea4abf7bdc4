"""The ring that fits the wires: from measured link bandwidths, the cycle whose slowest link is fastest.

A ring all-reduce moves the same bytes over every hop at once, so it runs at the pace of its
slowest hop. Given the bandwidth of every directed link (a :class:`~.matrix.LinkMatrix`, or
rows of bytes per second), :func:`best_ring` picks the order of the ranks around the ring::

    2 nodes of 2, ranks alternating           the cycles over 4 ranks, fixing rank 0 first
    node A = {0, 2}, node B = {1, 3}           0 1 2 3: ⇒ ⇒ ⇒ ⇒   4 slow hops
    fast inside a node (→), slow between (⇒)   0 2 1 3: → ⇒ → ⇒   2 slow hops   <- chosen
                                               0 1 3 2: ⇒ → ⇒ →   2 slow hops (the same ring reversed
                                                                  and rotated: either is as good)

1. **Tiers.** The measured bandwidths are sorted and cut into tiers where one is more than
   1/0.6 (the naming rule's threshold, :data:`~.rule.THRESHOLD`) times the one below it: links
   of one tier differ by noise, links of two tiers by design (a node's links and its uplink)
   or by a fault.
2. **The order of cycles.** A cycle is better when it uses fewer links of the slowest tier
   (none at all first: that is "the slowest link as fast as possible"), then fewer of the next
   tier, and so on; last, the smaller sum of ``1 / bandwidth`` over its links. On two tiers this
   is the fewest crossings between nodes: every ring over several nodes crosses at least twice
   (once into a node, once out), and each extra crossing shares an uplink with another hop.
3. **The search.** Exhaustive up to :data:`EXHAUSTIVE_UP_TO` ranks (``(p-1)!/2`` cycles, rank 0
   first, each cycle once up to direction); beyond, a documented heuristic: greedy (from every
   rank, always to the fastest unvisited peer, the cycle closed at the end) and then 2-opt
   (reverse any stretch of the cycle while that makes it better), which finds the node-grouped
   ring on two tiers and is not guaranteed optimal in general.
4. **The representation.** The cycle is rotated to start right after its last slowest hop,
   so that places ``0..G-1``, ``G..2G-1``, ... are whole fast groups when the ring is grouped
   by node (``hierarchical`` reads consecutive places as nodes).

Pure and deterministic: every rank that holds the same matrix computes the same order.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from .rule import THRESHOLD

#: Up to this many ranks every cycle is tried ((p-1)!/2 of them: 20160 at 9).
EXHAUSTIVE_UP_TO = 9

Rows = Sequence[Sequence[float | None]]


def best_ring(rows: Rows) -> tuple[int, ...]:
    """The ring order (rank ``order[i]`` sends to ``order[i + 1]``) for the bandwidths
    ``rows[src][dst]`` in bytes per second (the diagonal is ignored); see the module docstring.

        >>> fast, slow = 1e9, 5e7
        >>> best_ring([[None, slow, fast, slow], [slow, None, slow, fast], [fast, slow, None, slow], [slow, fast, slow, None]])
        (0, 2, 1, 3)
    """
    p = len(rows)
    _check(rows)
    if p <= 3:  # one ring (up to direction): nothing to choose
        return tuple(range(p))
    tier = _tiers(rows)
    key = _cycle_key(rows, tier)
    if p <= EXHAUSTIVE_UP_TO:
        best = min(
            ((0, *rest) for rest in itertools.permutations(range(1, p)) if rest[0] < rest[-1]),
            key=key,
        )
    else:
        best = _two_opt(min((_greedy(rows, start) for start in range(p)), key=key), key)
    return _rotated_after_slowest(best, rows, tier)


def _check(rows: Rows) -> None:
    p = len(rows)
    if any(len(row) != p for row in rows):
        raise ValueError(f"a bandwidth matrix of {p} ranks needs {p} columns in every row")
    missing = [(s, d) for s in range(p) for d in range(p) if s != d and not rows[s][d]]
    if missing:
        src, dst = missing[0]
        raise ValueError(
            f"no bandwidth measured for {len(missing)} link(s), e.g. {src}->{dst}: measure every pair "
            "(`ddp-ring-hooks links`) before choosing a ring by it"
        )


def _tiers(rows: Rows) -> dict[float, int]:
    """Each measured bandwidth's tier, 0 the slowest (step 1)."""
    values = sorted({b for s, row in enumerate(rows) for d, b in enumerate(row) if s != d})
    tier, tiers, floor = 0, {}, values[0]
    for value in values:
        if value * THRESHOLD > floor:  # more than 1/THRESHOLD above the tier's slowest
            tier, floor = tier + 1, value
        tiers[value] = tier
    return tiers


def _cycle_key(rows: Rows, tier: dict[float, int]):
    """The order of cycles (step 2) as a sort key: links per tier from the slowest, then time."""
    tiers = max(tier.values()) + 1

    def key(cycle: Sequence[int]) -> tuple:
        counts = [0] * tiers
        seconds = 0.0
        for src, dst in zip(cycle, (*cycle[1:], cycle[0])):
            bandwidth = rows[src][dst]
            counts[tier[bandwidth]] += 1
            seconds += 1.0 / bandwidth
        return (*counts, seconds)

    return key


def _greedy(rows: Rows, start: int) -> tuple[int, ...]:
    """From ``start``, always on to the fastest peer not yet visited (ties to the lower rank)."""
    cycle, left = [start], set(range(len(rows))) - {start}
    while left:
        here = cycle[-1]
        cycle.append(max(sorted(left), key=lambda peer: rows[here][peer]))
        left.discard(cycle[-1])
    return tuple(cycle)


def _two_opt(cycle: tuple[int, ...], key) -> tuple[int, ...]:
    """Reverse stretches of the cycle while one makes it better (step 3)."""
    best, improved = cycle, True
    while improved:
        improved = False
        for i in range(1, len(best) - 1):
            for j in range(i + 1, len(best)):
                candidate = (*best[:i], *reversed(best[i : j + 1]), *best[j + 1 :])
                if key(candidate) < key(best):
                    best, improved = candidate, True
    return best


def _rotated_after_slowest(cycle: tuple[int, ...], rows: Rows, tier: dict[float, int]) -> tuple[int, ...]:
    """The same ring, starting right after its last hop of its slowest tier (step 4)."""
    hops = list(zip(cycle, (*cycle[1:], cycle[0])))
    slowest = min(tier[rows[src][dst]] for src, dst in hops)
    if all(tier[rows[src][dst]] == slowest for src, dst in hops):
        return cycle  # one tier: nothing to align
    last = max(place for place, (src, dst) in enumerate(hops) if tier[rows[src][dst]] == slowest)
    start = (last + 1) % len(cycle)
    return (*cycle[start:], *cycle[:start])
