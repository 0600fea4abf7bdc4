"""What the advisor's network probe costs when the hook is registered, and what it finds.

``register(..., network_probe=True)`` (the default) times the run's algorithm at a few sizes
on every rank (``ddp_ring_hooks/runtime/network_probe.py``). This script measures, per world
size:

1. ``register`` of a small DDP model with the probe and without it, alternating, ``--repeats``
   times each (every rank meets at a barrier first; a registration counts for its slowest rank);
   the probe's cost is the difference of the medians;
2. the α, β, γ the advisor fits to the probe's samples (``advisor.network.from_probe``), and on
   the lab the fitted bandwidth against the shaped rate::

    python benchmarks/probe_cost.py --world-sizes 2,4                  # gloo ranks on this machine
    python benchmarks/probe_cost.py --lab --link 400Mbit --world-sizes 2,4   # one host per rank (root)

It prints one JSON line per world size (``--json FILE`` also writes them as a list).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import ddp_ring_hooks  # noqa: E402
from ddp_ring_hooks.advisor.network import from_probe  # noqa: E402
from ddp_ring_hooks.lab import EmulatedCluster, parse_rate  # noqa: E402
from ddp_ring_hooks.launch import run_on_ranks  # noqa: E402
from ddp_ring_hooks.machine import MachineLoad  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", default="2,4", help="world sizes to measure (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="registrations of each kind (default: %(default)s)")
    parser.add_argument("--algorithm", default="ring", help="the hook's algorithm (default: %(default)s)")
    parser.add_argument("--lab", action="store_true", help="one rank per host of an emulated lab (needs root)")
    parser.add_argument("--link", default="400Mbit", help="with --lab: every host's link (default: %(default)s)")
    parser.add_argument("--json", metavar="FILE", help="also write the lines to FILE as a JSON list")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one rank on a lab host
    args = parser.parse_args(argv)
    try:
        args.world_sizes = [int(p) for p in args.world_sizes.split(",") if p]
    except ValueError:
        parser.error(f"--world-sizes takes numbers like 2,4, got {args.world_sizes!r}")
    if not args.world_sizes or min(args.world_sizes) < 2:
        parser.error("--world-sizes: the probe needs 2 or more ranks")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def measure(algorithm: str, repeats: int, link_Bps: float | None) -> dict:
    """On every rank: the registrations, alternating with and without the probe; rank 0's dict."""
    torch.set_num_threads(1)
    times: dict[bool, list[float]] = {True: [], False: []}
    probe = None
    for _ in range(repeats):
        for probed in (False, True):
            model = DistributedDataParallel(torch.nn.Linear(64, 64))
            dist.barrier()
            started = time.perf_counter()
            state = ddp_ring_hooks.register(model, algorithm=algorithm, network_probe=probed)
            elapsed = torch.tensor([time.perf_counter() - started])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a registration ends when the slowest rank's does
            times[probed].append(elapsed.item())
            if probed:
                probe = state.plan.probed
            state.close()
    world_size = dist.get_world_size()
    network = from_probe(probe[1], algorithm=probe[0], world_size=world_size)
    links = network.calibration(algorithm)
    row = {
        "world_size": world_size, "algorithm": algorithm,
        "register_ms_without_probe": 1e3 * statistics.median(times[False]),
        "register_ms_with_probe": 1e3 * statistics.median(times[True]),
        "alpha_us": links.alpha * 1e6, "bandwidth_MBps": (1e-6 / links.beta) if links.beta else None,
        "cast_ns_per_B": links.gamma * 1e9, "source": network.source,
    }
    row["probe_ms"] = row["register_ms_with_probe"] - row["register_ms_without_probe"]
    if link_Bps:
        row["link_MBps"] = link_Bps / 1e6
        row["beta_x_link"] = links.beta * link_Bps  # 1.0: the probe's beta is exactly 1 / B
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    link_Bps = parse_rate(args.link) / 8 if args.lab else None
    if args.worker:  # one rank of the lab's job (the lab set torchrun's variables)
        row = run_on_ranks(measure, args.algorithm, args.repeats, link_Bps, nproc=1)
        if os.environ["RANK"] == "0":
            print(json.dumps(row))
        return 0
    load = MachineLoad.now()
    rows = []
    for p in args.world_sizes:
        if args.lab:
            with EmulatedCluster(hosts=p, link=args.link) as lab:
                given = sys.argv[1:] if argv is None else list(argv)
                results = lab.run([sys.executable, str(Path(__file__).resolve()), *given, "--worker"], timeout=600)
            row = next(json.loads(r.stdout.splitlines()[-1]) for r in results if r.stdout.strip())
        else:
            row = run_on_ranks(measure, args.algorithm, args.repeats, None, nproc=p)
        row["load_average_at_start"] = load.load_average
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
