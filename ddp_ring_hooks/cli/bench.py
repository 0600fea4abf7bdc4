"""``ddp-ring-hooks bench``: an nccl-tests style all-reduce benchmark of every algorithm.

    ddp-ring-hooks bench --nproc 4 -b 4K -e 64M -f 2               # spawns 4 local gloo ranks
    torchrun --standalone --nproc_per_node=4 -m ddp_ring_hooks bench -b 1M -e 1G    # NCCL on GPUs
    ddp-ring-hooks bench --nproc 2 --algorithms ring,native --rounds 5 --json bench.json --plot bench.png
    ddp-ring-hooks bench --nproc 4 --algorithms ring,double_binary_tree --segments 8 --ring-order 0,2,1,3

Columns as in nccl-tests: size (bytes), count (elements), time (us, slowest rank), algbw and
busbw (GB/s, 1e9 bytes; busbw = algbw · 2(p-1)/p), #wrong (elements off the float64 sum by
more than the rounding bound). Exit status 1 when a value is wrong, 2 on bad arguments.
See :mod:`ddp_ring_hooks.bench` for how it measures. The algorithms' options are flags, one
per option name in the algorithm registry; each goes to the chosen algorithms that take it.
"""

from __future__ import annotations

import argparse
import sys

import torch.distributed as dist

from .. import bench
from ..launch import run_on_ranks, under_torchrun
from ..runtime.collectives import device_of
from ..schedules import ALGORITHMS, Option, algorithm_names, get_algorithm
from ..units import SIZE_HELP
from . import fail


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
    sweep.add_argument("-d", "--datatype", default="float", choices=sorted(bench.DTYPES), metavar="TYPE",
                       help=f"element type: {', '.join(sorted(bench.DTYPES))} (default: float)")
    sweep.add_argument("--algorithms", default=",".join([*ALGORITHMS, bench.AUTO, bench.NATIVE]), metavar="A,B,...",
                       help="comma-separated algorithms; 'auto' probes once and then picks per size like the "
                            "hook's algorithm='auto'; 'native' is dist.all_reduce (default: all of them)")
    schedule = parser.add_argument_group(
        "algorithm options", "each goes to the chosen algorithms that take it; VALUE is a number, a word, "
        "or numbers separated by commas (--ring-order 0,2,1,3)",
    )
    for option, takers in registry_options():
        schedule.add_argument(
            f"--{option.name.replace('_', '-')}", dest=option.name, type=parse_option_value, default=None,
            metavar="VALUE", help=f"{', '.join(takers)}: {option.doc}",
        )
    ranks = parser.add_argument_group("ranks")
    ranks.add_argument("--nproc", type=int, default=2, metavar="N",
                       help="local gloo ranks to spawn when not under torchrun (default: 2); "
                            "under torchrun, --nproc_per_node decides")
    ranks.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                       help="process group backend under torchrun (default: nccl with GPUs, else gloo); "
                            "spawned ranks always use gloo")
    ranks.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                       help="give up on a rank that waits longer than this for its peers (default: 600)")
    output = parser.add_argument_group("output (written by rank 0)")
    output.add_argument("--json", metavar="PATH",
                        help="write the records as JSON: one object per (algorithm, world_size, nbytes)")
    output.add_argument("--plot", metavar="PATH", help="save busbw against size as an image (needs matplotlib)")
    output.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Check the arguments here, then run the sweep on every rank; 1 if any value was wrong."""
    try:
        sizes = bench.size_sweep(
            begin=bench.parse_size(args.minbytes), end=bench.parse_size(args.maxbytes), factor=args.stepfactor
        )
        algorithms = [name.strip() for name in args.algorithms.split(",") if name.strip()]
        bench.check_algorithms(algorithms)
        if args.warmup_iters < 0 or args.iters < 1 or args.rounds < 1:
            raise ValueError("need -w >= 0, -n >= 1 and --rounds >= 1")
        if not under_torchrun() and args.nproc < 2:
            raise ValueError(f"--nproc must be at least 2 to communicate, got {args.nproc}")
        options = options_per_algorithm(args, algorithms)
    except (TypeError, ValueError) as error:
        return fail("bench", str(error))
    wrong = run_on_ranks(
        _bench_on_rank, args, sizes, algorithms, options, nproc=args.nproc, backend=args.backend, timeout_s=args.timeout
    )
    return 1 if wrong else 0


def registry_options() -> list[tuple[Option, list[str]]]:
    """Every option name of the registry once, with the algorithms that take it."""
    takers: dict[str, tuple[Option, list[str]]] = {}
    for name in algorithm_names():
        for option in get_algorithm(name).options:
            takers.setdefault(option.name, (option, []))[1].append(name)
    return list(takers.values())


def parse_option_value(text: str) -> object:
    """``"8"`` -> 8, ``"0,2,1,3"`` -> (0, 2, 1, 3), ``"hosts"`` -> ``"hosts"``."""
    parts = [part.strip() for part in text.split(",")]
    if all(part.lstrip("-").isdigit() for part in parts):
        numbers = tuple(int(part) for part in parts)
        return numbers if "," in text else numbers[0]
    if "," in text:
        raise argparse.ArgumentTypeError(f"{text!r}: a list must be integers separated by commas")
    return text


def options_per_algorithm(args: argparse.Namespace, algorithms: list[str]) -> dict[str, dict]:
    """The option flags given, handed to each chosen algorithm that takes them, checked here
    (before any rank starts); a flag none of them takes is an error."""
    given = {option.name: getattr(args, option.name) for option, _ in registry_options() if getattr(args, option.name) is not None}
    scheduled = [name for name in algorithms if name in algorithm_names()]
    per_algorithm = {
        name: {option: value for option, value in given.items() if option in get_algorithm(name).option_names}
        for name in scheduled
    }
    unused = sorted(set(given) - {option for options in per_algorithm.values() for option in options})
    if unused:
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in unused)
        raise ValueError(f"none of the chosen algorithms ({', '.join(algorithms)}) takes {flags}; add one that does or drop it")
    # Each value's own check, here; what depends on the ranks (LOCAL_WORLD_SIZE, the world size)
    # is checked when they build their schedules.
    for option, _ in registry_options():
        problem = option.check(given[option.name]) if option.name in given else None
        if problem:
            raise ValueError(f"--{option.name.replace('_', '-')} {given[option.name]!r} {problem}")
    return per_algorithm


def _bench_on_rank(args: argparse.Namespace, sizes: list[int], algorithms: list[str], options: dict[str, dict]) -> int:
    """Run the sweep; rank 0 prints and writes the outputs. Returns the wrong values' count."""
    rank = dist.get_rank()
    device = device_of(None)
    dtype = bench.DTYPES[args.datatype]
    world_size = dist.get_world_size()
    if rank == 0:
        print(
            f"# ddp-ring-hooks bench: all-reduce (sum), {world_size} ranks, {dist.get_backend()} on {device.type}, "
            f"{args.datatype}, warm-up {args.warmup_iters}, iterations {args.iters}, rounds {args.rounds}\n"
            "# time: mean of the timed calls on the slowest rank (median over rounds); "
            "GB/s = 1e9 B/s; busbw = algbw * 2(p-1)/p\n"
            "# #wrong: elements where |result - exact float64 sum| > (p-1) * eps * sum_r |x_r|\n#",
            flush=True,
        )
    records = bench.run_sweep(
        sizes, algorithms=algorithms, dtype=dtype, warmup=args.warmup_iters, iters=args.iters,
        rounds=args.rounds, device=device, options=options, progress=rank == 0 and not args.no_progress,
    )
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
        print("# alpha-beta model fitted per algorithm to these times (ddp_ring_hooks.cost_model):")
        for algorithm, (calibration, error) in fitted.items():
            print(
                f"#   {algorithm:<17} alpha {calibration.alpha * 1e6:8.1f} us  beta {calibration.beta * 1e9:7.3f} ns/B"
                f"  median |predicted - measured| / measured {error:6.1%}"
            )
    if args.json:
        bench.write_json(records, args.json)
        print(f"# wrote {len(records)} records to {args.json}")
    if args.plot:
        title = f"all-reduce busbw, {world_size} ranks, {dist.get_backend()}, {args.datatype}"
        bench.plot_busbw(records, args.plot, title=title)
        print(f"# wrote {args.plot}")
    sys.stdout.flush()
    return wrong
