"""All-reduce algorithms as pure data (no torch import), with a registry by name.

``build_schedule("ring", world_size=4)`` returns a :class:`Schedule`; :func:`check_all_reduce`
proves it is an all-reduce. Every algorithm is one :class:`Algorithm` record, registered below
(see :mod:`.registry`): adding one is a schedule file and one entry here.
"""

from __future__ import annotations

import dataclasses
import functools

from .check import ScheduleError, check_all_reduce
from .double_binary_tree import build_double_binary_tree_schedule, double_binary_tree_cost
from .double_binary_tree import segments_for as double_binary_tree_segments_for
from .halving_doubling import build_halving_doubling_schedule, halving_doubling_cost
from .hierarchical import (
    build_hierarchical_schedule, hierarchical_cost, hierarchical_shared_uplink_cost, hierarchical_uplink_cost,
)
from .hierarchical import segments_for as hierarchical_segments_for
from .ir import Op, RankStep, Receive, Schedule, Send, Step, Transfer
from .naive import build_naive_schedule, naive_cost
from .ordering import (
    NEEDS_LINKS, NEEDS_NODES, RANK, RingCrossings, check_node_of, check_ring_order, group_needs, grouped_by_size,
    has_ring_order, parse_numbers,
    ring_crossings, ring_order_of, schedule_nodes, schedule_order, settled,
)
from .registry import (
    BOTH, IN, OUT, Algorithm, CostTerms, Option, algorithm_examples, algorithm_names, both_ways, check_given_options,
    formula_for, get_algorithm,
    options_by_name, options_for, register_algorithm, resolve_options, shape_options, sized_options,
)
from .replay import final_state, replay
from .ring import build_ring_schedule, ring_busiest_sends, ring_cost, ring_shared_uplink_cost, ring_uplink_cost
from .tree import build_tree_schedule, tree_cost
from .wire import WIRE_BYTES, WIRE_DTYPE, is_narrow, wire_of, wire_ratio, with_wire


def _positive_int(value: object) -> str | None:
    return None if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else "must be an integer >= 1"


def _positive_int_or_by_size(value: object) -> str | None:
    return None if value is None else _positive_int(value)


def _ranks_per_node(value: object) -> str | None:
    if value is None:
        return "is missing: pass local_size=G (ranks per node), or run under torchrun, which sets LOCAL_WORLD_SIZE"
    return _positive_int(value)


def _proper_divisors(world_size: int) -> tuple[int, ...]:
    return tuple(g for g in range(2, world_size) if world_size % g == 0)


#: The ring's order (see ``schedules/ordering.py``): shared by the ring and the rings inside hierarchical.
RING_ORDER = (
    Option("ring_order", RANK, "the order the ring visits the ranks: rank (0, 1, ..., p-1), hosts (grouped by "
           "node), measured (the fastest ring by a probe of the links), or the ranks in ring order, e.g. 0,2,1,3",
           check=check_ring_order, label="ring order {}", metavar="rank|hosts|measured|R0,R1,...", parse=parse_numbers),
    Option("node_of", None, "for ring order hosts: the node of each rank, e.g. 0,0,1,1 (default: each rank's "
           "GROUP_RANK, gathered across the ranks)", check=check_node_of, label="node_of {}",
           metavar="N0,N1,...", parse=parse_numbers),
)


register_algorithm(Algorithm(
    "ring", "reduce-scatter then all-gather around a ring: 2(p-1) messages of n/p",
    build=build_ring_schedule, cost=ring_cost, busiest_sends=ring_busiest_sends, link_directions=both_ways,
    uplink_cost=ring_shared_uplink_cost,
    layout="ring", options=(*RING_ORDER, WIRE_DTYPE),
    # The reversed order of a ring of 3+ ranks is a different ring (a permutation the grids run).
    examples=lambda p: ({},) if p < 3 else ({}, {"ring_order": tuple(reversed(range(p)))}),
))
register_algorithm(Algorithm(
    "naive", "every rank sends its buffer to rank 0, which sums and sends the result back",
    build=build_naive_schedule, cost=naive_cost, layout="star", options=(WIRE_DTYPE,),
))
register_algorithm(Algorithm(
    "tree", "binomial-tree reduce to rank 0, then broadcast, pipelined in segments",
    build=build_tree_schedule, cost=tree_cost, layout="tree",
    options=(Option("segments", 1, "pipeline the buffer in K segments", check=_positive_int, label="{} segments",
                    metavar="K"), WIRE_DTYPE),
    examples=lambda p: ({"segments": 1}, {"segments": 3}),
))
register_algorithm(Algorithm(
    "double_binary_tree", "NCCL's two binary trees, each reducing and broadcasting half the buffer, pipelined",
    build=build_double_binary_tree_schedule, cost=double_binary_tree_cost, layout="trees",
    options=(Option("segments", None, "pipeline each tree's half in K segments", check=_positive_int_or_by_size,
                    label="{} segments", metavar="K", per_size=double_binary_tree_segments_for), WIRE_DTYPE),
    examples=lambda p: ({"segments": 1}, {"segments": 3}),
))
register_algorithm(Algorithm(
    "halving_doubling", "Rabenseifner: recursive halving reduce-scatter, doubling all-gather",
    build=build_halving_doubling_schedule, cost=halving_doubling_cost, layout="ring", options=(WIRE_DTYPE,),
))
register_algorithm(Algorithm(
    "hierarchical", "rings inside each node, a ring across nodes on a 1/G shard",
    build=build_hierarchical_schedule, cost=hierarchical_cost, uplink_cost=hierarchical_shared_uplink_cost, layout="nodes",
    link_directions=both_ways,  # rings inside the nodes and across them: both ways in every step
    options=(Option("local_size", None, "ranks per node; must divide the world size", check=_ranks_per_node,
                    environment="LOCAL_WORLD_SIZE", label="{}/node", metavar="G"),
             Option("segments", None, "pipeline the buffer in K segments", check=_positive_int_or_by_size,
                    label="{} segments", metavar="K", per_size=hierarchical_segments_for),
             *RING_ORDER, WIRE_DTYPE),
    # Only a true hierarchy (several nodes of several ranks) differs from a ring.
    applies=lambda p, options: options["local_size"] in _proper_divisors(p),
    examples=lambda p: tuple({"local_size": g} for g in _proper_divisors(p)) + tuple(
        {"local_size": g, "segments": 3} for g in _proper_divisors(p)[:1]
    ) + tuple(
        {"local_size": g, "ring_order": "hosts", "node_of": tuple(r % (p // g) for r in range(p))}
        for g in _proper_divisors(p)[:1]
    ),
))

register_algorithm(Algorithm(
    "native", "the process group's own all_reduce (NCCL's or gloo's), timed by the hook",
    # No schedule and no formula: NCCL and gloo choose their algorithm inside. Both run rings
    # for large buffers, so calibration fits its own α, β with the ring's shape.
    # With a narrower wire dtype it is PyTorch's bf16/fp16_compress_hook: cast, the group's
    # all_reduce in that dtype, cast back (runtime/native.py).
    build=None, cost=None, priced_as="ring", options=(WIRE_DTYPE,),
))

#: Names of the algorithms that run a schedule (what ``ddp_ring_hooks.ALGORITHMS`` lists).
ALGORITHMS: tuple[str, ...] = algorithm_names(scheduled_only=True)


def build_schedule(algorithm: str, world_size: int, *, nbytes: int = 0, **options) -> Schedule:
    """Build the schedule of ``algorithm`` for ``world_size`` ranks; it carries its resolved options.

    ``nbytes``: the buffer it will run on, for the options chosen by size (``Option.per_size``:
    hierarchical's ``segments``); the default, 0, gives their value for the smallest buffer.
    Raises ``ValueError`` naming the known algorithms when ``algorithm`` is unknown, and
    ``TypeError`` naming the valid options for an unknown option.
    """
    record = get_algorithm(algorithm)
    if record.build is None:
        raise ValueError(f"the {algorithm} algorithm has no schedule: it runs the process group's own all-reduce")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    resolved = resolve_options(algorithm, options, nbytes=nbytes)
    schedule = record.build(world_size, **shape_options(algorithm, resolved))
    # What the builder resolved further (a ring order's permutation) wins over what it was given.
    return dataclasses.replace(schedule, options=tuple(sorted({**resolved, **dict(schedule.options)}.items())))


def checked_schedule(algorithm: str, world_size: int, *, nbytes: int = 0, **options) -> Schedule:
    """:func:`build_schedule`, proven correct by :func:`check_all_reduce` once, then cached
    (a list option, such as a ring order, is taken as the tuple it equals). ``nbytes``: the
    buffer's size, for the options chosen by size; schedules are cached by the value chosen,
    not by the size."""
    sized = sized_options(algorithm, options, nbytes)
    frozen = {name: tuple(value) if isinstance(value, list) else value for name, value in sized.items()}
    return _checked_schedule(algorithm, world_size, **frozen)


@functools.lru_cache(maxsize=128)
def _checked_schedule(algorithm: str, world_size: int, **options) -> Schedule:
    schedule = build_schedule(algorithm, world_size, **options)
    check_all_reduce(schedule)
    return schedule


checked_schedule.cache_clear = _checked_schedule.cache_clear  # as functools.lru_cache names it: forget them all


__all__ = [
    "ALGORITHMS", "Algorithm", "BOTH", "CostTerms", "IN", "OUT", "both_ways", "Option", "Op", "RankStep", "Receive", "RingCrossings", "Schedule",
    "ScheduleError", "Send",
    "Step", "Transfer", "build_double_binary_tree_schedule", "build_halving_doubling_schedule", "build_hierarchical_schedule",
    "build_naive_schedule", "build_ring_schedule", "build_tree_schedule", "build_schedule", "check_all_reduce",
    "algorithm_examples", "algorithm_names", "check_given_options", "checked_schedule", "final_state", "formula_for",
    "NEEDS_LINKS", "NEEDS_NODES", "get_algorithm", "group_needs", "grouped_by_size", "has_ring_order", "hierarchical_uplink_cost", "options_by_name", "options_for", "register_algorithm", "replay",
    "resolve_options", "ring_crossings", "ring_order_of", "ring_uplink_cost",
    "schedule_nodes", "schedule_order", "settled", "shape_options", "sized_options",
    "WIRE_BYTES", "WIRE_DTYPE", "is_narrow", "wire_of", "wire_ratio", "with_wire",
]
