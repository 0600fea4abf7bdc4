r"""Train the character-level language model with Lightning and the ring all-reduce hook.

    torchrun --standalone --nproc_per_node=2 train_examples/train_char_lm.py
    tensorboard --logdir runs/char_lm

One strategy argument (``strategy="ddp_ring"``, or ``RingDDPStrategy(...)`` with options)
puts the ring hook on every gradient bucket, on CPU/gloo too, where Lightning's own
DDPStrategy would silently skip a hook. Two callbacks put the
hook's communication timing (``comm/*``) and the throughput (``throughput/*``) into the same
TensorBoard run as the loss, with the optimizer step as the x axis.

A checkpoint is saved at the end (``--output-dir/version_N/checkpoints``), and the hook's
timeline beside the run's events (``ddp-ring-hooks advise runs/char_lm/version_N`` reads it).
``--resume last`` continues from the newest checkpoint under ``--output-dir`` (or ``--resume
PATH`` from that one) for ``--max-steps`` more steps, with the hook attached again, in the same
TensorBoard run (its step axis continues)::

    torchrun --standalone --nproc_per_node=2 train_examples/train_char_lm.py --resume last   # steps 201-400

On resume Lightning warns that "your dataloader is not resumable": the checkpoint keeps the
step but not the data loader's place in its epoch, so the resumed run starts that epoch's
shuffled order again from its first batch, and its first steps repeat batches it trained on
before. The loss curve continues; this script says so in one note instead of the warning.

``--strategy ddp`` runs Lightning's plain DDP for comparison. One GPU per process when the node
has enough of them (``--accelerator``), else CPU. Multi-node: the usual torchrun flags (``--nnodes``, ``--rdzv-endpoint``).
"""

from __future__ import annotations

import argparse
import os
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from char_lm import (
    add_model_arguments,
    make_dataloader,
    model_from_args,
    quiet_lightning,
    save_timeline,
    torchrun_placement,
    warn_if_oversubscribed,
)
from lightning.pytorch.loggers import TensorBoardLogger

from ddp_ring_hooks import accepted_algorithms
from ddp_ring_hooks.integrations.lightning import CommTimingLogger, RingDDPStrategy, ThroughputLogger
from ddp_ring_hooks.interrupts import exit_promptly_on_ctrl_c


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", choices=("ddp_ring", "ddp"), default="ddp_ring",
                        help="ddp_ring: our hook; ddp: Lightning's plain DDP (default: %(default)s)")
    parser.add_argument("--algorithm", choices=accepted_algorithms(), default="ring",
                        help="all-reduce algorithm of the hook (default: %(default)s)")
    parser.add_argument("--max-steps", type=int, default=200,
                        help="optimizer steps to train; with --resume, steps beyond the checkpoint's (default: %(default)s)")
    parser.add_argument("--micro-batch", type=int, default=8,
                        help="sequences per rank per forward/backward (default: %(default)s)")
    parser.add_argument("--accumulate-grad-batches", type=int, default=1,
                        help="micro-batches per optimizer step (default: %(default)s)")
    add_model_arguments(parser, seq_len=128)
    parser.add_argument("--learning-rate", type=float, default=3e-4, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--output-dir", default="runs/char_lm",
                        help="TensorBoard runs and checkpoints go here (default: %(default)s)")
    parser.add_argument("--resume", metavar="CKPT", default=None,
                        help="continue from this Lightning checkpoint, or 'last': the newest under --output-dir")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and data order (default: %(default)s)")
    return parser.parse_args(argv)


def find_checkpoint(checkpoint: str, output_dir: str) -> Path:
    """The checkpoint ``--resume`` names: a file, or ``last`` (the newest ``*.ckpt`` under
    ``output_dir``). Raises ``SystemExit`` listing the checkpoints there when it is neither."""
    found = sorted(Path(output_dir).glob("**/*.ckpt"), key=lambda p: p.stat().st_mtime)
    if checkpoint == "last" and found:
        return found[-1].resolve()
    if checkpoint != "last" and Path(checkpoint).is_file():
        return Path(checkpoint).resolve()
    listing = ("; checkpoints under {}: {}".format(output_dir, ", ".join(str(p) for p in found)) if found
               else f"; there is none under {output_dir} yet: train once without --resume")
    problem = "no checkpoint to resume" if checkpoint == "last" else "no such checkpoint file"
    raise SystemExit(f"--resume {checkpoint}: {problem}{listing} (--resume last takes the newest)")


def resume_point(checkpoint: Path | None, output_dir: str) -> tuple[int, TensorBoardLogger]:
    """The checkpoint's optimizer step (0 without one) and the TensorBoard logger to continue in.

    A checkpoint Lightning saved under ``<run>/checkpoints/`` continues in ``<run>``, so the
    loss curve goes on where it stopped instead of in an empty new ``version_N``."""
    if checkpoint is None:
        return 0, TensorBoardLogger(output_dir, name="", default_hp_metric=False)
    path = checkpoint
    step = int(torch.load(path, map_location="cpu", weights_only=False)["global_step"])
    if path.parent.name != "checkpoints":
        return step, TensorBoardLogger(output_dir, name="", default_hp_metric=False)
    run = path.parent.parent
    return step, TensorBoardLogger(run.parent, name="", version=run.name, default_hp_metric=False)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    checkpoint = find_checkpoint(args.resume, args.output_dir) if args.resume else None
    exit_promptly_on_ctrl_c()  # a rank waiting in C++ (a peer's rendezvous, say) still ends on Ctrl-C
    quiet_lightning()
    warnings.filterwarnings("ignore", ".*your dataloader is not resumable.*")  # explained below, in our words
    warn_if_oversubscribed(args.accelerator)
    pl.seed_everything(args.seed, verbose=False)

    model = model_from_args(args, learning_rate=args.learning_rate)
    data = make_dataloader(seq_len=args.seq_len, micro_batch=args.micro_batch, seed=args.seed)

    callbacks: list[pl.Callback] = [ThroughputLogger(tokens_per_sample=args.seq_len)]
    if args.strategy == "ddp_ring":
        strategy = RingDDPStrategy(args.algorithm, bucket_cap_mb=args.bucket_cap_mb)
        callbacks.append(CommTimingLogger())
    else:
        strategy = pl.strategies.DDPStrategy(bucket_cap_mb=args.bucket_cap_mb)

    start_step, logger = resume_point(checkpoint, args.output_dir)
    if checkpoint is not None and int(os.environ.get("RANK", "0")) == 0:
        print(f"resuming from {checkpoint} (step {start_step}); note: the data loader keeps no place in its epoch, "
              "so the epoch it stopped in starts again from its first batch and the first steps repeat batches "
              "seen before (Lightning's 'dataloader is not resumable' warning)", flush=True)
    trainer = pl.Trainer(
        **torchrun_placement(args.accelerator),
        strategy=strategy,
        max_steps=start_step + args.max_steps,
        accumulate_grad_batches=args.accumulate_grad_batches,
        logger=logger,
        callbacks=callbacks,
        log_every_n_steps=1,
        enable_model_summary=False,
    )
    trainer.fit(model, data, ckpt_path=checkpoint)
    if isinstance(strategy, RingDDPStrategy) and trainer.is_global_zero:
        save_timeline(strategy.hook_state, trainer.logger.log_dir)

    if trainer.is_global_zero:
        print(f"trained optimizer steps {start_step + 1}-{trainer.global_step}; "
              f"final loss {float(trainer.callback_metrics['train/loss']):.3f}")
        print(f"TensorBoard run: {trainer.logger.log_dir}   (tensorboard --logdir {args.output_dir}; "
              f"ddp-ring-hooks advise {trainer.logger.log_dir})")
        if isinstance(strategy, RingDDPStrategy):
            print(strategy.hook_state.summary())


if __name__ == "__main__":
    main()
