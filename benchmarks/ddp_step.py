"""DDP steps side by side: no hook, PyTorch's ``allreduce_hook``, and our hook's algorithms.

Copies of the same MLP (same initial weights, several gradient buckets) train on the same
data, one per *arm*:

- ``no-hook``: DDP's builtin all-reduce (the reducer scales while copying into the bucket,
  gloo/NCCL all-reduce in C++): the limit.
- ``allreduce_hook``: PyTorch's own Python hook, the honest peer of any Python hook.
- ``ring``, ``tree``, ...: ``ddp_ring_hooks.register(model, algorithm=...)``.
- ``native``: our hook with the group's own all-reduce (bit-identical to no-hook);
  ``native+telemetry``: the same with per-bucket TensorBoard logging every step.
- ``auto``: the hook's per-bucket choice (native included).
- fewer bytes on the wire: ``ALGORITHM@bf16`` (or ``@fp16``) is the hook with
  ``wire_dtype="bf16"``, ``ALGORITHM@bf16+feedback`` the same with ``error_feedback=True``;
  ``bf16_compress_hook`` and ``fp16_compress_hook`` are PyTorch's own, registered directly on
  DDP (the 16-bit baseline a fair comparison of compression needs). On a network (the lab)::

      ddp-ring-hooks lab torchrun --hosts 2 --link 400Mbit benchmarks/ddp_step.py --layers 4 --rounds 6 \
          --arms no-hook,bf16_compress_hook,ring@bf16,native@bf16,ring

Every round times one block of steps per arm, in an order rotated each round, so drifting
load on a shared machine hits every arm alike; each round gives each arm's ratio to
``no-hook``, to ``allreduce_hook`` and to PyTorch's compress hooks (those measured), and the
table shows the medians::

    python benchmarks/ddp_step.py                                  # 2, then 4 local gloo ranks
    python benchmarks/ddp_step.py --nproc 2 --algorithm auto       # no-hook, allreduce_hook, auto
    python benchmarks/ddp_step.py --arms no-hook,allreduce_hook,ring,native,native+telemetry,auto
    python benchmarks/ddp_step.py --bucket-cap-mb 25               # DDP's default bucket size
    torchrun --standalone --nproc_per_node=4 benchmarks/ddp_step.py    # one world size

A block starts after a barrier; its time is the slowest rank's, per step. A step is
forward, backward (the hook overlaps communication with it) and an SGD update.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
    allreduce_hook, bf16_compress_hook, fp16_compress_hook,
)
from torch.nn.parallel import DistributedDataParallel

import ddp_ring_hooks
from ddp_ring_hooks.hooks.foreign import registrable
from ddp_ring_hooks.launch import run_on_ranks, under_torchrun
from ddp_ring_hooks import accepted_algorithms
from mlp_steps import build_mlp_ddp, time_steps

NO_HOOK, TORCH_HOOK, TELEMETRY_SUFFIX = "no-hook", "allreduce_hook", "+telemetry"
BASELINES = (NO_HOOK, TORCH_HOOK)
FEEDBACK_SUFFIX = "+feedback"
WIRES = ("bf16", "fp16")


#: PyTorch's own 16-bit hooks, registered directly on DDP.
#: (DDP refuses bf16_compress_hook by its name without CUDA and NCCL, though gloo runs it: registrable
#: gives it a name DDP takes on any machine.)
TORCH_COMPRESS_HOOKS = {"bf16_compress_hook": registrable(bf16_compress_hook), "fp16_compress_hook": fp16_compress_hook}


def known_arms() -> tuple[str, ...]:
    hooks = accepted_algorithms()
    on_the_wire = [f"{name}@{wire}{suffix}" for name in hooks for wire in WIRES for suffix in ("", FEEDBACK_SUFFIX)]
    return (*BASELINES, *TORCH_COMPRESS_HOOKS, *hooks, *(name + TELEMETRY_SUFFIX for name in hooks), *on_the_wire)


def hook_options(name: str) -> tuple[str, dict]:
    """``"ring@bf16+feedback"`` -> ``("ring", {"wire_dtype": "bf16", "error_feedback": True})``."""
    feedback = name.endswith(FEEDBACK_SUFFIX)
    algorithm, _, wire = name.removesuffix(FEEDBACK_SUFFIX).partition("@")
    options = {"wire_dtype": wire} if wire else {}
    return algorithm, {**options, **({"error_feedback": True} if feedback else {})}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", default="2,4", metavar="N[,N...]",
                        help="world sizes to spawn in turn when not under torchrun (default: 2,4)")
    parser.add_argument("--algorithm", default=None, metavar="NAME",
                        help="one hook arm next to no-hook and allreduce_hook (e.g. auto); overrides --arms")
    parser.add_argument("--arms", default="no-hook,allreduce_hook,ring,native,auto", metavar="A,B,...",
                        help=f"arms to compare, from {', '.join(BASELINES)}, {', '.join(TORCH_COMPRESS_HOOKS)}, any "
                             "algorithm (ring, ..., native, auto), ALGORITHM+telemetry, ALGORITHM@bf16 (or @fp16: "
                             "wire_dtype) and ALGORITHM@bf16+feedback (with error_feedback) "
                             "(default: no-hook,allreduce_hook,ring,native,auto)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds of one block per arm (default: 10)")
    parser.add_argument("--steps", type=int, default=5, help="training steps per block (default: 5)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per model first (default: 3)")
    parser.add_argument("--width", type=int, default=1024, help="hidden width of the MLP (default: 1024)")
    parser.add_argument("--layers", type=int, default=8, help="linear layers of the MLP (default: 8)")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step (default: 64)")
    parser.add_argument("--bucket-cap-mb", type=float, default=4.0,
                        help="DDP bucket size in MiB (DDP's default is 25; default here: 4, several buckets)")
    parser.add_argument("--min-buckets", type=int, default=2,
                        help="fail when the model has fewer gradient buckets than this (default: 2)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a rank may wait for its peers (default: 600)")
    args = parser.parse_args(argv)
    try:
        args.world_sizes = [int(n) for n in args.nproc.split(",")]
    except ValueError:
        parser.error(f"--nproc takes comma-separated integers like 2,4, got {args.nproc!r}")
    names = [*BASELINES, args.algorithm] if args.algorithm else [a.strip() for a in args.arms.split(",") if a.strip()]
    args.arm_names = list(dict.fromkeys(names))
    unknown = [a for a in args.arm_names if a not in known_arms()]
    if unknown:
        parser.error(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(known_arms())}")
    if any(n < 2 for n in args.world_sizes):
        parser.error("every --nproc world size must be at least 2")
    if min(args.rounds, args.steps, args.layers, args.width, args.batch) < 1 or args.warmup < 0:
        parser.error("--rounds, --steps, --layers, --width and --batch must be at least 1, --warmup at least 0")
    return args


def count_buckets(model: DistributedDataParallel) -> int:
    # DDP has no public bucket count; the reducer's bucket list is the ground truth.
    return len(model.reducer._get_zeros_like_grad_buckets())


def build_arm(name: str, args: argparse.Namespace, log_root: str):
    """(model, optimizer, hook state or None) for one arm."""
    model = build_mlp_ddp(layers=args.layers, width=args.width, bucket_cap_mb=args.bucket_cap_mb)
    state = None
    if name == TORCH_HOOK:
        model.register_comm_hook(None, allreduce_hook)
    elif name in TORCH_COMPRESS_HOOKS:
        model.register_comm_hook(None, TORCH_COMPRESS_HOOKS[name])
    elif name.endswith(TELEMETRY_SUFFIX):
        algorithm = name.removesuffix(TELEMETRY_SUFFIX)
        state = ddp_ring_hooks.register(model, algorithm=algorithm, log_dir=os.path.join(log_root, name), log_every=1)
    elif name != NO_HOOK:
        algorithm, options = hook_options(name)
        state = ddp_ring_hooks.register(model, algorithm=algorithm, **options)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3), state


def measure(args: argparse.Namespace) -> dict:
    """Run on every rank: rotate blocks of the arms; rank 0 shows progress."""
    rank = dist.get_rank()
    log_root = tempfile.mkdtemp(prefix="ddp_step_tb_")
    arms = {name: build_arm(name, args, log_root) for name in args.arm_names}
    inputs = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))
    for model, optimizer, _ in arms.values():
        time_steps(model, optimizer, inputs, args.warmup)
    rounds = range(args.rounds)
    if rank == 0:
        try:
            from tqdm import tqdm
        except ImportError:  # the bar is a nicety; tqdm comes with the [examples] extra
            pass
        else:
            rounds = tqdm(rounds, desc=f"{dist.get_world_size()} ranks, rounds", leave=False)
    names = list(arms)
    times: dict[str, list[float]] = {name: [] for name in names}
    for index in rounds:
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(time_steps(*arms[name][:2], inputs, args.steps)[0])
    for _, _, state in arms.values():
        if state is not None:
            state.close()
    buckets = count_buckets(next(iter(arms.values()))[0])  # DDP settles its buckets after the first step
    if buckets < args.min_buckets:
        raise ValueError(f"the model has {buckets} gradient buckets, fewer than --min-buckets "
                         f"{args.min_buckets}; lower --bucket-cap-mb or add --layers")
    ratios = {
        (name, base): statistics.median(t / b for t, b in zip(times[name], times[base]))
        for name in names for base in baselines(names)
    }
    return {
        "world_size": dist.get_world_size(), "buckets": buckets,
        "ms": {name: statistics.median(times[name]) for name in names}, "ratios": ratios,
    }


def baselines(names) -> list[str]:
    """The arms the others are divided by, round by round: no-hook and PyTorch's hooks, measured."""
    return [base for base in (*BASELINES, *TORCH_COMPRESS_HOOKS) if base in names]


def format_results(results: list[dict], args: argparse.Namespace) -> str:
    bases = baselines(args.arm_names)
    lines = [
        f"# DDP step: {args.layers}x{args.width} MLP, batch {args.batch}/rank, bucket_cap_mb {args.bucket_cap_mb}, "
        f"gloo; {args.rounds} rounds x {args.steps} steps per arm (order rotated); slowest rank; medians",
        f"# {'ranks':>5} {'buckets':>7} {'arm':>22} {'ms/step':>9} " + " ".join(f"{'/' + b:>20}" for b in bases),
    ]
    for r in results:
        for name, ms in r["ms"].items():
            cells = " ".join(f"{r['ratios'][(name, b)]:>20.3f}" for b in bases)
            lines.append(f"  {r['world_size']:>5} {r['buckets']:>7} {name:>22} {ms:>9.2f} {cells}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if under_torchrun():
        result = run_on_ranks(measure, args, nproc=0, backend="gloo", timeout_s=args.timeout)
        if int(os.environ["RANK"]) != 0:  # rank 0 prints the table
            return 0
        results = [result]
    else:
        results = [run_on_ranks(measure, args, nproc=n, timeout_s=args.timeout) for n in args.world_sizes]
    sys.stdout.write(format_results(results, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
