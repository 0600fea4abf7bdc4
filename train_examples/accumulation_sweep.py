"""How many gradient-accumulation steps? Measure throughput against accumulate_grad_batches.

    torchrun --standalone --nproc_per_node=2 train_examples/accumulation_sweep.py
    tensorboard --logdir runs/accumulation_sweep

With k micro-batches per optimizer step, DDP communicates once per k backward passes (the
other k-1 run under ``no_sync``), so the communication cost per sample falls as 1/k::

    k=1   [fwd bwd|comm][fwd bwd|comm][fwd bwd|comm][fwd bwd|comm]   4 reductions
    k=4   [fwd bwd][fwd bwd][fwd bwd][fwd bwd|comm]                  1 reduction

Throughput rises with k until compute dominates; the price is a k times larger effective
batch (P * micro_batch * k samples per step), which changes the optimization.

For each k (default 1, 2, 4, 8) the script trains the same model from the same seed for the
same number of micro-batches, with the ring hook attached by ``RingDDPStrategy``, and
measures on global rank 0, leaving out the first ``--warmup-steps`` optimizer steps (DDP
reduces one big bucket in step 1 and rebuilds its buckets after it):

- samples/s: samples of all ranks divided by wall-clock time;
- communication ms per optimizer step: the time at least one bucket's all-reduce was in
  flight (the hook's telemetry, ``StepRecord.total_ms``; on CPU two buckets overlap), and
  the part of it backward could not hide (``exposed_ms``); on CPU these include waiting for
  the slower rank;
- communication share: communication ms / optimizer-step ms;
- speedup: samples/s relative to the smallest k.

Every setting runs ``--rounds`` times, in alternating order, and the table shows medians:
on a shared machine the load drifts, and alternating spreads it over all settings.

Output in ``--output-dir``: the printed table, ``results.json`` (one record per k),
``accumulation_sweep.png``, and one TensorBoard run per k and round
(``accumulate_<k>/round_<r>/``) with the loss, ``comm/*``, ``throughput/*`` and the
settings and results as hparams.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import lightning.pytorch as pl
import torch.distributed as dist
from char_lm import add_model_arguments, make_dataloader, model_from_args, quiet_lightning, torchrun_placement
from lightning.pytorch.loggers import TensorBoardLogger
from tqdm import tqdm

from ddp_ring_hooks.runtime.names import accepted_algorithms
from ddp_ring_hooks.integrations.lightning import (
    CommTimingLogger,
    RingDDPStrategy,
    ThroughputLogger,
)
from ddp_ring_hooks.telemetry import MemorySink

RESULTS_FILE = "results.json"
PLOT_FILE = "accumulation_sweep.png"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accumulate", default="1,2,4,8",
                        help="comma-separated accumulate_grad_batches values to compare (default: %(default)s)")
    parser.add_argument("--micro-batches", type=int, default=48,
                        help="micro-batches per rank to train for every setting; a multiple of every k "
                             "(default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="train every setting this many times, in alternating order, and report "
                             "medians (the machine's load drifts) (default: %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=1,
                        help="first optimizer steps left out of the measurement (default: %(default)s)")
    parser.add_argument("--micro-batch", type=int, default=4,
                        help="sequences per rank per forward/backward (default: %(default)s)")
    parser.add_argument("--algorithm", choices=accepted_algorithms(), default="ring",
                        help="all-reduce algorithm of the hook (default: %(default)s)")
    add_model_arguments(parser)
    parser.add_argument("--output-dir", default="runs/accumulation_sweep",
                        help="results, plot and TensorBoard runs go here (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and data order (default: %(default)s)")
    args = parser.parse_args(argv)
    args.accumulate = parse_accumulate(parser, args.accumulate, args.micro_batches, args.warmup_steps)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    return args


def parse_accumulate(parser: argparse.ArgumentParser, text: str, micro_batches: int, warmup: int) -> list[int]:
    """The k values, sorted; each must divide ``micro_batches`` and leave measured steps."""
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        parser.error(f"--accumulate must be comma-separated integers like 1,2,4,8, got {text!r}")
    if not values or values[0] < 1:
        parser.error(f"--accumulate needs positive integers, got {text!r}")
    for k in values:
        if micro_batches % k:
            parser.error(f"--micro-batches {micro_batches} is not a multiple of k={k}; use e.g. "
                         f"{micro_batches - micro_batches % k + k}")
        if micro_batches // k <= warmup:
            parser.error(f"k={k} gives {micro_batches // k} optimizer steps, none left after "
                         f"--warmup-steps {warmup}; raise --micro-batches")
    return values


def train_once(args: argparse.Namespace, k: int, round_index: int) -> tuple[dict, TensorBoardLogger]:
    """Train ``args.micro_batches`` micro-batches with accumulation ``k``; return the measurement and its run."""
    pl.seed_everything(args.seed, verbose=False)
    model = model_from_args(args)
    memory = MemorySink()
    strategy = RingDDPStrategy(args.algorithm, bucket_cap_mb=args.bucket_cap_mb, sinks=[memory])
    throughput = ThroughputLogger(tokens_per_sample=args.seq_len)
    run_name = f"accumulate_{k}" if args.rounds == 1 else f"accumulate_{k}/round_{round_index}"
    logger = TensorBoardLogger(args.output_dir, name="", version=run_name, default_hp_metric=False)
    trainer = pl.Trainer(
        **torchrun_placement(),
        strategy=strategy,
        max_steps=args.micro_batches // k,
        limit_train_batches=args.micro_batches,
        accumulate_grad_batches=k,
        logger=logger,
        callbacks=[throughput, CommTimingLogger()],
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, make_dataloader(seq_len=args.seq_len, micro_batch=args.micro_batch, seed=args.seed))

    measured = throughput.summarize(skip_steps=args.warmup_steps)
    comm = [r for r in memory.records if r.step > args.warmup_steps]
    comm_ms = statistics.fmean(r.total_ms for r in comm)
    return {
        "accumulate_grad_batches": k,
        "samples_per_s": measured.samples_per_s,
        "step_ms": measured.step_ms,
        "comm_ms_per_optimizer_step": comm_ms,
        "exposed_comm_ms_per_optimizer_step": statistics.fmean(r.exposed_ms for r in comm),
        "comm_fraction": comm_ms / measured.step_ms,
        "buckets_per_step": statistics.fmean(r.num_buckets for r in comm),
        "world_size": trainer.world_size,
        "comm_hook": strategy.reported_comm_hook,
        "final_loss": float(trainer.callback_metrics["train/loss"]),
    }, logger


def combine_rounds(runs: list[dict], args: argparse.Namespace) -> dict:
    """One record per k: the median over rounds of every timing, and the settings."""
    median = {name: statistics.median(run[name] for run in runs) for name in
              ("samples_per_s", "step_ms", "comm_ms_per_optimizer_step", "exposed_comm_ms_per_optimizer_step")}
    first = runs[0]
    return {
        "accumulate_grad_batches": first["accumulate_grad_batches"],
        **median,
        "tokens_per_s": median["samples_per_s"] * args.seq_len,
        "comm_fraction": median["comm_ms_per_optimizer_step"] / median["step_ms"],
        "samples_per_s_by_round": [run["samples_per_s"] for run in runs],
        "buckets_per_step": first["buckets_per_step"],
        "micro_batches": args.micro_batches,
        "micro_batch": args.micro_batch,
        "world_size": first["world_size"],
        "algorithm": args.algorithm,
        "comm_hook": first["comm_hook"],
        "final_loss": first["final_loss"],
    }


def log_hparams(logger: TensorBoardLogger, run: dict, round_index: int, baseline: float,
                args: argparse.Namespace) -> None:
    """Write one run's setting and results into its TensorBoard run (HParams tab)."""
    params = {
        "accumulate_grad_batches": run["accumulate_grad_batches"],
        "round": round_index,
        "micro_batch": args.micro_batch,
        "micro_batches": args.micro_batches,
        "world_size": run["world_size"],
        "algorithm": args.algorithm,
        "bucket_cap_mb": args.bucket_cap_mb,
        "seq_len": args.seq_len,
    }
    metrics = {f"sweep/{name}": run[name] for name in ("samples_per_s", "comm_ms_per_optimizer_step", "comm_fraction")}
    metrics["sweep/speedup"] = run["samples_per_s"] / baseline
    logger.log_hyperparams(params, metrics)
    logger.finalize("success")


def print_table(records: list[dict]) -> None:
    baseline = records[0]["accumulate_grad_batches"]
    print(f"\n{'k':>3} {'samples/s':>10} {'tokens/s':>10} {'step ms':>9} {'comm ms/step':>13} "
          f"{'exposed ms':>11} {'comm share':>11} {f'speedup vs k={baseline}':>17}")
    for r in records:
        print(f"{r['accumulate_grad_batches']:>3} {r['samples_per_s']:>10.1f} {r['tokens_per_s']:>10.0f} "
              f"{r['step_ms']:>9.1f} {r['comm_ms_per_optimizer_step']:>13.2f} "
              f"{r['exposed_comm_ms_per_optimizer_step']:>11.2f} {r['comm_fraction']:>10.1%} "
              f"{r['speedup']:>16.2f}x")


def save_plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    ks = [r["accumulate_grad_batches"] for r in records]
    labels = [str(k) for k in ks]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(labels, [r["samples_per_s"] for r in records], color="tab:blue")
    for i, r in enumerate(records):
        left.annotate(f"{r['speedup']:.2f}x", (i, r["samples_per_s"]), ha="center", va="bottom")
    left.set(xlabel="accumulate_grad_batches (k)", ylabel="samples/s (all ranks)", title="throughput")
    right.plot(labels, [r["comm_ms_per_optimizer_step"] for r in records], "o-", label="comm ms / optimizer step")
    right.plot(labels, [r["exposed_comm_ms_per_optimizer_step"] for r in records], "s--", label="exposed ms / step")
    right.set(xlabel="accumulate_grad_batches (k)", ylabel="ms", title="communication")
    right.set_ylim(bottom=0)
    share = right.twinx()
    share.plot(labels, [100 * r["comm_fraction"] for r in records], "^:", color="tab:red", label="comm share (%)")
    share.set_ylabel("comm share of step time (%)", color="tab:red")
    share.set_ylim(bottom=0)
    lines = right.get_lines() + share.get_lines()
    right.legend(lines, [line.get_label() for line in lines], loc="upper right", fontsize="small")
    world, algorithm = records[0]["world_size"], records[0]["algorithm"]
    figure.suptitle(f"gradient accumulation, {algorithm} hook, {world} ranks, micro-batch {records[0]['micro_batch']}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    quiet_lightning()
    output = Path(args.output_dir)
    rank_zero = int(os.environ.get("RANK", "0")) == 0

    # Alternate the order (1,2,4,8 then 8,4,2,1, ...): a shared machine's load drifts, and
    # alternating spreads the drift over all settings instead of penalizing the last ones.
    order = [(r, k) for r in range(args.rounds) for k in (args.accumulate if r % 2 == 0 else args.accumulate[::-1])]
    runs = {(r, k): train_once(args, k, r)
            for r, k in tqdm(order, desc="accumulation runs", disable=not rank_zero)}
    records = [combine_rounds([runs[r, k][0] for r in range(args.rounds)], args) for k in args.accumulate]
    baseline = records[0]["samples_per_s"]
    for record in records:
        record["speedup"] = record["samples_per_s"] / baseline
    for (r, _), (run, logger) in runs.items():
        log_hparams(logger, run, r, baseline, args)

    if rank_zero:
        output.mkdir(parents=True, exist_ok=True)
        (output / RESULTS_FILE).write_text(json.dumps(records, indent=2) + "\n")
        save_plot(records, output / PLOT_FILE)
        print_table(records)
        print(f"\nwrote {output / RESULTS_FILE}, {output / PLOT_FILE}; "
              f"TensorBoard: tensorboard --logdir {output}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
