"""``ddp-ring-hooks explain``: print an algorithm step by step, with the cost of one all-reduce.

    ddp-ring-hooks explain --algorithm ring --world-size 4
    ddp-ring-hooks explain --algorithm hierarchical --world-size 8 --local-size 4 --elements 1048576

Rank ``r`` starts with ``r + 1`` everywhere, so each printed chunk ``c2=7 {0,2,3}`` reads as
"holds 1 + 3 + 4 so far". The schedule is the one the hook executes, checked first.
"""

from __future__ import annotations

import argparse
import sys

from ..schedules import Schedule, algorithm_names, checked_schedule, get_algorithm
from ..viz import explain, simulate
from . import fail
from ._options import add_option_arguments, command_line_hint, flag, given_options


def add_parser(subparsers) -> None:
    """Add the ``explain`` subcommand."""
    parser = subparsers.add_parser(
        "explain",
        help="print an all-reduce algorithm step by step on example numbers, with its cost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_schedule_arguments(parser)
    parser.add_argument(
        "--elements", type=int, default=None, metavar="N",
        help="elements in the example buffer; sets chunk sizes and the cost (default: one per chunk)",
    )
    parser.add_argument(
        "--element-size", type=int, default=4, metavar="BYTES", help="bytes per element for the cost (default: 4, fp32)"
    )
    parser.add_argument("--alpha", type=float, default=5e-6, help="α: seconds per step (latency); default 5e-6")
    parser.add_argument(
        "--beta", type=float, default=1e-9, help="β: seconds per byte (1 / bandwidth); default 1e-9, i.e. 1 GB/s"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the explanation; exit code 2 on bad arguments."""
    if args.elements is not None and args.elements < 0:
        return fail("explain", f"--elements must be 0 or more, got {args.elements}")
    if args.element_size < 1:
        return fail("explain", f"--element-size must be at least 1 byte, got {args.element_size}")
    if args.alpha < 0 or args.beta < 0:
        return fail("explain", "--alpha and --beta must be 0 or more (seconds per step, seconds per byte)")
    try:
        schedule = schedule_from_args(args)
    except ValueError as error:
        return fail("explain", str(error))
    simulation = simulate(schedule, elements=args.elements)
    sys.stdout.write(
        explain(simulation, element_size=args.element_size, alpha=args.alpha, beta=args.beta)
    )
    return 0


def add_schedule_arguments(parser: argparse.ArgumentParser) -> None:
    """``--algorithm``, ``--world-size`` and the algorithms' options (shared with ``animate``)."""
    parser.add_argument(
        "--algorithm", default="ring", choices=algorithm_names(scheduled_only=True),
        help="the all-reduce algorithm (default: ring)",
    )
    parser.add_argument("--world-size", type=int, default=4, metavar="P", help="number of ranks (default: 4)")
    add_option_arguments(parser)


def schedule_from_args(args: argparse.Namespace) -> Schedule:
    """The checked schedule the arguments name (it carries its resolved options)."""
    if args.world_size < 1:
        raise ValueError(f"--world-size must be at least 1, got {args.world_size}")
    options = given_options(args)
    try:
        return checked_schedule(args.algorithm, args.world_size, **options)
    except ValueError as error:
        raise ValueError(f"{error}{command_line_hint(str(error), args.algorithm)}") from None
    except TypeError:
        given = ", ".join(flag(name) for name in options if name not in get_algorithm(args.algorithm).option_names)
        raise ValueError(f"{args.algorithm} does not take {given}; drop it or choose an algorithm that does") from None

