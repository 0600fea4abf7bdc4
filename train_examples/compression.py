"""Fewer bytes on the wire: fp32, bf16 and bf16 with error feedback, against PyTorch's own hooks.

Every arm trains the same byte-level language model (``train_examples/char_lm.py``: the same
initial weights, the same batches on each rank) for ``--steps`` optimizer steps with one way of
averaging the gradients:

==========================  ===============================================================
``fp32``                    our hook (``--algorithm``, ring by default), buckets as they are
``bf16``, ``fp16``          ``wire_dtype="bf16"`` / ``"fp16"``: half the bytes on the wire,
                            partial sums added in fp32, rounded once per hop
``bf16+feedback``           the same with ``error_feedback=True``: what rounding lost goes
                            back in at the next step
``bf16_compress_hook``      PyTorch's own (``default_hooks.py``), run unchanged inside our hook
                            (``register(model, hook=bf16_compress_hook)``), timed like ours
``powersgd``                PyTorch's PowerSGD (rank ``--powersgd-rank``, plain all-reduce for
                            the first ``--powersgd-start`` steps), inside our hook the same way,
                            in one bucket (see below)
``no-hook``                 DDP's own all-reduce (not in the default arms)
==========================  ===============================================================

Rank 0 prints each arm's step time (the slowest rank's, median over the steps) and its loss
after the last steps (the mean of the last 10, averaged over the ranks) next to fp32's. Each
arm writes a TensorBoard run of its own, side by side under ``--log-dir``: ``train/loss`` and
``train/step_ms`` every step, and, every ``--log-every`` steps, our hook's ``comm/*`` tags
(``wire_bytes`` next to ``bytes``): PyTorch's hooks run inside ours (``hook=``), so their arms
have them too (``comm/bucket_{i}/hook_ms``: the hook, from its call to its Future's end).

Run it on the emulated network, where bytes cost what a link charges for them, or anywhere::

    ddp-ring-hooks lab torchrun --hosts 2 --link 400Mbit train_examples/compression.py --steps 200
    torchrun --standalone --nproc_per_node=2 train_examples/compression.py --steps 50
    tensorboard --logdir runs/compression

PowerSGD gets one gradient bucket: on gloo its hook issues its second all-reduce of a bucket
from the first one's callback, on whichever thread finishes it, so with several buckets in flight
the ranks can issue them in different orders ("Received data size doesn't match expected size",
or a hang; seen here with 1 MiB buckets). NCCL orders them on one stream.

On a loopback (one machine, no link to save) compression does not pay: the casts cost CPU time
and nothing on the wire got slower. ``docs/compression.md`` has the measurements.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

import ddp_ring_hooks
from char_lm import VOCAB_SIZE, ByteWindows, CharLanguageModel, read_corpus  # next to this file
from ddp_ring_hooks import accepted_algorithms
from ddp_ring_hooks.progress import progress_bar

OURS = {"fp32": {}, "bf16": {"wire_dtype": "bf16"}, "fp16": {"wire_dtype": "fp16"},
        "bf16+feedback": {"wire_dtype": "bf16", "error_feedback": True}}
PYTORCH = ("bf16_compress_hook", "powersgd", "no-hook")
DEFAULT_ARMS = "fp32,bf16,bf16+feedback,fp16,bf16_compress_hook,powersgd"
#: The loss reported: the mean of this many last steps (one step's loss is noisy).
LAST_STEPS = 10
#: PowerSGD's bucket size: the whole model in one (see the module docstring).
ONE_BUCKET_MB = 1024.0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", default=DEFAULT_ARMS, metavar="A,B,...",
                        help=f"arms, from {', '.join([*OURS, *PYTORCH])} (default: {DEFAULT_ARMS})")
    parser.add_argument("--algorithm", default="ring", choices=accepted_algorithms(),
                        help="our hook's algorithm in the fp32/bf16/fp16 arms (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per arm (default: %(default)s)")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=64, help="bytes per sequence (default: %(default)s)")
    parser.add_argument("--width", type=int, default=128, help="model width (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--bucket-cap-mb", type=float, default=1.0, help="DDP bucket size in MiB (default: %(default)s)")
    parser.add_argument("--powersgd-rank", type=int, default=2,
                        help="PowerSGD's matrix approximation rank (default: %(default)s)")
    parser.add_argument("--powersgd-start", type=int, default=10,
                        help="steps of plain all-reduce before PowerSGD compresses (default: %(default)s)")
    parser.add_argument("--log-dir", default="runs/compression", help="one TensorBoard run per arm in here (default: %(default)s)")
    parser.add_argument("--log-every", type=int, default=10, help="our hook's comm/* tags every N steps (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)
    args.arms = [arm.strip() for arm in args.arms.split(",") if arm.strip()]
    unknown = [arm for arm in args.arms if arm not in OURS and arm not in PYTORCH]
    if unknown:
        parser.error(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join([*OURS, *PYTORCH])}")
    if min(args.steps, args.micro_batch, args.seq_len, args.width, args.layers, args.log_every) < 1:
        parser.error("--steps, --micro-batch, --seq-len, --width, --layers and --log-every must be at least 1")
    return args


def attach(arm: str, model: DistributedDataParallel, args: argparse.Namespace):
    """Put the arm's way of averaging on ``model``; our hook's state. PyTorch's hooks run unchanged
    inside ours (``hook=``), timed like our arms: their ``comm/*`` tags sit beside ours."""
    telemetry = {"log_dir": os.path.join(args.log_dir, arm), "log_every": args.log_every}
    if arm in OURS:
        return ddp_ring_hooks.register(model, algorithm=args.algorithm, **telemetry, **OURS[arm])
    if arm == "bf16_compress_hook":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

        return ddp_ring_hooks.register(model, hook=bf16_compress_hook, **telemetry)
    if arm == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=args.powersgd_rank,
            start_powerSGD_iter=args.powersgd_start, use_error_feedback=True, warm_start=True,
        )
        return ddp_ring_hooks.register(model, hook=powerSGD_hook.powerSGD_hook, hook_state=state, **telemetry)
    return None


def train(arm: str, args: argparse.Namespace, data: DataLoader, writer) -> dict:
    """One arm: ``--steps`` steps from the same start; its losses and the slowest rank's step times."""
    torch.manual_seed(0)
    bucket_cap_mb = ONE_BUCKET_MB if arm == "powersgd" else args.bucket_cap_mb  # see the module docstring
    model = DistributedDataParallel(
        CharLanguageModel(seq_len=args.seq_len, width=args.width, num_layers=args.layers), bucket_cap_mb=bucket_cap_mb,
    )
    state = attach(arm, model, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, times = [], []
    batches = iter(data)
    bar = progress_bar(args.steps, arm, unit="step", enabled=dist.get_rank() == 0 and not args.no_progress)
    for step in range(args.steps):
        try:
            inputs, targets = next(batches)
        except StopIteration:
            batches = iter(data)
            inputs, targets = next(batches)
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(inputs).view(-1, VOCAB_SIZE), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
        losses.append(float(loss.detach()))
        if writer is not None:
            writer.add_scalar("train/loss", losses[-1], step + 1)
            writer.add_scalar("train/step_ms", times[-1] * 1e3, step + 1)
        bar.update()
    bar.close()
    summary = state.summary() if state is not None else ""
    if state is not None:
        state.close()
    # Across the ranks: the slowest rank's time per step, the mean loss.
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    last = torch.tensor([statistics.fmean(losses[-LAST_STEPS:]), losses[-1]], dtype=torch.float64)
    dist.all_reduce(last)
    last /= dist.get_world_size()
    return {"step_ms": statistics.median(slowest.tolist()[1:] or slowest.tolist()) * 1e3,
            "loss": float(last[0]), "final_loss": float(last[1]), "summary": summary}


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    windows = ByteWindows(read_corpus(), args.seq_len)
    # Every arm sees the same batches: the same sampler seed, one shard per rank.
    data = DataLoader(windows, batch_size=args.micro_batch, drop_last=True,
                      sampler=DistributedSampler(windows, shuffle=True, seed=0))
    results = {}
    for arm in args.arms:
        writer = None
        if rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(os.path.join(args.log_dir, arm))
        results[arm] = train(arm, args, data, writer)
        if writer is not None:
            writer.close()
    if rank == 0:
        print(f"\n# {dist.get_world_size()} ranks, {args.steps} steps per arm, {args.algorithm} for our hook's arms; "
              f"step time: slowest rank, median; loss: mean of the last {LAST_STEPS} steps over the ranks")
        print(f"# {'arm':>20} {'ms/step':>9} {'loss':>8} {'bits/byte':>9} {'vs fp32':>9}")
        reference = results.get("fp32", next(iter(results.values())))
        for arm, found in results.items():
            versus = f"{(found['loss'] / reference['loss'] - 1) * 100:+.3f}%"
            print(f"  {arm:>20} {found['step_ms']:>9.1f} {found['loss']:>8.5f} {found['loss'] / math.log(2):>9.3f} "
                  f"{versus:>9}")
        wire = [line.strip() for found in results.values() for line in found["summary"].splitlines()
                if "on the wire" in line or "error feedback" in line]
        for line in dict.fromkeys(wire):
            print(f"# {line}")
        print(f"# TensorBoard: tensorboard --logdir {args.log_dir}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
