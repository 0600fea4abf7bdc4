"""Which CPU kernels the executor casts with on a narrower wire, and why: one thread, 4M elements.

The executor (``runtime/executor.py``) could fuse each cast into the pass next to it with one
mixed-dtype kernel (add a bf16 piece into an fp32 one; divide fp32 into a bf16 output), or do a
plain ``copy_`` cast and then the same-dtype kernel. On CPU the second is faster: the mixed
kernels take a slow path (they convert element by element, or into a temporary). This times
both ways, median of ``--repeats``::

    python benchmarks/cast_kernels.py
    python benchmarks/cast_kernels.py --numel 1048576 --repeats 50
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def timed(call, repeats: int) -> float:
    """Median milliseconds of ``call()`` after one untimed call."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=4 << 20, help="elements per buffer (default: 4194304)")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per kernel (default: 20)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    piece, received = torch.randn(args.numel), torch.randn(args.numel)
    wide = torch.empty(args.numel)
    divisor = torch.tensor(4.0)
    print(f"# {args.numel} elements, 1 thread, median of {args.repeats} (ms)")
    for wire in (torch.bfloat16, torch.float16):
        name = str(wire).removeprefix("torch.")
        image = received.to(wire)
        rows = {
            f"fp32 += {name}, one mixed kernel": lambda: piece.add_(image),
            f"fp32 += {name}, widen then add": lambda: piece.add_(wide.copy_(image)),
            f"fp32 / p -> {name}, one mixed kernel": lambda: torch.div(piece, divisor, out=image),
            f"fp32 / p -> {name}, divide then cast": lambda: image.copy_(piece.div_(divisor)),
            f"cast fp32 -> {name} alone": lambda: image.copy_(piece),
            f"cast {name} -> fp32 alone": lambda: wide.copy_(image),
        }
        for label, call in rows.items():
            print(f"  {label:<40} {timed(call, args.repeats):8.2f}")
    print(f"  {'fp32 += fp32 (for scale)':<40} {timed(lambda: piece.add_(received), args.repeats):8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
