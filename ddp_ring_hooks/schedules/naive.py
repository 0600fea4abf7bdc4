"""Naive ("send everything to a master") all-reduce: the baseline every other algorithm beats.

Rank 0 is the master. It talks to one rank at a time, in rank order, so its single port is
the bottleneck::

        reduce (p-1 steps)            broadcast (p-1 steps)
    1 ─┐                           ┌─▶ 1
    2 ─┼─▶ 0   x0+x1, +x2, +x3     0 ─┼─▶ 2
    3 ─┘   one message per step    └─▶ 3

1. Reduce, ``p - 1`` steps. In step ``s`` rank ``s + 1`` sends its whole buffer to rank 0,
   which adds it: rank 0 ends with ``((x0 + x1) + x2) + ...``, summed in rank order.
2. Broadcast, ``p - 1`` steps. In step ``s`` rank 0 sends the sum to rank ``s + 1``, which
   overwrites its buffer.

The buffer is one chunk. Rank 0 moves ``2(p - 1)`` whole buffers one after the other, so in
the α-β-γ model the time is ``2(p-1)(α + nβ) + (p-1)nγ``: linear in ``p`` in *both* latency
and bandwidth, where the ring is linear only in latency. The sum is formed in one place and
then copied, so every rank ends with bit-identical values.
"""

from __future__ import annotations

from .ir import Op, Schedule, Step, Transfer
from .registry import CostTerms

REDUCE = "reduce"
BROADCAST = "broadcast"
ROOT = 0


def build_naive_schedule(world_size: int) -> Schedule:
    """The master all-reduce over ``world_size`` ranks: ``2(p - 1)`` steps of one message."""
    p = world_size
    others = range(1, p)
    gather = [Step(REDUCE, (Transfer(rank, ROOT, 0, Op.REDUCE),)) for rank in others]
    scatter = [Step(BROADCAST, (Transfer(ROOT, rank, 0, Op.COPY),)) for rank in others]
    return Schedule("naive", p, 1, tuple(gather + scatter))


def naive_cost(world_size: int) -> CostTerms:
    """``2(p-1)(α + nβ) + (p-1)nγ``: the root sends or receives ``2(p - 1)`` whole buffers, one at a time."""
    p = world_size
    return CostTerms(messages=2 * (p - 1), bytes=2 * (p - 1), reduced=p - 1)
