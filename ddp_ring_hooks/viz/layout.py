"""Where to draw each rank: the algorithm's own picture of the network.

::

    ring            tree              star (naive)       nodes (hierarchical)
      0               0                   1              ┌─────┐   ┌─────┐
    3   1           1   2              4  0  2           │ 0 1 │───│ 4 5 │
      2            3 4 5 6                3              │ 2 3 │   │ 6 7 │
                                                         └─────┘   └─────┘
    trees (double binary tree, 8 ranks): the first tree hangs down from its root 0, the
    second grows up from its root 7; each tree's leaves are the other one's inner ranks
      0
              4                   x: the rank (both are in-order trees over the ranks)
          2       6               y: depth in the second tree - depth in the first
        1       5
            3
                  7

The trees and the star are read off the schedule itself (a rank's first reduce of a chunk
goes to its parent in that chunk's tree; the star's centre is the rank in most transfers), so
they show the trees the schedule really uses. Any algorithm without a layout of its own is drawn on a ring. Coordinates are in
units of the ring radius; the drawing scales them to fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..schedules import Op, Schedule, get_algorithm, schedule_order

Point = tuple[float, float]


@dataclass(frozen=True, slots=True)
class Layout:
    """Rank positions, the links to draw between them, and groups of ranks (nodes) to box."""

    kind: str
    positions: tuple[Point, ...]
    links: tuple[tuple[int, int], ...] = ()
    groups: tuple[tuple[int, ...], ...] = ()


def choose_layout(schedule: Schedule) -> Layout:
    """The layout its registry record names for ``schedule.algorithm``: ring, tree, star or
    nodes (drawn with the ``local_size`` the schedule was built with)."""
    try:
        kind = get_algorithm(schedule.algorithm).layout
    except ValueError:  # a hand-made or recorded schedule of no registered algorithm
        kind = "ring"
    if kind == "tree":
        return layout_tree(schedule)
    if kind == "star":
        return layout_star(schedule)
    if kind == "trees":
        return layout_trees(schedule)
    local_size = dict(schedule.options).get("local_size")
    order = schedule_order(schedule)
    if kind == "nodes" and local_size and local_size < schedule.world_size:
        return layout_nodes(schedule.world_size, local_size, order=order)
    return layout_ring(schedule.world_size, order=order)


def layout_ring(world_size: int, *, order: tuple[int, ...] | None = None) -> Layout:
    """Ranks clockwise on a circle in ring order (``order[i]`` in place ``i``, default the rank
    order), the first at the top; each rank linked to the next."""
    order = order or tuple(range(world_size))
    positions: list[Point] = [(0.0, 0.0)] * world_size
    for place, rank in enumerate(order):
        positions[rank] = _on_circle(place, world_size, radius=1.0)
    links = tuple((order[i], order[(i + 1) % world_size]) for i in range(world_size)) if world_size > 1 else ()
    return Layout("ring", tuple(positions), links)


def layout_star(schedule: Schedule) -> Layout:
    """The busiest rank (the naive algorithm's root) in the middle, the others around it."""
    p = schedule.world_size
    busy = [0] * p
    for step in schedule.steps:
        for t in step.transfers:
            busy[t.src] += 1
            busy[t.dst] += 1
    centre = max(range(p), key=lambda r: (busy[r], -r), default=0)
    others = [r for r in range(p) if r != centre]
    positions: list[Point] = [(0.0, 0.0)] * p
    for slot, rank in enumerate(others):
        positions[rank] = _on_circle(slot, len(others), radius=1.0)
    return Layout("star", tuple(positions), tuple((centre, r) for r in others))


def layout_tree(schedule: Schedule) -> Layout:
    """The reduction tree of ``schedule``, root on top; a heap-shaped tree if none is found."""
    p = schedule.world_size
    parents = _parents_from_schedule(schedule) or {r: (r - 1) // 2 for r in range(1, p)}
    children: dict[int, list[int]] = {r: [] for r in range(p)}
    for child, parent in sorted(parents.items()):
        children[parent].append(child)
    root = next(r for r in range(p) if r not in parents)
    x: dict[int, float] = {}
    depth: dict[int, int] = {root: 0}
    leaves = [0]

    def place(rank: int) -> None:
        for child in children[rank]:
            depth[child] = depth[rank] + 1
            place(child)
        if children[rank]:
            x[rank] = sum(x[c] for c in children[rank]) / len(children[rank])
        else:
            x[rank] = leaves[0]
            leaves[0] += 1

    place(root)
    width = max(leaves[0] - 1, 1)
    height = max(max(depth.values()), 1)
    positions = tuple((2 * x[r] / width - 1 if p > 1 else 0.0, 1 - 2 * depth[r] / height) for r in range(p))
    return Layout("tree", positions, tuple(sorted((parent, child) for child, parent in parents.items())))


def layout_trees(schedule: Schedule) -> Layout:
    """Two trees over the same ranks: the tree of the first chunk and that of the last.

    Rank ``r`` sits at ``x = r`` and at height ``depth in the second tree - depth in the
    first``: the first tree's root on top with its inner ranks below it, the second tree's
    root at the bottom with its inner ranks above it, and each tree's leaves (the other
    tree's inner ranks) in the other half. Links: the edges of both trees.
    """
    p = schedule.world_size
    trees = [_parents_from_schedule(schedule, chunk=c) for c in (0, schedule.num_chunks - 1)]
    if p == 1 or None in trees:
        return layout_ring(p)
    first, second = (_depths(parents) for parents in trees)
    heights = [second[r] - first[r] for r in range(p)]
    tallest = max(max(map(abs, heights)), 1)
    positions = tuple((2 * r / (p - 1) - 1, heights[r] / tallest) for r in range(p))
    links = sorted({tuple(sorted(edge)) for parents in trees for edge in parents.items()})
    return Layout("trees", positions, tuple(links))


def layout_nodes(world_size: int, local_size: int, *, order: tuple[int, ...] | None = None) -> Layout:
    """Nodes of ``local_size`` ranks consecutive in ``order`` (default the rank order), each a
    small ring, the nodes on a grid.

    Links: each node's ring, and a ring through the first rank of every node.
    """
    order = order or tuple(range(world_size))
    groups = tuple(order[start:start + local_size] for start in range(0, world_size, local_size))
    columns = math.ceil(math.sqrt(len(groups)))
    spacing = 4.0  # node centres apart, in units of a node's own ring radius: room for the boxes
    positions: list[Point] = [(0.0, 0.0)] * world_size
    links: list[tuple[int, int]] = []
    for index, group in enumerate(groups):
        row, column = divmod(index, columns)
        cx, cy = column * spacing, -row * spacing
        for slot in range(len(group)):
            # Two ranks side by side rather than stacked: rank boxes are wider than tall.
            start = math.pi if len(group) == 2 else math.pi / 2
            dx, dy = _on_circle(slot, len(group), radius=1.0 if len(group) > 1 else 0.0, start=start)
            positions[group[slot]] = (cx + dx, cy + dy)
        if len(group) > 1:
            links += [(group[i], group[(i + 1) % len(group)]) for i in range(len(group))]
    leaders = [group[0] for group in groups]
    if len(leaders) > 1:
        links += [(leaders[i], leaders[(i + 1) % len(leaders)]) for i in range(len(leaders))]
    return Layout("nodes", tuple(positions), tuple(links), groups)


def _on_circle(index: int, count: int, *, radius: float, start: float = math.pi / 2) -> Point:
    """Clockwise from the angle ``start`` (the top by default)."""
    angle = start - 2 * math.pi * index / max(count, 1)
    return (radius * math.cos(angle), radius * math.sin(angle))


def _parents_from_schedule(schedule: Schedule, *, chunk: int | None = None) -> dict[int, int] | None:
    """Each rank's first reduce target (of ``chunk``, or of any chunk), if those links form
    one tree over all ranks."""
    parents: dict[int, int] = {}
    for step in schedule.steps:
        for t in step.transfers:
            if t.op is Op.REDUCE and t.src not in parents and chunk in (None, t.chunk):
                parents[t.src] = t.dst
    if len(parents) != schedule.world_size - 1:
        return None
    for rank in parents:
        seen = {rank}
        while rank in parents:
            rank = parents[rank]
            if rank in seen:
                return None  # a cycle: these reduces do not form a tree
            seen.add(rank)
    return parents


def _depths(parents: dict[int, int]) -> dict[int, int]:
    """Edges between each rank and the root of the tree ``parents`` describes."""
    depth: dict[int, int] = {}
    for rank in [*parents, *parents.values()]:
        hops, above = 0, rank
        while above in parents:
            above, hops = parents[above], hops + 1
        depth[rank] = hops
    return depth

