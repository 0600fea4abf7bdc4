"""``ddp-ring-hooks advise LOG_DIR``: what to change, predicted from one run's timeline.

Reads ``LOG_DIR/timeline.jsonl`` (written by ``register(model, log_dir=LOG_DIR)`` or
``RingDDPStrategy(log_dir=LOG_DIR)``) and prints what-if tables (bucket_cap_mb,
accumulation, algorithm, world size) and the one change with the largest predicted gain::

    ddp-ring-hooks advise runs/ring                                   # this run's network
    ddp-ring-hooks advise runs/ring --network bench.json              # `bench --json` of the target cluster
    ddp-ring-hooks advise runs/ring --latency 5us --bandwidth 25GB/s  # or two numbers
    ddp-ring-hooks advise runs/ring --latency 200us --bandwidth 400Mb/s --placement 2 \
        --local-latency 50us --local-bandwidth 1GB/s                  # or two tiers: nodes of 2 share an uplink
    ddp-ring-hooks advise runs/ring --placement 2 --local-bandwidth 1GB/s  # the uplink: this run's own network
    ddp-ring-hooks advise runs/ring --json                            # the stable JSON shape

A directory of several runs (the main job's ``runs/accumulation_sweep/version_N``, one run
per k and round) is listed, and the first run in it is advised on; pass one run's directory
for another.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from ..advisor import advise, format_advice, from_bench, from_latency_bandwidth, from_two_tier
from . import fail
from .model import links_from_flags, parse_bandwidth, parse_time, two_tier_network


def add_parser(subparsers) -> None:
    """Add ``advise`` to the CLI."""
    parser = subparsers.add_parser(
        "advise",
        help="what to change (bucket size, accumulation, algorithm, world size), predicted from a run's log_dir",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("log_dir", metavar="LOG_DIR", help="the run's log_dir (holds timeline.jsonl), or the file itself")
    parser.add_argument("--network", metavar="FILE", help="`ddp-ring-hooks bench --json` output from the target cluster")
    parser.add_argument("--latency", help="per-message latency of the target network, e.g. 5us (with --bandwidth)")
    parser.add_argument("--bandwidth", help="link bandwidth of the target network, e.g. 25GB/s (with --latency)")
    parser.add_argument("--placement", metavar="G|N0,N1,...",
                        help="two tiers: nodes of G consecutive ranks, or the node of each rank, whose ranks share one "
                             "uplink (--latency/--bandwidth; without them, this run's own network)")
    parser.add_argument("--local-latency", help="two tiers: latency inside a node (default: --latency)")
    parser.add_argument("--local-bandwidth", help="two tiers: bandwidth inside a node (default: --bandwidth)")
    parser.add_argument("--json", action="store_true", help="print the advice as JSON (the stable shape)")
    parser.set_defaults(func=run)


def placed_on_this_run(records, args: argparse.Namespace):
    """Two tiers from a run on one: each node's uplink is the network this run measured (its
    probe, else its buckets' fit), shared by the node's ranks; inside a node
    ``--local-latency``/``--local-bandwidth`` (each defaulting to the uplink's)."""
    from dataclasses import replace

    from ..advisor import step_model
    from ..cost_model import Links

    measured = step_model(records).network
    uplink = measured.calibration(records[0].algorithm)
    local = None
    if args.local_latency or args.local_bandwidth:
        local = Links(parse_time(args.local_latency) if args.local_latency else uplink.alpha,
                      1 / parse_bandwidth(args.local_bandwidth) if args.local_bandwidth else uplink.beta)
    network = from_two_tier(two_tier_network(args.placement, replace(uplink, local=local)))
    return replace(network, laid_out_from=measured,
                   source=f"{network.source.replace('given, ', '', 1)}; the uplink is this run's own network "
                          f"({measured.source.split(':')[0]}), one tier measured, two predicted")


def network_from_args(args: argparse.Namespace, *, world_size: int | None = None, records=None):
    """The network the predictions are costed on (None: the run's own buckets); a bench file's
    records at ``world_size`` (the run's) when it has them; ``--placement`` alone puts this
    run's own network (``records``) on each node's uplink."""
    if args.network and (args.latency or args.bandwidth):
        raise ValueError("give either --network FILE or --latency/--bandwidth, not both")
    if args.network:
        try:
            with open(args.network, encoding="utf-8") as file:
                records = json.load(file)
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"cannot read the network file {args.network}: {error}; "
                             "write it with `ddp-ring-hooks bench --json FILE`") from error
        if not isinstance(records, list) or not all(isinstance(r, dict) and {"algorithm", "world_size", "nbytes", "time_us"} <= r.keys() for r in records):
            raise ValueError(f"{args.network} is not `ddp-ring-hooks bench --json` output (a list of records "
                             "with algorithm, world_size, nbytes, time_us)")
        return from_bench(records, world_size=world_size)
    if bool(args.latency) != bool(args.bandwidth):
        raise ValueError("--latency and --bandwidth go together, e.g. --latency 5us --bandwidth 25GB/s")
    if (args.local_latency or args.local_bandwidth) and not args.placement:
        raise ValueError("--local-latency and --local-bandwidth describe two tiers: give --placement too")
    if args.placement:
        if not args.latency:
            if records is None:
                raise ValueError("--placement needs the uplink's --latency and --bandwidth, or a run to take it from")
            return placed_on_this_run(records, args)
        return from_two_tier(two_tier_network(args.placement, links_from_flags(args)))
    if args.latency:
        return from_latency_bandwidth(latency_s=parse_time(args.latency), bandwidth_Bps=parse_bandwidth(args.bandwidth))
    return None


def runs_inside(log_dir: str) -> list[Path]:
    """The run directories below ``log_dir`` that hold a timeline, in natural order
    (``accumulate_2`` before ``accumulate_10``); empty where ``log_dir`` is one run itself."""
    from ..telemetry.timeline import TIMELINE_FILE  # imports torch: only when a run is read

    top = Path(log_dir)
    if not top.is_dir() or (top / TIMELINE_FILE).exists():
        return []
    found = [path.parent for path in top.rglob(TIMELINE_FILE)]
    return sorted(found, key=lambda p: [int(part) if part.isdigit() else part
                                        for part in re.split(r"(\d+)", p.relative_to(top).as_posix())])


def chosen_run(log_dir: str) -> str:
    """``log_dir``, or the first run inside it, after listing them all (on stderr, so that
    ``--json`` stays one JSON document)."""
    inside = runs_inside(log_dir)
    if not inside or all(p.name.startswith("group_") and p.parent == Path(log_dir) for p in inside):
        return log_dir  # one run, or one per process group (read_timeline says which to pick)
    names = [os.path.relpath(p, log_dir) for p in inside]
    print(f"{log_dir} holds {len(inside)} runs with a timeline: {', '.join(names)}\n"
          f"advising on the first, {inside[0]} (pass another run's directory for it)\n", file=sys.stderr)
    return str(inside[0])


def run(args: argparse.Namespace) -> int:
    """Print the advice; 0, or 2 with a message when the input cannot be used."""
    from ..telemetry.timeline import read_timeline  # imports torch: not for --help

    try:
        records = read_timeline(chosen_run(args.log_dir))
        world_size = getattr(records[0], "world_size", None) if records else None
        advice = advise(records, network=network_from_args(args, world_size=world_size, records=records))
    except (ValueError, OSError, KeyError, TypeError) as error:  # a file that is not what it should be
        return fail("advise", f"{type(error).__name__}: {error}" if isinstance(error, KeyError | TypeError) else str(error))
    print(json.dumps(advice, indent=1) if args.json else format_advice(advice))
    return 0
