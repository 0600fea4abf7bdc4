"""What a hook state makes per rank, counted from what ``GroupContext.prepare`` makes (no ranks run).

On CPU (gloo) a rank holds the group's own sockets (gloo's full mesh: ``p - 1``, there before
the hook) and, for the hook, one socket per pair of ranks its algorithm's schedule sends on both
ways (``runtime/group_context.py::two_way_pairs``: a 2-rank gloo transport each, no thread).
Before the group context, every CPU group got a second full mesh (``p - 1`` sockets and one
gloo worker thread per rank, ``p(p-1)/2`` TCP connections per job) whatever the algorithm::

    python benchmarks/group_resources.py --world-sizes 64,256

prints, per world size and algorithm (the registry's example options; hierarchical as nodes
of 2 and of 8), the hook's sockets per rank (the busiest rank's, and the mean), the TCP
connections of the job, and the same before. Threads per rank are the same for every algorithm
with a schedule: ``concurrent_buckets`` lanes (2) and, with ``spread_every``, the exchange worker;
the watchers' (the stall watchdog's 2, the telemetry writer) come with any algorithm, ``native``
included.
"""

from __future__ import annotations

import argparse

from ddp_ring_hooks.runtime.group_context import two_way_pairs
from ddp_ring_hooks.schedules import algorithm_names, build_schedule, get_algorithm, resolve_options


def cases(world_size: int):
    for algorithm in algorithm_names():
        if get_algorithm(algorithm).build is None:
            yield algorithm, {}, None  # native: no schedule
        elif algorithm == "hierarchical":
            for local_size in (2, 8):
                yield algorithm, {"local_size": local_size}, f"nodes of {local_size}"
        else:
            yield algorithm, {}, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", default="64,256", help="comma-separated world sizes (default: 64,256)")
    args = parser.parse_args()
    print(f"{'ranks':>5}  {'algorithm':<28} {'hook sockets/rank: max':>22} {'mean':>6} {'connections':>11}"
          f"   {'before: sockets/rank':>20} {'connections':>11}")
    for world_size in (int(p) for p in args.world_sizes.split(",")):
        mesh = world_size - 1
        for algorithm, options, note in cases(world_size):
            if get_algorithm(algorithm).build is None:
                pairs = frozenset()
            else:
                schedule = build_schedule(algorithm, world_size, **resolve_options(algorithm, options, nbytes=0))
                pairs = two_way_pairs([schedule])
            per_rank = [sum(rank in pair for pair in pairs) for rank in range(world_size)]
            name = algorithm + (f" ({note})" if note else "")
            print(f"{world_size:>5}  {name:<28} {max(per_rank):>22} {sum(per_rank) / world_size:>6.2f} {len(pairs):>11}"
                  f"   {mesh:>20} {world_size * mesh // 2:>11}")


if __name__ == "__main__":
    main()
