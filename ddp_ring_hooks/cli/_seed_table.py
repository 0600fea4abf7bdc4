"""``ddp-ring-hooks lab table``: the seed article's table (naive master all-reduce against the
ring, as the number of devices grows), measured on an emulated network, next to the formulas.

The article predicted, for ``p`` devices all-reducing ``n`` bytes over links of ``B`` bytes/s::

    naive ("master")  p · n / B             ring  (p-1)/p · n / B  ≈  n / B

Both count one direction only. The corrected formulas (:mod:`ddp_ring_hooks.cost_model`, with
α = 0: the lab adds no latency, and at megabytes the kernel's tens of µs are nothing) count
both: the master receives ``p-1`` buffers and then sends ``p-1``; every ring rank sends and
receives ``2(p-1)/p · n``::

    naive             2(p-1) · n / B        ring  2(p-1)/p · n / B  <  2 n / B

How it measures:

1. **One lab** of the largest world size (one network namespace per host, every link shaped
   to ``--link``); every host runs this command's worker, one rank each, gloo over TCP.
2. **Per world size p**, the first ``p`` ranks form a process group and run ``bench``'s sweep
   (:func:`ddp_ring_hooks.bench.run_sweep`): per round and algorithm, naive then ring, two
   untimed calls (the first also checks the sum) and one timed after a barrier, the slowest
   rank's; the table shows the median of ``--rounds``. The other hosts wait. One lab for every ``p`` starts each host's Python
   once: on a shared machine that is most of the time of a short table.
3. **The α-β fit**, when two sizes or more are measured: per algorithm and ``p``, α and β by
   :func:`ddp_ring_hooks.cost_model.fit_per_algorithm` on each cell's fastest round (what the
   network allows: a slower round also waited on something else), and β against the link's own
   ``1/B``. A cell whose median is well above its fastest round is named under the table: its
   rounds waited (a pause of shared cores; a TCP retransmission after the master's port dropped
   what several senders sent it at once), and the median shows what a user of such a network
   would see.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import TYPE_CHECKING

from ..cost_model import predict
from ..lab import RATE_HELP, EmulatedCluster, LabError, format_rate, parse_rate
from ..launch import run_on_ranks
from ..units import format_size, parse_size
from . import fail

if TYPE_CHECKING:  # the library's bench imports torch: its functions import it when they run
    from ..bench import BenchRecord

ALGORITHMS = ("naive", "ring")
#: A cell whose median round took this much longer than its fastest is named under the table.
WAITED = 1.25
DEFAULT_WORLD_SIZES, DEFAULT_SIZES = "2,4,8", "16M"


def add_table_parser(actions) -> None:
    """Add ``table`` to ``ddp-ring-hooks lab``'s actions."""
    table = actions.add_parser(
        "table", help="the seed article's table measured: naive vs ring all-reduce time as hosts are added",
        description=__doc__.split("\n\n")[0] + "\n\n    ddp-ring-hooks lab table --world-sizes 2,4,8 --sizes 4M,16M "
                    "--link 400Mbit --rounds 3\n\nSee docs/algorithms.md and docs/lab.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=RATE_HELP,
    )
    table.add_argument("--world-sizes", default=DEFAULT_WORLD_SIZES, metavar="P[,P...]",
                       help="numbers of hosts, one row each; the lab has as many hosts as the largest "
                            "(default: %(default)s)")
    table.add_argument("--sizes", default=DEFAULT_SIZES, metavar="SIZE[,SIZE...]",
                       help="bytes each rank all-reduces, e.g. 4M,16M; two or more also fit alpha and beta "
                            "(default: %(default)s)")
    table.add_argument("--link", default="400Mbit", metavar="RATE", help="every host's link (default: %(default)s)")
    table.add_argument("--rounds", type=int, default=3, metavar="N",
                       help="timed calls per (size, p, algorithm); the median is shown (default: %(default)s)")
    table.add_argument("--timeout", type=float, default=1800.0, metavar="SECONDS",
                       help="stop the measurement after this long (default: %(default)s)")
    table.add_argument("--json", metavar="PATH", help="write every row (and the fits) as JSON")
    table.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one rank, on a lab host
    table.set_defaults(func=run_table)


def run_table(args: argparse.Namespace) -> int:
    """Bring up the lab, run the worker on every host, print (and write) the table; 2 on bad input
    or when the lab cannot be made or a host fails (the message names it)."""
    try:
        world_sizes, sizes, link = _checked(args)
    except ValueError as error:
        return fail("lab table", str(error))
    if args.worker:
        run_on_ranks(_measure_on_rank, world_sizes, sizes, args.rounds, link, nproc=1)  # joins the lab's job
        return 0
    worker = [sys.executable, "-m", "ddp_ring_hooks", "lab", "table", "--worker", "--world-sizes", args.world_sizes,
              "--sizes", args.sizes, "--link", args.link, "--rounds", str(args.rounds)]
    try:
        with EmulatedCluster(hosts=max(world_sizes), link=args.link) as lab:
            print(f"# lab {lab.name}: {lab.spec.describe()}; p = {args.world_sizes} on its first p hosts, "
                  f"the others waiting", flush=True)
            results = lab.run(worker, timeout=args.timeout)
    except LabError as error:
        return fail("lab table", str(error))
    from ..bench import BenchRecord

    records = [BenchRecord(**row) for row in json.loads(results[0].stdout.splitlines()[-1])]
    rows = table_rows(records, link_bits_per_s=link)
    fits = fitted([dataclasses.replace(r, time_us=r.fastest_us) for r in records])
    print(format_seed_table(rows, link_bits_per_s=link, rounds=args.rounds))
    if fits:
        print(f"\n# alpha-beta fitted per algorithm and p to each cell's fastest round (ddp_ring_hooks.cost_model); "
              f"B = the link, {format_rate(link)}:")
        for fit in fits:
            print(f"#   p={fit['world_size']:<3} {fit['line']}")
    if args.json:
        plain_fits = [{key: value for key, value in fit.items() if key != "line"} for fit in fits]
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump({"link": format_rate(link), "rows": rows, "fits": plain_fits}, file, indent=1)
            file.write("\n")
        print(f"# wrote {len(rows)} rows and {len(fits)} fits to {args.json}")
    return 0


def _checked(args: argparse.Namespace) -> tuple[list[int], list[int], int]:
    """World sizes, sizes in bytes and the link in bit/s; ``ValueError`` names a bad one."""
    try:
        world_sizes = [int(p) for p in args.world_sizes.split(",")]
    except ValueError:
        raise ValueError(f"--world-sizes takes numbers of hosts, e.g. 2,4,8; got {args.world_sizes!r}") from None
    if min(world_sizes) < 2 or len(set(world_sizes)) < len(world_sizes):
        raise ValueError(f"--world-sizes needs different numbers of hosts, each at least 2; got {args.world_sizes!r}")
    sizes = sorted({parse_size(size) for size in args.sizes.split(",")})
    if min(sizes) < 4:
        raise ValueError(f"--sizes must be at least one float (4 bytes); got {args.sizes!r}")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise ValueError(f"--json {args.json}: no such directory; make it first (checked before the lab measures)")
    return sorted(world_sizes), sizes, parse_rate(args.link)


def _measure_on_rank(world_sizes: list[int], sizes: list[int], rounds: int, link: int) -> None:
    """On every host: each world size's sweep on the first ``p`` ranks; rank 0 prints the
    records as one JSON line (the last line of its output)."""
    import torch.distributed as dist

    from .. import bench

    records = []
    for p in world_sizes:
        # Every rank takes part in making every group (torch.distributed's rule), members or not.
        group = dist.new_group(list(range(p))) if p < dist.get_world_size() else None
        if dist.get_rank() < p:
            records += bench.run_sweep(sizes, algorithms=ALGORITHMS, warmup=1, iters=1, rounds=rounds, group=group)
        dist.barrier()
    if dist.get_rank() == 0:
        print(json.dumps([r.as_dict() for r in bench.with_link_limit(records, link_bits_per_s=link)]), flush=True)


def corrected_seconds(algorithm: str, nbytes: int, world_size: int, *, link_bits_per_s: int) -> float:
    """The cost model's time on the link alone (α = 0)."""
    return predict(algorithm, nbytes, world_size, alpha=0.0, beta=8 / link_bits_per_s)


def article_seconds(algorithm: str, nbytes: int, world_size: int, *, link_bits_per_s: int) -> float:
    """The article's formulas: naive ``p · n / B``, ring ``(p-1)/p · n / B``."""
    one_pass = nbytes * 8 / link_bits_per_s
    return world_size * one_pass if algorithm == "naive" else (world_size - 1) / world_size * one_pass


def table_rows(records: list[BenchRecord], *, link_bits_per_s: int) -> list[dict]:
    """One row per measured (size, p, algorithm): measured seconds (the median round and the
    fastest), both formulas, the ratios."""
    rows = []
    for r in records:
        measured, fastest = r.time_us * 1e-6, r.fastest_us * 1e-6
        corrected = corrected_seconds(r.algorithm, r.nbytes, r.world_size, link_bits_per_s=link_bits_per_s)
        article = article_seconds(r.algorithm, r.nbytes, r.world_size, link_bits_per_s=link_bits_per_s)
        rows.append({"algorithm": r.algorithm, "world_size": r.world_size, "nbytes": r.nbytes, "wrong": r.wrong,
                     "measured_s": measured, "fastest_s": fastest, "corrected_s": corrected, "article_s": article,
                     "x_corrected": measured / corrected, "x_corrected_fastest": fastest / corrected,
                     "x_article": measured / article})
    return rows


def fitted(records: list[BenchRecord]) -> list[dict]:
    """α, β per (p, algorithm) from two sizes or more, with β·B (1.00: each byte at the link's rate)."""
    from .. import bench

    fits = []
    for p in sorted({r.world_size for r in records}):
        mine = [r for r in records if r.world_size == p]
        if len({r.nbytes for r in mine}) < 2:
            continue
        link_GBps = mine[0].link_GBps
        for algorithm, (calibration, error) in bench.model_errors(mine).items():
            fits.append({"world_size": p, "algorithm": algorithm, "alpha_s": calibration.alpha,
                         "beta_s_per_byte": calibration.beta, "beta_x_link": calibration.beta * link_GBps * 1e9,
                         "median_error": error,
                         "line": bench.format_fit(algorithm, calibration, error, link_GBps=link_GBps)})
    return fits


def format_seed_table(rows: list[dict], *, link_bits_per_s: int, rounds: int) -> str:
    """The table per size (p down, naive and ring across), the formulas, and what differs."""
    lines = []
    for nbytes in sorted({row["nbytes"] for row in rows}):
        mine = [row for row in rows if row["nbytes"] == nbytes]
        lines += [
            (f"# the seed's table, measured: all-reduce of {format_size(nbytes)} per rank on "
             f"{format_rate(link_bits_per_s)} links, slowest rank, median of {rounds}"),
            (f"# {'p':>3}  {'naive':>8} {'corrected':>10} {'article':>8}   {'ring':>7} {'corrected':>10} {'article':>8}"
             f"   {'naive/ring':>10}"),
        ]
        for p in sorted({row["world_size"] for row in mine}):
            naive, ring = (next(row for row in mine if row["world_size"] == p and row["algorithm"] == a)
                           for a in ALGORITHMS)
            lines.append(
                f"  {p:>3}  {naive['measured_s']:>7.3f}s {naive['corrected_s']:>9.3f}s {naive['article_s']:>7.3f}s"
                f"   {ring['measured_s']:>6.3f}s {ring['corrected_s']:>9.3f}s {ring['article_s']:>7.3f}s"
                f"   {naive['measured_s'] / ring['measured_s']:>10.2f}"
            )
        lines.append("")
    lines += [
        "# corrected (cost_model, alpha = 0): naive 2(p-1) n/B, ring 2(p-1)/p n/B; article: naive p n/B, ring (p-1)/p n/B",
        "# measured / corrected: " + _ratio_ranges(rows, "x_corrected") + "; measured / article: "
        + _ratio_ranges(rows, "x_article"),
        "# The article counts one direction only: its ring moves the reduce-scatter's bytes but not the all-gather's",
        "# (half the time), its master receives the buffers but sends none back (half the time at large p). What it",
        "# got right is the shape: naive grows with p (the master's link carries every buffer), the ring stays under 2n/B.",
    ]
    lines += [
        (f"# {row['algorithm']} p={row['world_size']} {format_size(row['nbytes'])}: median {row['measured_s']:.3f}s, "
         f"fastest round {row['fastest_s']:.3f}s: some rounds waited on something besides the link (a pause of "
         f"shared cores, or a TCP retransmission after a port dropped what several senders sent it at once)")
        for row in rows if row["measured_s"] > WAITED * row["fastest_s"]
    ]
    wrong = sum(row["wrong"] for row in rows)
    if wrong:
        lines.append(f"# WRONG: {wrong} elements off the exact sum; the times above are not of correct all-reduces")
    return "\n".join(lines)


def _ratio_ranges(rows: list[dict], key: str) -> str:
    return ", ".join(
        f"{a} {min(r[key] for r in rows if r['algorithm'] == a):.2f}-{max(r[key] for r in rows if r['algorithm'] == a):.2f}"
        for a in ALGORITHMS
    )
