"""One all-reduce on a real (emulated) network, against the link limit, per algorithm and world size.

For each world size ``p``, an emulated lab of ``p`` hosts (``ddp_ring_hooks.lab``, needs root):
one network namespace per host, one link each, shaped to ``--link`` in both directions; gloo
over TCP on those links. Every rank all-reduces the same buffer size with each algorithm:

- ``gloo``: ``dist.all_reduce`` itself, gloo's own algorithm (the bar to meet);
- ``native``: the project's ``native`` executor (the group's all-reduce, timed like the others);
- ``ring``, ``halving_doubling``, ``tree``, ``naive``, ...: the project's schedules;
- an algorithm with options, ``NAME/OPTION=VALUE[/...]`` (values as on the command line):
  ``ring/ring_order=measured``, ``double_binary_tree/segments=8``, ``hierarchical/segments=1``;
- fewer bytes on the wire: ``ring/wire_dtype=bf16`` (any algorithm; ``native/wire_dtype=bf16``
  is PyTorch's ``bf16_compress_hook``), and ``gloo/wire_dtype=bf16``: ``dist.all_reduce`` of
  the buffer already in bf16 (no cast timed: the bar for a bf16 all-reduce). Such an arm's link
  limit is on its wire bytes, ``2(p-1)/p · (n/2) / B``, its check within bf16's rounding, and
  the table also gives its time over its fp32 twin's (the same spec without the wire dtype,
  when measured): the gain itself::

      python benchmarks/network.py --world-sizes 2,4 --sizes 16M --rounds 3 \
          --algorithms ring,ring/wire_dtype=bf16,gloo/wire_dtype=bf16,native/wire_dtype=bf16

Two tiers (``--nodes M --uplink RATE``): the hosts are grouped into ``M`` nodes that meet
unshaped inside and through one uplink each, shaped to ``RATE``; ``--placement`` says which
host is on which node (``cyclic``: host ``i`` on node ``i mod M``, ranks alternating between
nodes; or the nodes listed, ``0,1,0,1``). Every process gets ``GROUP_RANK`` (its node) and
``LOCAL_WORLD_SIZE`` (its node's hosts), so ``hierarchical`` needs no options. The link limit
is then the uplink's, ``2(p-1)/p · n / B``: what the ring placed node by node pushes through
each uplink, at best.

The table shows every algorithm's median over the link limit, and its median over the first
algorithm's (``--algorithms ring,hierarchical``: hierarchical / ring, measured side by side in
the same rounds), which is the number to trust on a loaded machine::

    python benchmarks/network.py --world-sizes 4,6 --nodes 2 --uplink 400Mbit --sizes 4M,16M \
        --algorithms ring,hierarchical,gloo --rounds 5
    python benchmarks/network.py --world-sizes 4 --nodes 2 --uplink 400Mbit --placement cyclic \
        --algorithms ring,ring/ring_order=measured,ring/ring_order=hosts --rounds 5

The time of one call is the slowest rank's (after a barrier); every (size, algorithm) is timed
``--rounds`` times, algorithms in alternating order (forward, then backward, ...) so drifting
load hits them alike, after one untimed call each (connections, buffers). The table shows the
median over rounds divided by the link limit ``2(p-1)/p · n / B``: the least every rank must
send through its own link, so 1.00 is a full link::

    python benchmarks/network.py                                # p = 2, 4; 16M; 400Mbit; 3 rounds
    python benchmarks/network.py --world-sizes 2,4,8 --sizes 4M,16M --rounds 3 --json network.json
    python benchmarks/network.py --algorithms gloo,ring --link 1Gbit

(``ring/ring_order=measured`` probes the links once, when the lab's ranks first run it.)

Every rank checks its result against ``dist.all_reduce`` of the same input before timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import ddp_ring_hooks
from ddp_ring_hooks.lab import EmulatedCluster, LabError, parse_rate
from ddp_ring_hooks.launch import run_on_ranks
from ddp_ring_hooks.runtime.collectives import time_calls
from ddp_ring_hooks.runtime.names import accepted_algorithms
from ddp_ring_hooks.runtime.wire import wire_dtype_for
from ddp_ring_hooks.schedules import WIRE_DTYPE, get_algorithm, wire_ratio
from ddp_ring_hooks.telemetry import all_reduce_bus_factor
from ddp_ring_hooks.units import format_size, parse_size

GLOO = "gloo"  # dist.all_reduce itself
DEFAULT_ALGORITHMS = (GLOO, "native", "ring", "halving_doubling", "tree", "naive")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", default="2,4", metavar="P[,P...]", help="hosts per lab, in turn (default: 2,4)")
    parser.add_argument("--sizes", default="16M", metavar="SIZE[,SIZE...]", help="buffer sizes in bytes (default: 16M)")
    parser.add_argument("--link", default=None, metavar="RATE",
                        help="every host's own link (default: 400Mbit; with --nodes, unshaped inside the nodes)")
    parser.add_argument("--nodes", type=int, default=None, metavar="M", help="two tiers: the hosts in M nodes")
    parser.add_argument("--uplink", default=None, metavar="RATE", help="two tiers: each node's uplink (default: 400Mbit)")
    parser.add_argument("--placement", default=None, metavar="cyclic|N0,N1,...",
                        help="two tiers: the node of each host (default: node by node)")
    parser.add_argument("--algorithms", default=",".join(DEFAULT_ALGORITHMS), metavar="A,B,...",
                        help=f"'{GLOO}' (dist.all_reduce) and the project's algorithms, each maybe with options as "
                             "NAME/OPTION=VALUE (default: %(default)s); ratios are to the first")
    parser.add_argument("--rounds", type=int, default=3, metavar="N", help="timed calls per (size, algorithm) (default: 3)")
    parser.add_argument("--timeout", type=float, default=900.0, metavar="SECONDS",
                        help="give up on one world size after this long (default: 900)")
    parser.add_argument("--json", metavar="PATH", help="write every measured time as JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one rank, on a lab host
    args = parser.parse_args(argv)
    args.world_sizes = [int(p) for p in args.world_sizes.split(",")]
    args.sizes = [parse_size(size) for size in args.sizes.split(",")]
    args.algorithms = [name.strip() for name in args.algorithms.split(",") if name.strip()]
    unknown = sorted({spec.split("/")[0] for spec in args.algorithms} - {GLOO, *accepted_algorithms()})
    if unknown or args.rounds < 1 or min(args.world_sizes) < 2:
        parser.error(f"unknown algorithm(s) {unknown}" if unknown else "need --rounds >= 1 and world sizes >= 2")
    try:
        for spec in args.algorithms:
            algorithm_and_options(spec)
    except ValueError as error:
        parser.error(str(error))
    if args.nodes is None and (args.uplink or args.placement):
        parser.error("--uplink and --placement describe two tiers: give --nodes M too")
    if args.nodes is None:
        args.link = args.link or "400Mbit"
    else:
        args.uplink = args.uplink or "400Mbit"
    for rate in (args.link, args.uplink):
        if rate:
            parse_rate(rate)  # a bad rate fails here, before any lab is made
    return args


def algorithm_and_options(spec: str) -> tuple[str, dict]:
    """``"ring/ring_order=measured"`` -> ``("ring", {"ring_order": "measured"})``: each value read
    by its option's own parser (as the command line reads it)."""
    name, *pairs = spec.split("/")
    options = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        takes = (WIRE_DTYPE.name,) if name == GLOO else get_algorithm(name).option_names
        if key not in takes or not value:
            raise ValueError(f"{spec!r}: {key!r} is not an option of {name} (write NAME/OPTION=VALUE)")
        option = WIRE_DTYPE if name == GLOO else get_algorithm(name).option(key)
        options[key] = option.parse(value)
        problem = option.check(options[key])
        if problem:
            raise ValueError(f"{spec!r}: {key}={value} {problem}")
    return name, options


def fp32_twin(spec: str) -> str | None:
    """The same spec without its wire dtype (``ring/wire_dtype=bf16`` -> ``ring``); ``None`` for
    an arm without one."""
    parts = spec.split("/")
    kept = [part for part in parts if not part.startswith(f"{WIRE_DTYPE.name}=")]
    return "/".join(kept) if len(kept) < len(parts) else None


def placement_of(args: argparse.Namespace, world_size: int) -> tuple[int, ...] | None:
    """The node of each of ``world_size`` hosts (``None``: node by node)."""
    if args.placement is None:
        return None
    if args.placement == "cyclic":
        return tuple(host % args.nodes for host in range(world_size))
    return tuple(int(node) for node in args.placement.split(","))


def measure_on_rank(args: argparse.Namespace) -> None:
    """Every (size, algorithm) on this rank's process group; rank 0 prints, as one JSON line,
    the slowest rank's seconds per round (the same on every rank)."""
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {}
    for nbytes in args.sizes:
        inputs = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(dist.get_rank()))
        exact = inputs.clone()
        dist.all_reduce(exact)
        calls = {spec: _caller(spec, inputs) for spec in args.algorithms}
        for name, call in calls.items():  # untimed: connections, buffers; and the check
            result = inputs.clone()
            call(result)
            wire = wire_dtype_for(result.dtype, algorithm_and_options(name)[1])
            # bf16 keeps 8 bits: p roundings of partial sums of up to p values of |x| ~ 4
            tolerance = 1e-4 if wire is None else dist.get_world_size() * 16 * torch.finfo(wire).eps
            if name.startswith(GLOO) and wire is not None:
                continue  # it reduced its own bf16 copy, not the buffer
            if not torch.allclose(result, exact, rtol=1e-5, atol=tolerance):
                raise RuntimeError(f"{name} gave a wrong sum at {format_size(nbytes)}")
        for round_index in range(args.rounds):
            order = args.algorithms if round_index % 2 == 0 else args.algorithms[::-1]
            for name in order:
                buffer = inputs.clone()
                seconds = time_calls(lambda: calls[name](buffer), buffer.device, warmup=0, iters=1, group=None)
                times.setdefault(f"{name} {nbytes}", []).append(seconds)
    if dist.get_rank() == 0:
        print(json.dumps(times), flush=True)


def _caller(spec: str, inputs: torch.Tensor):
    name, options = algorithm_and_options(spec)
    if name == GLOO:
        wire = wire_dtype_for(inputs.dtype, options)
        if wire is None:
            return dist.all_reduce
        staged = inputs.to(wire)  # the buffer already in the wire dtype: gloo's all-reduce alone
        return lambda buffer: dist.all_reduce(staged)
    return lambda buffer: ddp_ring_hooks.all_reduce(buffer, algorithm=name, **options)


def measure_world_size(args: argparse.Namespace, world_size: int) -> dict:
    """Bring up a lab of ``world_size`` hosts, run one worker per host, return rank 0's times."""
    worker = [sys.executable, str(Path(__file__).resolve()), "--worker", "--sizes", ",".join(map(str, args.sizes)),
              "--algorithms", ",".join(args.algorithms), "--rounds", str(args.rounds)]
    shape = {"hosts": world_size, "link": args.link}
    if args.nodes is not None:
        shape.update(nodes=args.nodes, uplink=args.uplink, placement=placement_of(args, world_size))
    with EmulatedCluster(**shape) as lab:
        results = lab.run(worker, timeout=args.timeout)
    return json.loads(results[0].stdout.splitlines()[-1])


def print_table(args: argparse.Namespace, measured: dict[int, dict]) -> list[dict]:
    """The table of median time / link limit, and / the first algorithm; returns the rows for --json."""
    rate = args.uplink or args.link
    bytes_per_s = parse_rate(rate) / 8
    network = f"{args.nodes} nodes, {rate} uplinks" if args.nodes else f"{rate} links"
    if args.placement:
        network += f", placement {args.placement}"
    first = args.algorithms[0]
    width = max(17, *(len(spec) + 1 for spec in args.algorithms))
    rows = []
    for nbytes in args.sizes:
        print(f"\n# all-reduce of {format_size(nbytes)} on {network}: slowest rank's time, median of "
              f"{args.rounds}, / the link limit 2(p-1)/p * n / B (n: the bytes on the wire)  [/ {first}, side by "
              "side]" + ("  {/ its fp32 twin}" if any(fp32_twin(spec) in args.algorithms for spec in args.algorithms)
                         else ""))
        print(f"# {'p':>3} {'limit(s)':>9} " + " ".join(f"{spec:>{width + 7}}" for spec in args.algorithms))
        for world_size, times in measured.items():
            reference = statistics.median(times[f"{first} {nbytes}"])
            base_limit = all_reduce_bus_factor(world_size) * nbytes / bytes_per_s  # the buffer as it is
            cells = []
            for spec in args.algorithms:
                rounds = times[f"{spec} {nbytes}"]
                median = statistics.median(rounds)
                limit = all_reduce_bus_factor(world_size) * nbytes * wire_ratio(algorithm_and_options(spec)[1]) / bytes_per_s
                twin = fp32_twin(spec)
                twin_ratio = median / statistics.median(times[f"{twin} {nbytes}"]) if twin in args.algorithms else None
                cells.append(f"{median / limit:>{width - 9}.2f}x [{median / reference:4.2f}]"
                             + (f" {{{twin_ratio:4.2f}}}" if twin_ratio is not None else " " * 7))
                rows.append({"algorithm": spec, "world_size": world_size, "nbytes": nbytes, "link": args.link,
                             "nodes": args.nodes, "uplink": args.uplink, "placement": placement_of(args, world_size),
                             "times_s": rounds, "median_s": median, "limit_s": limit, "x_limit": median / limit,
                             "x_first": median / reference, "x_fp32_twin": twin_ratio})
            print(f"  {world_size:>3} {base_limit:>9.3f} " + " ".join(cells))
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_on_ranks(measure_on_rank, args, nproc=1)  # the lab set torchrun's variables: joins them
        return 0
    try:
        measured = {p: measure_world_size(args, p) for p in args.world_sizes}
    except LabError as error:
        print(f"benchmarks/network.py: {error}", file=sys.stderr)
        return 2
    rows = print_table(args, measured)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
        print(f"# wrote {len(rows)} rows to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
