"""Prove that a schedule computes an all-reduce, with bit-identical results on every rank.

The checker replays the schedule on *symbolic* chunks. Rank ``r`` starts with the leaf
``x_r`` in every chunk; a reduce builds the expression ``mine + received``. Floating-point
addition is commutative but not associative, so two expressions give the same bits exactly
when they have the same tree up to swapping the two sides of a ``+``. Expressions are
interned by that canonical form, so "identical on every rank" is an integer comparison.

A schedule passes when, for every chunk:

1. no reduce ever adds a contribution that is already in the partial sum (no rank counted
   twice), and
2. after the last step every rank holds the same expression, made of every rank's
   contribution exactly once.

It also rejects malformed steps: ranks or chunks out of range, a rank sending to itself, and
two receives into the same chunk of the same rank in one step (their order would be a race).
"""

from __future__ import annotations

from dataclasses import dataclass

from .ir import Schedule
from .replay import replay


class ScheduleError(ValueError):
    """A schedule that is malformed or does not compute an all-reduce."""


@dataclass(frozen=True, slots=True)
class _Partial:
    """A symbolic partial sum: an interned expression id and the ranks it contains."""

    expression: int
    ranks: frozenset[int]


class _Interner:
    def __init__(self) -> None:
        self._ids: dict[tuple[int, ...], int] = {}

    def id_of(self, key: tuple[int, ...]) -> int:
        return self._ids.setdefault(key, len(self._ids))


class _CountedTwice(Exception):
    def __init__(self, ranks: frozenset[int]) -> None:
        self.ranks = ranks


def check_all_reduce(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is a bit-identical all-reduce."""
    _check_well_formed(schedule)
    p, chunks = schedule.world_size, schedule.num_chunks
    interner = _Interner()

    def add(mine: _Partial, received: _Partial) -> _Partial:
        if mine.ranks & received.ranks:
            raise _CountedTwice(mine.ranks & received.ranks)
        low, high = sorted((mine.expression, received.expression))
        return _Partial(interner.id_of((low, high)), mine.ranks | received.ranks)

    leaves = [[_Partial(interner.id_of((-1, r)), frozenset({r}))] * chunks for r in range(p)]
    state = tuple(tuple(row) for row in leaves)
    completed = 0
    try:
        for _, _, state in replay(schedule, leaves, add):
            completed += 1
    except _CountedTwice as error:
        raise ScheduleError(
            f"{schedule.algorithm}: step {completed} adds the contribution of rank(s) "
            f"{sorted(error.ranks)} to a partial sum that already holds it"
        ) from None
    everyone = frozenset(range(p))
    for chunk in range(chunks):
        for rank in range(p):
            value = state[rank][chunk]
            if value.ranks != everyone:
                raise ScheduleError(
                    f"{schedule.algorithm}: rank {rank} ends with chunk {chunk} missing the "
                    f"contribution of rank(s) {sorted(everyone - value.ranks)}"
                )
            if value.expression != state[0][chunk].expression:
                raise ScheduleError(
                    f"{schedule.algorithm}: ranks 0 and {rank} sum chunk {chunk} in different "
                    "orders, so their results would differ in the last bits"
                )


def _check_well_formed(schedule: Schedule) -> None:
    p, chunks = schedule.world_size, schedule.num_chunks
    if p < 1:
        raise ScheduleError(f"{schedule.algorithm}: world size must be at least 1, got {p}")
    if chunks < 1:
        raise ScheduleError(f"{schedule.algorithm}: needs at least one chunk, got {chunks}")
    for index, step in enumerate(schedule.steps):
        received: set[tuple[int, int]] = set()
        for t in step.transfers:
            if not (0 <= t.src < p and 0 <= t.dst < p):
                raise ScheduleError(f"{schedule.algorithm}: step {index}: {t} names a rank outside 0..{p - 1}")
            if not 0 <= t.chunk < chunks:
                raise ScheduleError(f"{schedule.algorithm}: step {index}: {t} names a chunk outside 0..{chunks - 1}")
            if t.src == t.dst:
                raise ScheduleError(f"{schedule.algorithm}: step {index}: {t} sends to itself")
            if (t.dst, t.chunk) in received:
                raise ScheduleError(
                    f"{schedule.algorithm}: step {index}: rank {t.dst} receives chunk {t.chunk} twice"
                )
            received.add((t.dst, t.chunk))
