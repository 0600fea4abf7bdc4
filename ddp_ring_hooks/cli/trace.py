"""``ddp-ring-hooks trace merge DIR``: one Chrome/Perfetto trace of every rank, on one time axis.

    ddp-ring-hooks trace merge runs/ring            # DIR/rank_*/comm_trace.json -> DIR/comm_trace.json

For runs with ``per_rank=True`` (each rank wrote ``DIR/rank_{r}/comm_trace.json`` on its own
clock). Without ``per_rank``, rank 0 already gathers every rank into ``DIR/comm_trace.json``.
Open the result in ui.perfetto.dev or chrome://tracing: one process per rank, in rank order.
"""

from __future__ import annotations

import argparse
import json
import os

from ..telemetry.trace_merge import MERGED_FILE, merge_trace_files, rank_trace_files
from . import fail


def add_parser(subparsers) -> None:
    """Add the ``trace`` subcommand (``trace merge``)."""
    parser = subparsers.add_parser(
        "trace", help="merge the per-rank communication traces of a run into one aligned trace",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    merge = actions.add_parser("merge", help="merge DIR/rank_*/comm_trace.json into one file")
    merge.add_argument("directory", metavar="DIR", help="the log_dir of a run with per_rank=True and trace_steps")
    merge.add_argument("--output", default=None, help=f"where to write (default: DIR/{MERGED_FILE})")
    merge.set_defaults(func=run_merge)


def run_merge(args: argparse.Namespace) -> int:
    paths = rank_trace_files(args.directory)
    if not paths:
        return fail("trace", f"no DIR/rank_*/{MERGED_FILE} in {args.directory!r}: run with "
                             "register(..., log_dir=DIR, trace_steps=N, per_rank=True) first")
    try:
        merged = merge_trace_files(paths)
    except (ValueError, KeyError, json.JSONDecodeError) as error:
        return fail("trace", str(error))
    output = args.output or os.path.join(args.directory, MERGED_FILE)
    with open(output, "w") as file:
        json.dump(merged, file)
    ranks = merged["ddp_ring_hooks"]["merged_ranks"]
    print(f"merged ranks {ranks} into {output} (clocks aligned to within "
          f"{merged['ddp_ring_hooks']['clock_error_ms']:.3g} ms)")
    return 0
