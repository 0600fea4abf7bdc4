"""Rounds of disjoint pairs that meet every pair of ranks exactly once: the circle method.

A probe that times one pair at a time needs p(p-1)/2 turns; pairs that share no rank can
run at the same time, since each rank's link carries only its own pair's traffic. The circle
method (as round-robin tournaments are drawn) does it in the fewest rounds:

1. Seat the ranks at a table of ``n`` seats, ``n = p`` for an even ``p`` and ``p + 1`` for an
   odd one (the extra seat is a bye: whoever faces it sits the round out).
2. In each round, seat ``i`` faces seat ``n-1-i``: ``n/2`` disjoint pairs.
3. Seat 0 stays; everyone else moves one seat on. After ``n - 1`` rounds every pair has met
   once: ``p - 1`` rounds for an even ``p``, ``p`` rounds (each with one bye) for an odd one.

For p = 4 (seats read across the top, then back along the bottom)::

    round 0        round 1        round 2
    0  1           0  3           0  2
    3  2           2  1           1  3
    (0,3) (1,2)    (0,2) (1,3)    (0,1) (2,3)
"""

from __future__ import annotations

Pair = tuple[int, int]


def exchange_rounds(world_size: int) -> tuple[tuple[Pair, ...], ...]:
    """The rounds of the circle method for ``world_size`` ranks, each a tuple of disjoint pairs
    ``(low, high)``; empty for fewer than 2 ranks."""
    if not isinstance(world_size, int) or world_size < 0:
        raise ValueError(f"world_size must be a whole number >= 0, got {world_size!r}")
    if world_size < 2:
        return ()
    seats = list(range(world_size + world_size % 2))  # the last seat of an odd p is the bye
    n = len(seats)
    rounds = []
    for _ in range(n - 1):
        facing = (tuple(sorted((seats[i], seats[n - 1 - i]))) for i in range(n // 2))
        rounds.append(tuple(sorted(pair for pair in facing if pair[1] < world_size)))
        seats = [seats[0], seats[-1], *seats[1:-1]]
    return tuple(rounds)


def partner_in(pairs: tuple[Pair, ...], rank: int) -> int | None:
    """``rank``'s partner in one round, or ``None`` when it has the bye."""
    for low, high in pairs:
        if rank in (low, high):
            return high if rank == low else low
    return None
