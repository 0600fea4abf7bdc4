"""Samples/s of the Lightning example with the ring hook vs Lightning's default DDP.

    python benchmarks/lightning_throughput.py                 # starts torchrun with 2 ranks itself
    torchrun --standalone --nproc_per_node=2 benchmarks/lightning_throughput.py

Both sides train the same character-level language model (``train_examples/char_lm.py``)
from the same seed, with the same DDP buckets, one optimizer step per micro-batch (the
setting where communication weighs most). The only difference is who averages the
gradients: ``RingDDPStrategy`` (our ring all-reduce hook) or ``DDPStrategy`` (DDP's
built-in all-reduce: gloo on CPU, NCCL on GPU).

Runs alternate (ring, ddp, then ddp, ring, ...) so that a shared machine's drifting load hits
both sides alike. A run's samples/s is that of its median optimizer step after
``--warmup-steps`` (steps that another process slowed down do not count); each round gives
one ratio ring/ddp, and the result is the median ratio. Target: >= 0.95.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

# The workload lives in train_examples/, next to this folder; the checkout need not be installed.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddp_ring_hooks.launch import under_torchrun  # noqa: E402  (needs the path above)
from train_examples.char_lm import add_model_arguments, model_from_args  # noqa: E402

TARGET_RATIO = 0.95


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2,
                        help="ranks to start when run without torchrun (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=6,
                        help="pairs of runs (ring and ddp, alternating order) (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run (default: %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=3,
                        help="first steps of each run left out of the measurement (default: %(default)s)")
    parser.add_argument("--micro-batch", type=int, default=4,
                        help="sequences per rank per step (default: %(default)s)")
    add_model_arguments(parser)
    parser.add_argument("--output", default="runs/lightning_throughput.json",
                        help="write the measurements here as JSON (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup_steps:
        parser.error(f"--steps ({args.steps}) must exceed --warmup-steps ({args.warmup_steps})")
    return args


def relaunch_under_torchrun(args: argparse.Namespace, argv: list[str]) -> int:
    """Run this script again under torchrun (one node, ``--nproc`` ranks on a free local port)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               __file__, *argv]
    return subprocess.call(command)


def run_once(strategy_name: str, args: argparse.Namespace) -> float:
    """Train ``args.steps`` steps with one strategy; return samples/s of its median step after the warm-up."""
    import lightning.pytorch as pl

    from ddp_ring_hooks.integrations.lightning import RingDDPStrategy, ThroughputLogger
    from train_examples.char_lm import make_dataloader, torchrun_placement

    pl.seed_everything(0, verbose=False)
    model = model_from_args(args)
    if strategy_name == "ring":
        strategy = RingDDPStrategy(bucket_cap_mb=args.bucket_cap_mb)
    else:
        strategy = pl.strategies.DDPStrategy(bucket_cap_mb=args.bucket_cap_mb)
    throughput = ThroughputLogger()
    trainer = pl.Trainer(
        **torchrun_placement(args.accelerator), strategy=strategy, max_steps=args.steps, logger=False, callbacks=[throughput],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, make_dataloader(seq_len=args.seq_len, micro_batch=args.micro_batch))
    return throughput.summarize(skip_steps=args.warmup_steps).median_samples_per_s


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not under_torchrun():
        return relaunch_under_torchrun(args, argv)

    import torch.distributed as dist
    from tqdm import tqdm

    from train_examples.char_lm import quiet_lightning

    quiet_lightning()
    rank_zero = int(os.environ["RANK"]) == 0
    order = [(r, name) for r in range(args.rounds) for name in (("ring", "ddp") if r % 2 == 0 else ("ddp", "ring"))]
    measured: dict[tuple[int, str], float] = {}
    for r, name in tqdm(order, desc="alternating runs", disable=not rank_zero):
        measured[r, name] = run_once(name, args)

    if rank_zero:
        ratios = [measured[r, "ring"] / measured[r, "ddp"] for r in range(args.rounds)]
        print(f"\n{'round':>5} {'ring samples/s':>15} {'ddp samples/s':>14} {'ring/ddp':>9}")
        for r, ratio in enumerate(ratios):
            print(f"{r:>5} {measured[r, 'ring']:>15.1f} {measured[r, 'ddp']:>14.1f} {ratio:>9.3f}")
        median = statistics.median(ratios)
        verdict = "meets" if median >= TARGET_RATIO else "misses"
        world = int(os.environ["WORLD_SIZE"])
        print(f"\nmedian ring/ddp = {median:.3f} over {args.rounds} rounds, {world} ranks "
              f"({verdict} the target >= {TARGET_RATIO})")
        output = Path(args.output)
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps({
            "world_size": world,
            "settings": {name: value for name, value in vars(args).items() if name != "output"},
            "ring_samples_per_s": [measured[r, "ring"] for r in range(args.rounds)],
            "ddp_samples_per_s": [measured[r, "ddp"] for r in range(args.rounds)],
            "ratios": ratios,
            "median_ratio": median,
        }, indent=2) + "\n")
        print(f"wrote {output}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
