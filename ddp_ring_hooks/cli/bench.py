"""``ddp-ring-hooks bench``: an nccl-tests style all-reduce benchmark of every algorithm.

    ddp-ring-hooks bench --nproc 4 -b 4K -e 64M -f 2               # spawns 4 local gloo ranks
    torchrun --standalone --nproc_per_node=4 -m ddp_ring_hooks bench -b 1M -e 1G    # NCCL on GPUs
    ddp-ring-hooks bench --nproc 2 --algorithms ring,native --rounds 5 --json bench.json --plot bench.png
    ddp-ring-hooks lab torchrun --hosts 4 --link 400Mbit -m ddp_ring_hooks bench -b 1M -e 64M   # a real network
    ddp-ring-hooks bench --nproc 4 --algorithms ring,double_binary_tree --segments 8 --ring-order 0,2,1,3
    ddp-ring-hooks bench --nproc 2 --algorithms ring,native --wire-dtype bf16      # half the bytes on the wire

Columns as in nccl-tests: size (bytes), count (elements), time (us, slowest rank), algbw and
busbw (GB/s, 1e9 bytes; busbw = algbw · 2(p-1)/p), #wrong (elements off the float64 sum by
more than the rounding bound). When the link's rate B is known (--link, or on the emulated
lab, which says it in $DDP_RING_HOOKS_LAB_LINK), also limit(us) = 2(p-1)/p · size / B, the
time no all-reduce can beat, and time / limit. Exit status 1 when a value is wrong, 2 on bad arguments.
See :mod:`ddp_ring_hooks.bench` for how it measures. The algorithms' options are flags, one
per option in the algorithm registry; each goes to the chosen algorithms that take it.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..lab import LINK_ENVIRONMENT, format_rate, parse_rate
from ..launch import run_on_ranks, under_torchrun
from ..schedules import check_given_options, get_algorithm, options_for, wire_of
from ..schedules.wire import AS_IS
from ..units import ELEMENT_TYPES, SIZE_HELP
from . import fail
from ._options import add_option_arguments, flag, given_options


def add_parser(subparsers) -> None:
    """Add the ``bench`` subcommand."""
    parser = subparsers.add_parser(
        "bench",
        help="time every all-reduce algorithm against dist.all_reduce, nccl-tests style",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=SIZE_HELP,
    )
    sweep = parser.add_argument_group("sweep (as in nccl-tests)")
    sweep.add_argument("-b", "--minbytes", default="4K", metavar="SIZE",
                       help="smallest message size, e.g. 4096, 4K, 1M (default: 4K)")
    sweep.add_argument("-e", "--maxbytes", default="64M", metavar="SIZE",
                       help="largest message size (default: 64M)")
    sweep.add_argument("-f", "--stepfactor", type=int, default=2, metavar="F",
                       help="multiply the size by F from one row to the next (default: 2)")
    sweep.add_argument("-w", "--warmup_iters", type=int, default=5, metavar="N",
                       help="untimed calls before each timed loop (default: 5)")
    sweep.add_argument("-n", "--iters", type=int, default=20, metavar="N",
                       help="timed calls per measurement; the time is their mean (default: 20)")
    sweep.add_argument("--rounds", type=int, default=1, metavar="R",
                       help="measure every (size, algorithm) R times, interleaved, and report the median; "
                            "use 5 or more on a shared machine (default: 1)")
    sweep.add_argument("-d", "--datatype", default="float", choices=sorted(ELEMENT_TYPES), metavar="TYPE",
                       help=f"element type: {', '.join(sorted(ELEMENT_TYPES))} (default: float)")
    sweep.add_argument("--algorithms", default=None, metavar="A,B,...",
                       help="comma-separated algorithms; 'auto' probes once and then picks per size like the "
                            "hook's algorithm='auto'; 'native' is dist.all_reduce (default: all of them)")
    add_option_arguments(parser.add_argument_group("algorithm options (also passed to auto's candidates)"))
    ranks = parser.add_argument_group("ranks")
    ranks.add_argument("--nproc", type=int, default=2, metavar="N",
                       help="local gloo ranks to spawn when not under torchrun (default: 2); "
                            "under torchrun, --nproc_per_node decides")
    ranks.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                       help="process group backend under torchrun (default: nccl with GPUs, else gloo); "
                            "spawned ranks always use gloo")
    ranks.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                       help="give up on a rank that waits longer than this for its peers (default: 600)")
    ranks.add_argument("--link", metavar="RATE", default=os.environ.get(LINK_ENVIRONMENT),
                       help="the rate of each rank's link, e.g. 400Mbit or 1Gbit: adds the link limit "
                            f"2(p-1)/p * size / RATE next to each time (default: ${LINK_ENVIRONMENT}, "
                            "which the emulated lab sets; else none)")
    output = parser.add_argument_group("output (written by rank 0)")
    output.add_argument("--json", metavar="PATH",
                        help="write the records as JSON: one object per (algorithm, world_size, nbytes)")
    output.add_argument("--plot", metavar="PATH", help="save busbw against size as an image (needs matplotlib)")
    output.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Check the arguments here, then run the sweep on every rank; 1 if any value was wrong."""
    from .. import bench  # torch: only when the command runs, not for --help

    try:
        sizes = bench.size_sweep(
            begin=bench.parse_size(args.minbytes), end=bench.parse_size(args.maxbytes), factor=args.stepfactor
        )
        given = args.algorithms or ",".join([*bench.ALGORITHMS, bench.AUTO, bench.NATIVE])
        algorithms = [name.strip() for name in given.split(",") if name.strip()]
        bench.check_algorithms(algorithms)
        options = options_per_algorithm(given_options(args), algorithms)
        if args.warmup_iters < 0 or args.iters < 1 or args.rounds < 1:
            raise ValueError("need -w >= 0, -n >= 1 and --rounds >= 1")
        if not under_torchrun() and args.nproc < 2:
            raise ValueError(f"--nproc must be at least 2 to communicate, got {args.nproc}")
        link = parse_rate(args.link) if args.link else None
    except ValueError as error:
        return fail("bench", str(error))
    wrong = run_on_ranks(
        _bench_on_rank, args, sizes, algorithms, options, link,
        nproc=args.nproc, backend=args.backend, timeout_s=args.timeout,
    )
    return 1 if wrong else 0


def options_per_algorithm(given: dict[str, object], algorithms: list[str]) -> dict[str, dict]:
    """Each benchmarked algorithm's share of the options given (``auto``: all of them, for its
    candidates), checked; an option that no benchmarked algorithm takes is an error, not ignored."""
    from .. import bench

    check_given_options(given)
    unused = [] if bench.AUTO in algorithms else [
        name for name in given if not any(name in get_algorithm(a).option_names for a in algorithms)
    ]
    if unused:
        raise ValueError(
            f"{', '.join(map(flag, unused))} is an option of none of {', '.join(algorithms)}; "
            "drop it or add an algorithm that takes it to --algorithms"
        )
    return {name: dict(given) if name == bench.AUTO else options_for(name, given) for name in algorithms}


def _bench_on_rank(
    args: argparse.Namespace, sizes: list[int], algorithms: list[str], options: dict[str, dict], link: int | None,
) -> int:
    """Run the sweep; rank 0 prints and writes the outputs. Returns the wrong values' count."""
    import torch.distributed as dist

    from .. import bench
    from ..runtime.collectives import device_of

    rank = dist.get_rank()
    device = device_of(None)
    dtype = bench.DTYPES[args.datatype]
    world_size = dist.get_world_size()
    wire = wire_of(given_options(args))
    if rank == 0:
        print(
            f"# ddp-ring-hooks bench: all-reduce (sum), {world_size} ranks, {dist.get_backend()} on {device.type}, "
            f"{args.datatype}, warm-up {args.warmup_iters}, iterations {args.iters}, rounds {args.rounds}\n"
            "# time: mean of the timed calls on the slowest rank (median over rounds); "
            "GB/s = 1e9 B/s; busbw = algbw * 2(p-1)/p\n"
            "# #wrong: elements where |result - exact float64 sum| > (p-1) * eps * sum_r |x_r|"
            + (f"\n# {wire} on the wire: each partial sum rounded to {wire} once per hop (#wrong: p * eps_{wire} * "
               f"sum_r |x_r|); busbw and the limit count the bytes on the wire, algbw the buffer's"
               if wire != AS_IS else "")
            + (f"\n# link {format_rate(link)}: limit = 2(p-1)/p * size / link, the time no all-reduce beats; "
               "x limit = time / limit" if link else "") + "\n#",
            flush=True,
        )
    records = bench.run_sweep(
        sizes, algorithms=algorithms, dtype=dtype, warmup=args.warmup_iters, iters=args.iters,
        rounds=args.rounds, device=device, options=options, progress=rank == 0 and not args.no_progress,
    )
    if link:
        records = bench.with_link_limit(records, link_bits_per_s=link)
    wrong = sum(r.wrong for r in records)  # the same on every rank
    if rank != 0:
        return wrong
    sys.stdout.write(bench.format_table(records))
    sizes_measured = sorted({r.nbytes for r in records})
    # The fit needs two sizes or more to tell latency from bandwidth; one size still gives
    # the table, --json and --plot.
    fitted = bench.model_errors(records, options) if len(sizes_measured) > 1 else {}
    if len(sizes_measured) == 1:
        print(f"# alpha-beta fit skipped: it needs 2 or more message sizes and this sweep has one "
              f"({bench.format_size(sizes_measured[0])}); give -e larger than -b to fit the model")
    if fitted:
        print("# alpha-beta model fitted per algorithm to these times (ddp_ring_hooks.cost_model)"
              + (f"; B = the link, {format_rate(link)}" if link else "") + ":")
        for algorithm, (calibration, error) in fitted.items():
            print(f"#   {bench.format_fit(algorithm, calibration, error, link_GBps=records[0].link_GBps)}")
    if args.json:
        bench.write_json(records, args.json)
        print(f"# wrote {len(records)} records to {args.json}")
    if args.plot:
        title = f"all-reduce busbw, {world_size} ranks, {dist.get_backend()}, {args.datatype}"
        bench.plot_busbw(records, args.plot, title=title)
        print(f"# wrote {args.plot}")
    sys.stdout.flush()
    return wrong
