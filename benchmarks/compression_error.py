"""How far a low-precision all-reduce is from the exact average: ours against PyTorch's own hook.

On ``p`` real gloo ranks (spawned here, loopback), every rank averages the same seeded gradients
(normal, or ``--scale``-d ones) three ways, and the result is compared with the exact average,
summed in float64:

- ``ours``: each of ``--algorithms`` with ``wire_dtype`` bf16 or fp16 (``ddp_ring_hooks``'s
  executor: each contribution divided in fp32, each partial sum added in fp32 and rounded once
  to the wire dtype when sent, the result rounded once);
- ``pytorch``: ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks._compress_hook``, the
  function behind ``bf16_compress_hook`` / ``fp16_compress_hook``, called as DDP calls it (cast,
  divide in the wire dtype, gloo's all-reduce in the wire dtype, cast back);
- ``native``: our ``native`` with the same wire (it should equal ``pytorch``: the same steps).

Two errors, against ``s``, the exact average:

- the *relative error* ``||y - s|| / ||s||`` (2-norms over the buffer), the largest over
  ``--trials`` seeded inputs: what the issue's target compares (``--check``: exit status 1
  unless ours is at most PyTorch's at every ``p`` and wire);
- the largest *elementwise* error ``max_i |y_i - s_i| / m_i``, ``m_i = Σ_r |x_ri| / p`` (what no
  partial sum exceeds), in units of the wire's unit roundoff ``u`` (bf16 2^-8, fp16 2^-11): the
  measure of the documented bound, ``p · u``. Both ways reach the same worst elements (a chain of
  large partial sums each rounded by half a step), so this maximum is a near tie at small ``p``;
  ours rounds fewer values (no contribution but the chain's first is rounded alone), which the
  norm shows.

::

    python benchmarks/compression_error.py                       # p = 2, 4, 8; bf16, fp16; 1M elements
    python benchmarks/compression_error.py --world-sizes 2,4,8 --numel 1048576 --trials 3 --check --json error.json
    python benchmarks/compression_error.py --wires fp16 --scale 1e-6   # fp16's guard: tiny gradients

``--scale 1e-6``: what dividing first costs fp16. Gradients of 1e-6 divided by ``p`` fall below
fp16's smallest normal number (6.1e-5) into its subnormals, whose spacing is a fixed 6e-8, so
the relative error grows as the values shrink; PyTorch's hook divides in fp16 too (after its
cast) and pays the same. bf16 has fp32's exponent range and pays nothing for the division.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository, when not installed

from ddp_ring_hooks import all_reduce  # noqa: E402
from ddp_ring_hooks.launch import spawn_ranks  # noqa: E402
from ddp_ring_hooks.progress import progress_bar  # noqa: E402

WIRES = {"bf16": torch.bfloat16, "fp16": torch.float16}
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", default="2,4,8", metavar="P[,P...]", help="ranks, in turn (default: 2,4,8)")
    parser.add_argument("--wires", default="bf16,fp16", metavar="W[,W...]", help="wire dtypes (default: bf16,fp16)")
    parser.add_argument("--algorithms", default="ring,halving_doubling,tree", metavar="A,B,...",
                        help="our algorithms to measure (default: ring,halving_doubling,tree)")
    parser.add_argument("--numel", type=int, default=1 << 20, metavar="N", help="elements per rank (default: 1048576)")
    parser.add_argument("--scale", type=float, default=1.0, metavar="S",
                        help="gradients ~ S * N(0, 1) (default: 1; try 1e-6 for fp16's subnormals)")
    parser.add_argument("--trials", type=int, default=3, metavar="T", help="seeded inputs per p (default: 3)")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 unless ours <= PyTorch's relative error at every p and wire")
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS", help="per world size (default: 600)")
    args = parser.parse_args(argv)
    args.world_sizes = [int(p) for p in args.world_sizes.split(",")]
    args.wires = [w.strip() for w in args.wires.split(",")]
    args.algorithms = [a.strip() for a in args.algorithms.split(",")]
    if set(args.wires) - set(WIRES) or min(args.world_sizes) < 2 or args.numel < 1:
        parser.error(f"wires are some of {', '.join(WIRES)}; world sizes >= 2; --numel >= 1")
    return args


def pytorch_hook(tensor: torch.Tensor, wire: torch.dtype) -> None:
    """PyTorch's compress hook on ``tensor`` (a bucket as a tuple, which it accepts), in place."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import _compress_hook

    _compress_hook(wire, dist.group.WORLD, (tensor,)).wait()


def errors_on_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    """Every (wire, method)'s errors on this rank's copy of the average (the same on every rank),
    the largest over the trials."""
    torch.set_num_threads(1)
    methods = {f"ours {a}": (lambda t, w, a=a: all_reduce_average(t, a, w)) for a in args.algorithms}
    methods["native"] = lambda t, w: all_reduce_average(t, "native", w)
    methods["pytorch"] = lambda t, w: pytorch_hook(t, WIRES[w])
    found: dict[str, dict] = {}
    for trial in range(args.trials):
        inputs = [torch.randn(args.numel, generator=torch.Generator().manual_seed(1000 * trial + r)) * args.scale
                  for r in range(world_size)]
        exact = torch.stack([x.double() / world_size for x in inputs]).sum(0)
        magnitude = torch.stack([x.double().abs() / world_size for x in inputs]).sum(0).clamp_min(1e-300)
        for wire in args.wires:
            for name, method in methods.items():
                result = inputs[rank].clone()
                method(result, wire)
                elementwise = float(((result.double() - exact).abs() / magnitude).max())
                relative = float((result.double() - exact).norm() / exact.norm())
                kept = found.setdefault(f"{wire} {name}", {"relative": 0.0, "max": 0.0, "finite": True})
                kept["relative"] = max(kept["relative"], relative)
                kept["max"] = max(kept["max"], elementwise)
                kept["finite"] = kept["finite"] and bool(result.isfinite().all())
    return found


def all_reduce_average(tensor: torch.Tensor, algorithm: str, wire: str) -> None:
    """The hook's average: what ``HookState`` runs for a bucket, through the library's API."""
    from ddp_ring_hooks.runtime import run_schedule
    from ddp_ring_hooks.runtime.native import run_native
    from ddp_ring_hooks.schedules import checked_schedule

    if algorithm == "native":
        run_native(tensor, average=True, wire=WIRES[wire]).wait()
    else:
        schedule = checked_schedule(algorithm, dist.get_world_size(), nbytes=tensor.numel() * 4, wire_dtype=wire)
        run_schedule(schedule, tensor, divisor=dist.get_world_size())


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = []
    bar = progress_bar(len(args.world_sizes), "world sizes", unit="p")
    for world_size in args.world_sizes:
        found = spawn_ranks(errors_on_rank, world_size, args, timeout=args.timeout)[0]
        for key, value in found.items():
            wire, method = key.split(" ", 1)
            rows.append({"world_size": world_size, "wire": wire, "method": method, **value})
        bar.update()
    bar.close()
    print(f"# {args.numel} elements per rank, gradients ~ {args.scale:g} * N(0, 1), the largest of {args.trials} "
          "trials; relative error ||y - s|| / ||s|| [largest elementwise |y - s| / (sum_r |x_r| / p), in units of the "
          "wire's unit roundoff u; the bound: p u]")
    methods = list(dict.fromkeys(row["method"] for row in rows))
    print(f"# {'wire':>4} {'p':>3} " + " ".join(f"{m:>26}" for m in methods))
    failed = []
    for wire in args.wires:
        u = UNIT_ROUNDOFF[WIRES[wire]]
        for world_size in args.world_sizes:
            mine = {row["method"]: row for row in rows if row["wire"] == wire and row["world_size"] == world_size}
            cells = [f"{mine[m]['relative']:.3e} [{mine[m]['max'] / u:5.2f} u]" + ("" if mine[m]["finite"] else " inf")
                     for m in methods]
            print(f"  {wire:>4} {world_size:>3} " + " ".join(f"{c:>26}" for c in cells))
            theirs = mine["pytorch"]["relative"]
            failed += [f"{wire} p={world_size} {m}: {mine[m]['relative']:.3e} > pytorch's {theirs:.3e}"
                       for m in methods if m.startswith("ours") and mine[m]["relative"] > theirs]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
        print(f"# wrote {len(rows)} rows to {args.json}")
    if failed:
        print("# ours has a larger relative error than PyTorch's hook here:\n#   " + "\n#   ".join(failed))
    else:
        print("# ours <= PyTorch's relative error at every p and wire")
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    sys.exit(main())
