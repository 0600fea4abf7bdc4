"""How many gradient-accumulation steps? Measure throughput against accumulate_grad_batches.

    torchrun --standalone --nproc_per_node=2 train_examples/accumulation_sweep.py
    tensorboard --logdir runs/accumulation_sweep

With k micro-batches per optimizer step, DDP communicates once per k backward passes (the
other k-1 run under ``no_sync``), so the communication cost per sample falls as 1/k::

    k=1   [fwd bwd|comm][fwd bwd|comm][fwd bwd|comm][fwd bwd|comm]   4 reductions
    k=4   [fwd bwd][fwd bwd][fwd bwd][fwd bwd|comm]                  1 reduction

Throughput rises with k until compute dominates; the price is a k times larger effective
batch (P * micro_batch * k samples per step), which changes the optimization.

How it measures, so that the answer holds (or says that it does not):

1. It refuses to run as one process (``python accumulation_sweep.py`` without torchrun): with
   one rank there is no communication to save, and the table would show a confident speedup
   that teaches the wrong lesson (``--allow-single-process`` runs anyway). With more processes
   than cores it says what that does to the numbers.
2. One shared warm-up fit first, never timed: the first fit of a process pays for imports,
   gloo connections, allocator growth and thread pools, and must not charge them to
   whichever setting happens to run first.
3. Every setting (default k = 1, 2, 4, 8) trains the same model from the same seed for
   ``--warmup-steps`` + ``--steps`` optimizer steps (k micro-batches each), with the ring
   hook attached by ``RingDDPStrategy``; only the last ``--steps`` are measured (DDP reduces
   one big bucket in step 1 and rebuilds its buckets after it). Every k gets at least
   ``--steps`` measured optimizer steps, and at least ``--min-micro-batches`` measured
   micro-batches, so by default every k measures the same 40 micro-batches (k=1 in 40 steps,
   k=8 in 5): a k=1 step is short, and 10 of them were too few to agree from round to round.
4. ``--rounds`` rounds (default 3), settings interleaved in alternating order (1,2,4,8 then
   8,4,2,1, ...): the load of a shared machine drifts, and alternating spreads the drift.
5. Per fit, samples/s is that of its median optimizer step (a step another process stalled
   moves the mean, not the median). The rounds become one result per k in
   ``sweep_rounds.py``: speedups paired within a round, medians and spreads over rounds,
   and a warning where the rounds disagree (ORDER UNCERTAIN, NOISY).
6. Next to that verdict it prints the machine's load average at the start and the end (and
   the CPU steal in between): a busy machine makes every step slower and the rounds noisier.

Columns: samples/s over all ranks; communication ms per optimizer step (the time at least one
bucket's all-reduce was in flight, the hook's ``StepRecord.total_ms``; on CPU two buckets
overlap) and the part backward could not hide (``exposed_ms``), both including waiting for the
slower rank; communication share = comm ms / step ms; speedup vs the smallest k;
predicted: the speedup the advisor (``ddp_ring_hooks.advisor``) forecast from the smallest
k's own timeline in each round (median over rounds), and its error against the measured one
(predicted / measured - 1).

Output: every run writes a fresh ``--output-dir/version_N/`` (N one more than the last, as
Lightning's loggers number their runs), so TensorBoard and the files always describe the same
run: ``results.json`` (one record per k, the machine's load in each), ``accumulation_sweep.png``,
and one TensorBoard run per k and round (``accumulate_<k>/round_<r>/``) with the loss,
``comm/*``, ``throughput/*``, the settings and results as hparams, and the hook's
``timeline.jsonl`` (``ddp-ring-hooks advise version_N`` reads it). Ctrl-C removes the partial
``version_N/`` and exits with code 130 (torchrun then reports the signal itself).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
from pathlib import Path

import lightning.pytorch as pl
import torch.distributed as dist
from char_lm import (
    add_model_arguments,
    fit_or_interrupt,
    make_dataloader,
    model_from_args,
    quiet_lightning,
    save_timeline,
    torchrun_placement,
    warn_if_oversubscribed,
)
from lightning.pytorch.loggers import TensorBoardLogger
from sweep_rounds import add_predictions, agreement_warnings, combine_rounds, format_table, paired_speedups
from tqdm import tqdm

from ddp_ring_hooks import accepted_algorithms
from ddp_ring_hooks.advisor import accumulation_speedups
from ddp_ring_hooks.integrations.lightning import (
    CommTimingLogger,
    RingDDPStrategy,
    ThroughputLogger,
)
from ddp_ring_hooks.interrupts import exit_promptly_on_ctrl_c
from ddp_ring_hooks.machine import MachineLoad, describe_load, load_record
from ddp_ring_hooks.telemetry import MemorySink

RESULTS_FILE = "results.json"
PLOT_FILE = "accumulation_sweep.png"
VERSION_PREFIX = "version_"
LAUNCH = "torchrun --standalone --nproc_per_node=2 train_examples/accumulation_sweep.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accumulate", default="1,2,4,8",
                        help="comma-separated accumulate_grad_batches values to compare (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=5,
                        help="measured optimizer steps per setting and round, at least (see "
                             "--min-micro-batches) (default: %(default)s)")
    parser.add_argument("--min-micro-batches", type=int, default=40,
                        help="measure at least this many micro-batches per setting and round: small k "
                             "get more optimizer steps than --steps (default: %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=1,
                        help="optimizer steps at the start of every fit left out of the measurement "
                             "(default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="train every setting this many times, interleaved in alternating order, and "
                             "report the median and spread over rounds (default: %(default)s)")
    parser.add_argument("--warmup-fit-steps", type=int, default=2,
                        help="optimizer steps of the shared, untimed warm-up fit before round 1 "
                             "(0: none) (default: %(default)s)")
    parser.add_argument("--tolerance", type=float, default=0.10,
                        help="warn when a speedup's rounds spread by more than +- this fraction of "
                             "their median (default: %(default)s)")
    parser.add_argument("--micro-batch", type=int, default=4,
                        help="sequences per rank per forward/backward (default: %(default)s)")
    parser.add_argument("--algorithm", choices=accepted_algorithms(), default="ring",
                        help="all-reduce algorithm of the hook (default: %(default)s)")
    add_model_arguments(parser)
    parser.add_argument("--output-dir", default="runs/accumulation_sweep",
                        help="each run writes a new version_N/ here: results, plot and TensorBoard runs "
                             "(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and data order (default: %(default)s)")
    parser.add_argument("--allow-single-process", action="store_true",
                        help="run even with one process (no communication between ranks to measure)")
    args = parser.parse_args(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 and not args.allow_single_process:
        parser.exit(2, "accumulation_sweep.py: this measures communication between ranks, but only 1 process runs: "
                       f"launch it with `{LAUNCH}` (or pass --allow-single-process to time one process anyway)\n")
    args.accumulate = parse_accumulate(parser, args.accumulate)
    for name in ("steps", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    for name in ("warmup_steps", "warmup_fit_steps", "min_micro_batches"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(args, name)}")
    if not 0 < args.tolerance < 1:
        parser.error(f"--tolerance is a fraction between 0 and 1 (0.1 = +-10%), got {args.tolerance}")
    return args


def parse_accumulate(parser: argparse.ArgumentParser, text: str) -> list[int]:
    """The k values, sorted and distinct, every one positive."""
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        parser.error(f"--accumulate must be comma-separated integers like 1,2,4,8, got {text!r}")
    if not values or values[0] < 1:
        parser.error(f"--accumulate needs positive integers, got {text!r}")
    return values


# -- one fit -----------------------------------------------------------------------------------


def make_trainer(args: argparse.Namespace, k: int, steps: int, *, logger, callbacks, strategy) -> pl.Trainer:
    """A Trainer for ``steps`` optimizer steps of ``k`` micro-batches each."""
    return pl.Trainer(
        **torchrun_placement(args.accelerator),
        strategy=strategy,
        max_steps=steps,
        limit_train_batches=steps * k,
        accumulate_grad_batches=k,
        logger=logger,
        callbacks=callbacks,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def warm_up(args: argparse.Namespace) -> None:
    """An untimed fit with the largest k (so ``no_sync`` runs too): pays the first fit's one-time
    costs for every setting alike. Also starts the process group, so that rank 0 can share the
    run directory it picked."""
    if args.warmup_fit_steps == 0:
        return
    pl.seed_everything(args.seed, verbose=False)
    k = args.accumulate[-1]
    strategy = RingDDPStrategy(args.algorithm, bucket_cap_mb=args.bucket_cap_mb)
    trainer = make_trainer(args, k, args.warmup_fit_steps, logger=False, callbacks=[], strategy=strategy)
    fit_or_interrupt(trainer, model_from_args(args), make_dataloader(seq_len=args.seq_len, micro_batch=args.micro_batch, seed=args.seed))


def measured_steps(args: argparse.Namespace, k: int) -> int:
    """Optimizer steps measured at accumulation ``k``: ``--steps``, or more when that many would
    measure fewer than ``--min-micro-batches`` micro-batches."""
    return max(args.steps, -(-args.min_micro_batches // k))


def train_once(args: argparse.Namespace, k: int, round_index: int, run_dir: Path) -> tuple[dict, TensorBoardLogger]:
    """Train ``--warmup-steps + --steps`` optimizer steps with accumulation ``k``; return the
    measurement of the last ``--steps`` and its TensorBoard run."""
    pl.seed_everything(args.seed, verbose=False)
    memory = MemorySink()
    strategy = RingDDPStrategy(args.algorithm, bucket_cap_mb=args.bucket_cap_mb, sinks=[memory])
    throughput = ThroughputLogger(tokens_per_sample=args.seq_len)
    run_name = f"accumulate_{k}" if args.rounds == 1 else f"accumulate_{k}/round_{round_index}"
    logger = TensorBoardLogger(run_dir, name="", version=run_name, default_hp_metric=False)
    trainer = make_trainer(args, k, args.warmup_steps + measured_steps(args, k), logger=logger,
                           callbacks=[throughput, CommTimingLogger(print_advice=False)], strategy=strategy)
    fit_or_interrupt(trainer, model_from_args(args), make_dataloader(seq_len=args.seq_len, micro_batch=args.micro_batch, seed=args.seed))
    if trainer.is_global_zero:  # what `ddp-ring-hooks advise` reads, beside the run's events
        save_timeline(strategy.hook_state, logger.log_dir)

    measured = throughput.summarize(skip_steps=args.warmup_steps)
    comm = [r for r in memory.records if r.step > args.warmup_steps]
    comm_ms = statistics.median(r.total_ms for r in comm)
    # The typical step: samples of one step over its median time (robust to a stalled step).
    samples_per_step = measured.samples / measured.steps
    return {
        "accumulate_grad_batches": k,
        "round": round_index,
        "samples_per_s": samples_per_step / measured.median_step_seconds,
        "step_ms": 1e3 * measured.median_step_seconds,
        "comm_ms_per_optimizer_step": comm_ms,
        "exposed_comm_ms_per_optimizer_step": statistics.median(r.exposed_ms for r in comm),
        "buckets_per_step": statistics.fmean(r.num_buckets for r in comm),
        "measured_steps": measured.steps,
        "world_size": trainer.world_size,
        "comm_hook": strategy.reported_comm_hook,
        "final_loss": float(trainer.callback_metrics["train/loss"]),
        # The advisor's forecast for every k, from the smallest k's own timeline (as a user
        # would run it: one run, then "what if I accumulated more?").
        "predicted_speedups": predicted_speedups(strategy, args) if k == args.accumulate[0] else None,
    }, logger


def predicted_speedups(strategy: RingDDPStrategy, args: argparse.Namespace) -> dict[int, float] | None:
    """Samples/s for each ``--accumulate`` k relative to this run, as the advisor predicts
    them from this run's timeline; ``None`` (with the reason) where it cannot."""
    try:
        return accumulation_speedups(strategy.hook_state.timeline.records(), ks=args.accumulate)
    except ValueError as error:
        print(f"no predicted speedups: {error}")
        return None


# -- output ------------------------------------------------------------------------------------


def log_hparams(logger: TensorBoardLogger, run: dict, params: dict, *, differing: set[str], experiment: bool) -> None:
    """Write one run's setting (``params``) and results into its TensorBoard run (HParams tab).

    TensorBoard's HParams tab reads its columns from one *experiment* summary (Lightning's
    ``log_hyperparams`` writes one per run, each saying that no hparam ``differs``). Here one
    run (``experiment=True``) carries the sweep's experiment, with ``differs`` set for the
    hparams in ``differing`` (k first of all), and every run its own values."""
    from tensorboard.plugins.hparams import plugin_data_pb2
    from torch.utils.tensorboard.summary import hparams

    metrics = {f"sweep/{name}": run[name] for name in ("samples_per_s", "comm_ms_per_optimizer_step", "speedup")}
    metrics["sweep/comm_fraction"] = run["comm_ms_per_optimizer_step"] / run["step_ms"]
    summary, session_start, session_end = hparams(params, metrics)
    writer = logger.experiment._get_file_writer()  # as Lightning's own log_hyperparams does
    if experiment:
        value = summary.value[0]
        data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
        for info in data.experiment.hparam_infos:
            info.differs = info.name in differing
        value.metadata.plugin_data.content = data.SerializeToString()
        writer.add_summary(summary)
    writer.add_summary(session_start)
    writer.add_summary(session_end)
    logger.log_metrics(metrics, step=0)
    logger.log_hyperparams(params)  # hparams.yaml only (no metrics: nothing more in the events)
    logger.finalize("success")


def hparams_of(run: dict, args: argparse.Namespace) -> dict:
    """The HParams tab's columns for one run."""
    return {
        "accumulate_grad_batches": run["accumulate_grad_batches"],
        "round": run["round"],
        "micro_batch": args.micro_batch,
        "measured_steps": run["measured_steps"],
        "world_size": run["world_size"],
        "algorithm": args.algorithm,
        "bucket_cap_mb": args.bucket_cap_mb,
        "seq_len": args.seq_len,
    }


def save_plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    ks = [r["accumulate_grad_batches"] for r in records]
    labels = [str(k) for k in ks]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6))
    heights = [r["samples_per_s"] for r in records]
    low = [h - r["samples_per_s_spread"][0] for h, r in zip(heights, records)]
    high = [r["samples_per_s_spread"][1] - h for h, r in zip(heights, records)]
    left.bar(labels, heights, color="tab:blue", yerr=[low, high], capsize=4, ecolor="black")
    for i, r in enumerate(records):
        left.annotate(f"{r['speedup']:.2f}x", (i, r["samples_per_s_spread"][1]), textcoords="offset points",
                      xytext=(0, 3), ha="center", va="bottom")
    left.set_ylim(0, 1.15 * max(r["samples_per_s_spread"][1] for r in records))  # room for the labels
    left.set(xlabel="accumulate_grad_batches (k)", ylabel="samples/s (all ranks)",
             title="throughput (median, bars: lowest-highest round)")
    right.plot(labels, [r["comm_ms_per_optimizer_step"] for r in records], "o-", label="comm ms / optimizer step")
    right.plot(labels, [r["exposed_comm_ms_per_optimizer_step"] for r in records], "s--", label="exposed ms / step")
    right.set(xlabel="accumulate_grad_batches (k)", ylabel="ms", title="communication")
    right.set_ylim(bottom=0, top=1.2 * max(r["comm_ms_per_optimizer_step"] for r in records))
    share = right.twinx()
    share.plot(labels, [100 * r["comm_fraction"] for r in records], "^:", color="tab:red", label="comm share (%)")
    share.set_ylabel("comm share of step time (%)", color="tab:red")
    share.set_ylim(bottom=0, top=1.2 * max(100 * r["comm_fraction"] for r in records))
    lines = right.get_lines() + share.get_lines()
    # Below the axes: inside, it covered points whatever corner it took.
    right.legend(lines, [line.get_label() for line in lines], loc="upper center", bbox_to_anchor=(0.5, -0.16),
                 ncol=3, fontsize="small", frameon=False)
    world, algorithm = records[0]["world_size"], records[0]["algorithm"]
    figure.suptitle(f"gradient accumulation, {algorithm} hook, {world} ranks, micro-batch {records[0]['micro_batch']}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def next_run_dir(output: Path) -> Path:
    """``output/version_N`` with N one more than the highest there (0 for the first run), as
    Lightning numbers its runs: a new run never appends to an old run's event files."""
    versions = [int(m.group(1)) for p in output.glob(f"{VERSION_PREFIX}*")
                if (m := re.fullmatch(rf"{VERSION_PREFIX}(\d+)", p.name))]
    return output / f"{VERSION_PREFIX}{max(versions, default=-1) + 1}"


def shared_run_dir(output: Path, rank_zero: bool) -> Path:
    """Rank 0 picks (and creates) the run directory; every rank gets the same path."""
    chosen = [None]
    if rank_zero:
        run_dir = next_run_dir(output)
        run_dir.mkdir(parents=True)
        chosen = [str(run_dir)]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(chosen, src=0)
    # Without a process group (no warm-up fit) the other ranks cannot learn it; they write
    # nothing there anyway (Lightning's TensorBoard logger writes on rank 0 only).
    return Path(chosen[0]) if chosen[0] else next_run_dir(output)


def discard_partial_run(run_dir: Path | None, *, rank_zero: bool, done: int, total: int) -> None:
    """After Ctrl-C: remove the run directory (TensorBoard would list its fits beside complete
    runs, and its results would be missing) and say so in one line."""
    if not rank_zero:
        return
    if run_dir is None:
        print("\ninterrupted during the warm-up fit: nothing was written")
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    print(f"\ninterrupted after {done} of {total} fits: removed the partial run {run_dir}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_promptly_on_ctrl_c()  # a rank waiting in C++ (a peer's rendezvous, say) still ends on Ctrl-C
    quiet_lightning()
    rank_zero = int(os.environ.get("RANK", "0")) == 0
    start = MachineLoad.now()
    warn_if_oversubscribed(args.accelerator)

    # Alternate the order (1,2,4,8 then 8,4,2,1, ...): a shared machine's load drifts, and
    # alternating spreads the drift over all settings instead of penalizing the last ones.
    order = [(r, k) for r in range(args.rounds) for k in (args.accumulate if r % 2 == 0 else args.accumulate[::-1])]
    run_dir, trained = None, {}
    try:
        warm_up(args)
        run_dir = shared_run_dir(Path(args.output_dir), rank_zero)
        for r, k in tqdm(order, desc="accumulation runs", disable=not rank_zero):
            trained[r, k] = train_once(args, k, r, run_dir)
    except KeyboardInterrupt:
        discard_partial_run(run_dir, rank_zero=rank_zero, done=len(trained), total=len(order))
        return 130  # the shell's code for "ended by Ctrl-C"
    runs = {key: run for key, (run, _) in trained.items()}
    paired_speedups(runs, args.accumulate, args.rounds)
    settings = {"micro_batch": args.micro_batch, "algorithm": args.algorithm}
    records = [combine_rounds([runs[r, k] for r in range(args.rounds)], settings=settings,
                              tokens_per_sample=args.seq_len, warmup_steps=args.warmup_steps)
               for k in args.accumulate]
    warnings = agreement_warnings(records, tolerance=args.tolerance)
    add_predictions(records, [runs[r, args.accumulate[0]]["predicted_speedups"] for r in range(args.rounds)])
    end = MachineLoad.now()
    if rank_zero:  # Lightning's TensorBoard logger writes on rank 0 only
        params = {key: hparams_of(run, args) for key, run in runs.items()}
        differing = {name for name in next(iter(params.values())) if len({str(p[name]) for p in params.values()}) > 1}
        for index, (key, (_, logger)) in enumerate(trained.items()):
            log_hparams(logger, runs[key], params[key], differing=differing, experiment=index == 0)
        machine = load_record(start, end)
        for record in records:
            record["machine"] = machine
        (run_dir / RESULTS_FILE).write_text(json.dumps(records, indent=2) + "\n")
        save_plot(records, run_dir / PLOT_FILE)
        print("\n" + format_table(records, warnings))
        print(describe_load(start, end, own_processes=int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
        print(f"\nwrote {run_dir / RESULTS_FILE}, {run_dir / PLOT_FILE}; "
              f"TensorBoard: tensorboard --logdir {run_dir}; advice: ddp-ring-hooks advise {run_dir}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
