"""Double binary tree all-reduce (NCCL's): two binary trees, each reducing and broadcasting half.

A single tree is latency-lean (``lg p`` levels) but wastes bandwidth: the binomial tree's root
sends ``⌈lg p⌉`` whole buffers, and in a binary tree half the ranks are leaves whose links
carry one message each way while the inner ranks carry three. Two binary trees over the same
ranks fix that when the second tree turns the first one's leaves into its inner ranks: every
rank then works hard in one tree and rests as a leaf in the other, and each tree carries half
of the buffer (Sanders, Speck and Träff 2009; NCCL 2.4)::

    tree 0: first half (chunks 0..k-1)      tree 1: second half (chunks k..2k-1),
                                                    the mirror r -> p-1-r
              0                                       7
              │                                       │
              4                                       3
            ╱   ╲                                   ╱   ╲
           2     6                                 5     1
          ╱ ╲   ╱ ╲                               ╱ ╲   ╱ ╲
         1   3 5   7                             6   4 2   0

    inner ranks: 0 2 4 6 (tree 0), 1 3 5 7 (tree 1); each rank is a leaf in the other tree

1. The first tree is NCCL's (``ncclGetBtree`` in ``src/graph/trees.cc``): an in-order binary
   tree over ranks ``1..p-1``, hung below rank 0, the root, which has that one child. Rank
   ``r`` with lowest set bit ``b`` hangs below ``r`` with that bit moved up one place
   (``..01[0]`` and ``..11[0]`` below ``..10[0]``), or below ``r - b`` when that rank does not
   exist. Its leaves are the odd ranks.
2. The second tree is the first one relabelled: mirrored (``r -> p-1-r``) when ``p`` is even,
   which maps the odd leaves onto the even ranks, and shifted by one (``r -> r+1 mod p``) when
   ``p`` is odd, as NCCL does. So every rank is inner in at most one tree, except rank 0 for
   odd ``p``, whose extra role is the first tree's root with a single child: no rank sends or
   receives more than one half-buffer per tree phase. (At ``p = 3`` the trees are chains and
   the shifted one would send both halves over the link 2 -> 0, so ``p = 3`` is mirrored too:
   its two chains swap root and middle, ranks 0 and 2, with one child each: just as light.)
3. Reduce, pipelined: each half is cut into ``k`` segments (``segments=k``, chunk ``j`` of
   tree 0 and chunk ``k + j`` of tree 1), and both trees run in the same steps. Segment ``j``
   goes up edge ``e`` at step ``o(e) + j``: a rank sends a segment once both its children have
   added theirs, and its two children take turns (a rank may not receive the same chunk twice
   in one step: the order of the two additions would be a race), so each level costs two steps.
   One segment takes ``U = 2⌈lg p⌉ - 2`` steps to reach the root, one more when ``p`` is a
   power of two (then the top rank's two subtrees are complete and finish together).
4. Broadcast: the root sends the summed segment down, each rank copies it and passes it to both
   children in the same step, one level per step: ``⌈lg p⌉`` steps for one segment.
5. How many segments: without ``segments`` given, by the buffer (:func:`segments_for`): one
   segment of each half per :data:`SEGMENT_BYTES`, at most :data:`MAX_SEGMENTS`, as NCCL
   pipelines its trees in chunks of a fixed size, so that the pipeline deepens with the buffer
   and a small buffer pays no extra steps.

Each chunk is summed along one tree and then only copied: bit-identical on every rank.

Cost: every step moves one ``n/2k`` segment per link, so with ``L = ⌈lg p⌉``, counting each
link on its own::

    (U + k - 1 + L + k - 1)(α + nβ/2k) + (U + k - 1)·nγ/2k       U = 2L - 2 (+1 for p = 2^L)

Latency ``≈ 3 lg p`` steps (the ring pays ``2(p - 1)``, the binomial tree ``2⌈lg p⌉``). A rank
uses up to four links at once, though, and a host with one NIC shares it among them. Counted
per NIC (each rank's send and receive bandwidth shared by its links: ``cost_model.simulate``
with ``shared_uplinks=True`` and every rank its own node): an inner rank of one tree receives
two halves and sends one in the reduce, the leaf of the other sends one, so each rank sends and
receives at most ``n`` per phase, ``2n`` in all, and once ``k`` is large enough to fill the
pipeline the time tends to ``2nβ``: ``p/(p-1)`` times the ring's ``2(p-1)/p·nβ``, the lower bound.
The binomial tree's root moves ``⌈lg p⌉·n`` each way instead. Per link the formula above drops
to ``nβ`` for large ``k``: that is the model's independent links, not a real NIC. So the
registry's cost (:func:`double_binary_tree_cost`, what ``predict``, ``model``, ``auto`` and the
advisor price) counts the β term per NIC, from the schedule; its α and γ terms are the per-link
ones above (one segment per link and step).
"""

from __future__ import annotations

import functools
from collections import Counter

from .ir import Op, Schedule, Step, Transfer
from .registry import CostTerms

REDUCE = "reduce"
BROADCAST = "broadcast"
#: Many messages in one small call: the advisor's probe times it beside the run's own schedule to
#: tell a call's cost from a message's (``runtime/network_probe.py``; 16 messages at p = 2).
MANY_MESSAGES = ("double_binary_tree", (("segments", 8),))

#: ``parent[r]``: the rank ``r`` sends its partial sums to; ``None`` for the root.
Parents = tuple["int | None", ...]


#: Without ``segments`` given: one segment of each half per this many bytes ...
SEGMENT_BYTES = 256 << 10
#: ... and at most this many (each costs two more steps, one per phase).
MAX_SEGMENTS = 32


def segments_for(nbytes: int) -> int:
    """The pipeline depth for an ``nbytes`` buffer when none is given: halves of ``nbytes / 2``
    in pieces of :data:`SEGMENT_BYTES` (measured on the lab's 4 hosts at 400 Mbit/s, 16 MiB: 1.53x
    the link limit at 16 segments, 1.42-1.52x at 32, 1.87x at 64, where the steps' latency
    takes over; ``docs/algorithms.md``)."""
    return max(1, min(MAX_SEGMENTS, nbytes // (2 * SEGMENT_BYTES)))


def build_double_binary_tree_schedule(world_size: int, *, segments: int | None = None) -> Schedule:
    """Two binary trees, each reducing then broadcasting half of the buffer in ``segments``
    pieces (default 1: no size is known here; see :func:`segments_for`)."""
    segments = 1 if segments is None else segments
    if not isinstance(segments, int) or segments < 1:
        raise ValueError(f"double_binary_tree needs segments >= 1 (pipelined pieces of each half), got {segments!r}")
    k = segments
    trees = double_binary_trees(world_size)
    # Per tree, (child, parent, offset): segment j crosses the edge at step offset + j.
    up = [[(child, tree[child], offset) for child, offset in _reduce_offsets(tree).items()] for tree in trees]
    depth = [_depths(tree) for tree in trees]
    down = [[(child, tree[child], depth[half][tree[child]]) for child in range(world_size) if tree[child] is not None]
            for half, tree in enumerate(trees)]
    reduce_steps = [
        Step(REDUCE, tuple(
            Transfer(child, parent, half * k + t - offset, Op.REDUCE)
            for half, edges in enumerate(up) for child, parent, offset in edges if 0 <= t - offset < k
        ))
        for t in range(_span(up, k))
    ]
    broadcast_steps = [
        Step(BROADCAST, tuple(
            Transfer(parent, child, half * k + t - offset, Op.COPY)
            for half, edges in enumerate(down) for child, parent, offset in edges if 0 <= t - offset < k
        ))
        for t in range(_span(down, k))
    ]
    return Schedule("double_binary_tree", world_size, 2 * k, tuple(reduce_steps + broadcast_steps))


def double_binary_trees(world_size: int) -> tuple[Parents, Parents]:
    """The two trees, as each rank's parent: NCCL's binary tree and its mirror (or shift)."""
    first = binary_tree(world_size)
    p = world_size
    relabel = (lambda r: p - 1 - r) if p % 2 == 0 or p == 3 else (lambda r: (r + 1) % p)
    second: list[int | None] = [None] * p
    for rank, parent in enumerate(first):
        second[relabel(rank)] = None if parent is None else relabel(parent)
    return first, tuple(second)


def binary_tree(world_size: int) -> Parents:
    """NCCL's ``ncclGetBtree``: rank 0 on top with one child, below it an in-order binary tree
    over ranks ``1..p-1`` whose leaves are the odd ranks (see the module docstring)."""
    parents: list[int | None] = [None] * world_size
    for rank in range(1, world_size):
        bit = rank & -rank  # the lowest set bit
        parent = (rank ^ bit) | (bit << 1)  # ...01[0] and ...11[0] both hang below ...10[0]
        parents[rank] = parent if parent < world_size else rank ^ bit  # no such rank: one level up
    return tuple(parents)


def _reduce_offsets(parents: Parents) -> dict[int, int]:
    """Step at which each rank sends segment 0 up: as soon as its children's sums are in, the
    children of one rank at different steps (the earlier-ready child first)."""
    children: dict[int, list[int]] = {rank: [] for rank in range(len(parents))}
    for rank, parent in enumerate(parents):
        if parent is not None:
            children[parent].append(rank)
    offsets: dict[int, int] = {}

    def ready(rank: int) -> int:  # the first step at which ``rank`` holds its subtree's sum
        arrivals = sorted((ready(child), child) for child in children[rank])
        last = -1
        for earliest, child in arrivals:
            offsets[child] = last = max(earliest, last + 1)
        return last + 1

    for root in (rank for rank, parent in enumerate(parents) if parent is None):
        ready(root)
    return offsets


def _depths(parents: Parents) -> dict[int, int]:
    """Edges from the root to each rank."""
    depth: dict[int, int] = {}

    def of(rank: int) -> int:
        if rank not in depth:
            parent = parents[rank]
            depth[rank] = 0 if parent is None else of(parent) + 1
        return depth[rank]

    for rank in range(len(parents)):
        of(rank)
    return depth


def _span(edges: list[list[tuple[int, int | None, int]]], segments: int) -> int:
    """Steps of a phase: the last edge's offset, then ``segments`` pieces one step apart."""
    last = max((offset for tree in edges for _, _, offset in tree), default=None)
    return 0 if last is None else last + segments


def double_binary_tree_cost(world_size: int, *, segments: int | None = None) -> CostTerms:
    """``(U + L + 2k - 2)·α + c·nβ + (U + k - 1)·nγ/2k`` with ``L = ⌈lg p⌉``, ``U = 2L - 2`` (plus
    one when ``p`` is a power of two): the reduce takes ``U + k - 1`` steps, the broadcast
    ``L + k - 1``, each moving one segment of ``n/2k`` per link; and, counted per NIC (a rank's
    links share its network: ``c`` is, over the steps, the most segments one rank sends or
    receives in each, over ``2k``), ``c → 2`` as ``k`` grows (1 segment a step while the
    pipeline fills, 2 once both trees stream through a rank). Per NIC, not per link, because
    the trees' whole point is to keep every rank's links busy at once: counted per link, deep
    pipelines would look twice as fast as they run (and ``auto`` would pick them over the ring)."""
    if world_size == 1:
        return CostTerms()
    k = 1 if segments is None else segments
    levels = (world_size - 1).bit_length()  # ⌈lg p⌉
    up = 2 * levels - 2 + (world_size & (world_size - 1) == 0)
    reduce_steps, broadcast_steps = up + k - 1, levels + k - 1
    steps = reduce_steps + broadcast_steps
    return CostTerms(messages=steps, bytes=_busiest_nic_segments(world_size, k) / (2 * k), reduced=reduce_steps / (2 * k))


@functools.lru_cache(maxsize=64)
def _busiest_nic_segments(world_size: int, segments: int) -> int:
    """Over the steps, the most segments one rank sends or receives in each (counted on the schedule)."""
    total = 0
    for step in build_double_binary_tree_schedule(world_size, segments=segments).steps:
        sent = Counter(t.src for t in step.transfers)
        received = Counter(t.dst for t in step.transfers)
        total += max(max(sent.values()), max(received.values()))
    return total
