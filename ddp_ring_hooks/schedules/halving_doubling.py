"""Recursive halving-doubling (Rabenseifner): a reduce-scatter and an all-gather in ``lg p`` steps each.

The buffer is split in ``p'`` blocks, ``p'`` the largest power of two ``<= p``. Ranks pair up
across ever smaller distances, and each exchange halves the window of blocks a rank owns::

    reduce-scatter (p'=4)          partner          window kept
    step 0: distance 2             0↔2, 1↔3          0,1: blocks 0-1   2,3: blocks 2-3
    step 1: distance 1             0↔1, 2↔3          rank r: block r

1. Fold (only when ``p`` is not a power of two; ``rem = p - p'``): each even rank
   ``r < 2·rem`` sends its whole buffer to ``r + 1``, which adds it, and then sits out.
   ``p'`` ranks remain; the ``q``-th of them is rank ``2q + 1`` if ``q < rem``, else ``q + rem``.
2. Reduce-scatter, ``lg p'`` steps, the distance halving from ``p'/2`` to 1: partners split
   their window in two, each sends the half it gives up and adds the half it keeps. The
   ``q``-th remaining rank ends owning block ``q``, fully reduced.
3. All-gather, ``lg p'`` steps, the distance doubling from 1 to ``p'/2``: partners swap the
   windows they own (copies), so the windows double back to the whole buffer.
4. Unfold: each rank that sat out receives the result from ``r + 1``.

Every block is summed along one chain and then only copied: bit-identical on every rank.
Cost with ``f = 1`` if ``p`` is not a power of two, else 0:
``(2 lg p' + 2f)α + (2(p'-1)/p' + 2f)nβ + ((p'-1)/p' + f)nγ``. For a power of two that is the
ring's bandwidth term with only ``2 lg p`` latency terms; otherwise the fold costs two more
whole-buffer messages (Thakur, Rabenseifner and Gropp 2005; MPICH's
``allreduce_intra_reduce_scatter_allgather.c``).
"""

from __future__ import annotations

from .ir import Op, Schedule, Step, Transfer
from .registry import CostTerms

FOLD = "fold"
REDUCE_SCATTER = "reduce-scatter"
ALL_GATHER = "all-gather"
UNFOLD = "unfold"


def build_halving_doubling_schedule(world_size: int) -> Schedule:
    """Rabenseifner's all-reduce over ``world_size`` ranks, folding the ranks beyond ``p'``."""
    p = world_size
    pof2 = 1 << (p.bit_length() - 1)
    rem = p - pof2
    blocks = range(pof2)

    def rank_of(q: int) -> int:
        return 2 * q + 1 if q < rem else q + rem

    steps: list[Step] = []
    if rem:
        steps.append(Step(FOLD, tuple(Transfer(r, r + 1, b, Op.REDUCE) for r in range(0, 2 * rem, 2) for b in blocks)))
    windows = {q: (0, pof2) for q in range(pof2)}  # [lo, hi) blocks that q still reduces
    distance = pof2 // 2
    while distance:
        transfers = []
        kept = {}
        for q, (lo, hi) in windows.items():
            middle = (lo + hi) // 2
            keep, give = ((lo, middle), (middle, hi)) if q & distance == 0 else ((middle, hi), (lo, middle))
            transfers += [Transfer(rank_of(q), rank_of(q ^ distance), b, Op.REDUCE) for b in range(*give)]
            kept[q] = keep
        windows = kept
        steps.append(Step(REDUCE_SCATTER, tuple(transfers)))
        distance //= 2
    distance = 1
    while distance < pof2:
        steps.append(Step(ALL_GATHER, tuple(
            Transfer(rank_of(q), rank_of(q ^ distance), b, Op.COPY) for q, window in windows.items() for b in range(*window)
        )))
        windows = {q: _union(window, windows[q ^ distance]) for q, window in windows.items()}
        distance *= 2
    if rem:
        steps.append(Step(UNFOLD, tuple(Transfer(r + 1, r, b, Op.COPY) for r in range(0, 2 * rem, 2) for b in blocks)))
    return Schedule("halving_doubling", p, pof2, tuple(steps))


def _union(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    """Two adjacent windows of blocks as one."""
    return (min(a[0], b[0]), max(a[1], b[1]))


def halving_doubling_cost(world_size: int) -> CostTerms:
    """``(2 lg p' + 2f)α + (2(p'-1)/p' + 2f)nβ + ((p'-1)/p' + f)nγ`` (``f = 1`` when ``p`` is not a power of two)."""
    pof2 = 1 << (world_size.bit_length() - 1)
    fold = 0 if pof2 == world_size else 1
    share = (pof2 - 1) / pof2
    return CostTerms(
        messages=2 * (pof2.bit_length() - 1) + 2 * fold, bytes=2 * share + 2 * fold, reduced=share + fold
    )
