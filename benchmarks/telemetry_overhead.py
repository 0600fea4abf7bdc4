"""How much does per-bucket telemetry slow a DDP step? Telemetry on (log every step) vs off.

Two identical DDP models run the same ring hook; the only difference is
``register(model, log_dir=..., log_every=1)`` versus ``register(model)``. Blocks of steps
alternate between them (off, on, on, off, off, on, ...) so drifting machine load hits both
arms alike; each pair of blocks gives one ratio, and the script prints the median ratio
(target: <= 1.02). A block's time includes flushing the telemetry written during it, so the
writer thread's work is charged to the telemetry arm, not hidden in the next block::

    torchrun --nproc_per_node=2 benchmarks/telemetry_overhead.py --rounds 60 --steps 4

A block starts after a barrier; its time is the slowest rank's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import torch
import torch.distributed as dist

import ddp_ring_hooks
from mlp_steps import build_mlp_ddp, time_steps


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=60, help="pairs of blocks (one off, one on) (default: 60)")
    parser.add_argument("--steps", type=int, default=4, help="DDP steps per block (default: 4)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per model first (default: 3)")
    parser.add_argument("--width", type=int, default=1024, help="hidden width of the MLP (default: 1024)")
    parser.add_argument("--layers", type=int, default=6, help="hidden layers of the MLP (default: 6)")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step (default: 64)")
    parser.add_argument("--bucket-cap-mb", type=float, default=4.0, help="DDP bucket size in MiB (default: 4)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun: torchrun --nproc_per_node=2 benchmarks/telemetry_overhead.py")
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ratios, cpu_ratios, off_ms, on_ms, off_cpu, on_cpu = [], [], [], [], [], []
    rounds = range(args.rounds)
    if rank == 0:
        from tqdm import tqdm

        rounds = tqdm(rounds, desc="rounds (off/on pairs)")
    with tempfile.TemporaryDirectory() as log_dir:
        arms = {}
        for telemetry in (False, True):
            model = build_mlp_ddp(layers=args.layers, width=args.width, bucket_cap_mb=args.bucket_cap_mb)
            state = ddp_ring_hooks.register(model, **({"log_dir": log_dir, "log_every": 1} if telemetry else {}))
            arms[telemetry] = (model, torch.optim.SGD(model.parameters(), lr=1e-3), state)
        inputs = torch.randn(args.batch, args.width)
        for telemetry, (model, optimizer, state) in arms.items():
            time_steps(model, optimizer, inputs, args.warmup, before_stop=state.telemetry.flush)
        for round_index in rounds:
            order = (False, True) if round_index % 2 == 0 else (True, False)
            wall, cpu = {}, {}
            for telemetry in order:
                model, optimizer, state = arms[telemetry]
                wall[telemetry], cpu[telemetry] = time_steps(model, optimizer, inputs, args.steps, before_stop=state.telemetry.flush)
            off_ms.append(wall[False])
            on_ms.append(wall[True])
            ratios.append(wall[True] / wall[False])
            cpu_ratios.append(cpu[True] / cpu[False])
            off_cpu.append(cpu[False])
            on_cpu.append(cpu[True])
        summary = arms[True][2].summary()
        for _, _, state in arms.values():
            state.close()
    if rank == 0:
        print(
            f"world size {dist.get_world_size()}, {args.layers}x{args.width} MLP, batch {args.batch}, "
            f"{args.rounds} rounds x {args.steps} steps per block"
        )
        print(summary)
        print(f"step time off: median {statistics.median(off_ms):.2f} ms; on: median {statistics.median(on_ms):.2f} ms")
        print(f"ratios on/off: {' '.join(f'{r:.3f}' for r in ratios)}")
        print(
            f"CPU time per step (all threads) off: median {statistics.median(off_cpu):.2f} ms; "
            f"on: median {statistics.median(on_cpu):.2f} ms; median ratio {statistics.median(cpu_ratios):.3f}"
        )
        verdict = "meets" if statistics.median(ratios) <= 1.02 else "misses"
        print(f"median step-time ratio on/off: {statistics.median(ratios):.3f} ({verdict} the <= 1.02 target)")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
