"""``ddp-ring-hooks links``: which link is slow: every directed link's bandwidth, measured and named.

    ddp-ring-hooks links --nproc 4                                   # 4 local gloo ranks (loopback)
    torchrun --nnodes 8 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 \\
        -m ddp_ring_hooks links --json links.json                   # on each of 8 machines
    ddp-ring-hooks lab torchrun --hosts 4 --link 400Mbit --slow 2:100Mbit -m ddp_ring_hooks links --plot links.png

The ranks pair up in rounds of disjoint pairs (p-1 rounds; p for an odd p, one rank sitting
out each round) until every pair has met; in each round both ranks of every pair send each
other --size bytes at once, each direction timed by its receiver, --repeats times. A link's
bandwidth is the median of its repeats.

Then the naming rule (docs/links.md): a rank's network is slow when every link into and out
of it is below --threshold x the others' median while the others are not; a link, or a pair's
two directions, when it is below the others and no slow network explains it. With the ranks'
nodes known (torchrun's GROUP_RANK, or LOCAL_WORLD_SIZE), links inside a node are compared only
with links inside nodes and links between nodes with links between nodes, and a node's
uplink is named when all its links to other nodes are slow.

Rank 0 prints the matrix in MB/s (1e6 bytes per second; row: from, column: to; * marks the
links named) and one line, e.g. "links: rank 2's network is slow: 11.9 MB/s in, 12.1 MB/s out,
others 47.8 MB/s (5 repeats)". --json writes the measurements (format "ddp-ring-hooks links",
version 1; ddp_ring_hooks.links.load_link_matrix reads it back), --plot a heatmap.
"""

from __future__ import annotations

import argparse
import sys
import time

from ..launch import run_on_ranks, under_torchrun
from ..links import THRESHOLD, LinkMatrix, exchange_rounds, format_table, write_link_matrix
from ..links.heatmap import plot_heatmap
from ..units import SIZE_HELP, format_size, parse_size
from . import fail


def add_parser(subparsers) -> None:
    """Add the ``links`` subcommand."""
    parser = subparsers.add_parser(
        "links", help="measure every link's bandwidth between the ranks; name a slow link or a rank's slow network",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=SIZE_HELP,
    )
    probe = parser.add_argument_group("probe")
    probe.add_argument("--size", default="4M", metavar="SIZE",
                       help="bytes per transfer (default: 4M; on a shaped link, small messages go through the "
                            "shaper's burst faster than the rate, so keep 1M or more)")
    probe.add_argument("--repeats", type=int, default=5, metavar="N",
                       help="timed transfers per link, every round once per repeat; the median counts (default: 5)")
    probe.add_argument("--threshold", type=float, default=THRESHOLD, metavar="F",
                       help=f"slow means below F x the others' median bandwidth (default: {THRESHOLD})")
    ranks = parser.add_argument_group("ranks")
    ranks.add_argument("--nproc", type=int, default=4, metavar="N",
                       help="local gloo ranks to spawn when not under torchrun (default: 4); under torchrun, "
                            "torchrun decides")
    ranks.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                       help="give up on a rank that waits longer than this for its peers (default: 600)")
    output = parser.add_argument_group("output (written by rank 0)")
    output.add_argument("--json", metavar="PATH", help="write the measurements and the verdict as JSON")
    output.add_argument("--plot", metavar="PATH", help="save the matrix as a heatmap image (needs matplotlib)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Check the arguments here, then probe on every rank."""
    try:
        size = parse_size(args.size)
        if size < 1 or args.repeats < 1:
            raise ValueError(f"need --size of 1 byte or more and --repeats >= 1, got {args.size} and {args.repeats}")
        if not 0 < args.threshold < 1:
            raise ValueError(f"--threshold is a fraction of the others' bandwidth, between 0 and 1; got {args.threshold}")
        if not under_torchrun() and args.nproc < 2:
            raise ValueError(f"--nproc must be at least 2 to have a link, got {args.nproc}")
    except ValueError as error:
        return fail("links", str(error))
    return run_on_ranks(_links_on_rank, args, size, nproc=args.nproc, backend="gloo", timeout_s=args.timeout)


def _links_on_rank(args: argparse.Namespace, size: int) -> int:
    import torch.distributed as dist  # the ranks' imports: not for --help

    from ..runtime.link_probe import measure_links

    started = time.perf_counter()
    matrix = measure_links(message_bytes=size, repeats=args.repeats)
    if dist.get_rank() == 0:
        report(matrix, args, seconds=time.perf_counter() - started)
    return 0


def report(matrix: LinkMatrix, args: argparse.Namespace, *, seconds: float) -> None:
    """Print the header, the table and the verdict; write --json and --plot."""
    verdict = matrix.judge(threshold=args.threshold)
    nodes = ("nodes unknown" if matrix.nodes is None else
             f"nodes {list(matrix.nodes)} (from {matrix.nodes_from})")
    print(f"# ddp-ring-hooks links: {matrix.world_size} ranks, {matrix.backend}, {format_size(matrix.message_bytes)} "
          f"per transfer, {len(exchange_rounds(matrix.world_size))} rounds x {matrix.repeats} repeats in "
          f"{seconds:.1f} s; {nodes}\n"
          "# MB/s = 1e6 bytes/s, median of the repeats; row: from, column: to; both directions of a pair at once; "
          "* = named below")
    sys.stdout.write(format_table(matrix, verdict))
    line = verdict.summary_line(per="repeats")
    print(line)
    if args.json:
        write_link_matrix(matrix, args.json, threshold=args.threshold)
        print(f"# wrote {args.json}")
    if args.plot:
        plot_heatmap(matrix, verdict, args.plot, title=line)
        print(f"# wrote {args.plot}")
    sys.stdout.flush()
