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

1. One shared warm-up fit first, never timed: the first fit of a process pays for imports,
   gloo connections, allocator growth and thread pools, and must not charge them to
   whichever setting happens to run first.
2. Every setting (default k = 1, 2, 4, 8) trains the same model from the same seed for
   ``--warmup-steps`` + ``--steps`` optimizer steps (k micro-batches each), with the ring
   hook attached by ``RingDDPStrategy``; only the last ``--steps`` are measured (DDP reduces
   one big bucket in step 1 and rebuilds its buckets after it). Every k gets at least
   ``--steps`` measured optimizer steps, and at least ``--min-micro-batches`` measured
   micro-batches (k=1 gets 40 steps, k=8 10): a k=1 step is short, and 10 of them were too few
   to agree from round to round.
3. ``--rounds`` rounds (default 3), settings interleaved in alternating order (1,2,4,8 then
   8,4,2,1, ...): the load of a shared machine drifts, and alternating spreads the drift.
4. Per fit, samples/s is that of its median optimizer step (a step another process stalled
   moves the mean, not the median). Per round, a setting's speedup is its samples/s over
   k=1's *in the same round* (paired: both ran minutes apart at most, under the same load),
   so k=1's per-round speedup is 1.0 by definition. The table shows, per k, the median over
   rounds and the spread (lowest-highest round); never a mean.
5. When rounds disagree on which of two settings is faster (the paired ratio is above 1 in
   one round and below in another), or a speedup's rounds spread by more than
   +-``--tolerance``, the table and ``results.json`` carry a warning saying so.

Columns: samples/s over all ranks; communication ms per optimizer step (the time at least one
bucket's all-reduce was in flight, the hook's ``StepRecord.total_ms``; on CPU two buckets
overlap) and the part backward could not hide (``exposed_ms``), both including waiting for the
slower rank; communication share = comm ms / step ms; speedup vs the smallest k;
predicted: the speedup the advisor (``ddp_ring_hooks.advisor``) forecast from the smallest
k's own timeline in each round (median over rounds), and its error against the measured one.

Output: every run writes a fresh ``--output-dir/version_N/`` (N one more than the last, as
Lightning's loggers number their runs), so TensorBoard and the files always describe the same
run: the printed table, ``results.json`` (one record per k), ``accumulation_sweep.png``, and
one TensorBoard run per k and round (``accumulate_<k>/round_<r>/``) with the loss,
``comm/*``, ``throughput/*`` and the settings and results as hparams.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import lightning.pytorch as pl
import torch.distributed as dist
from char_lm import add_model_arguments, make_dataloader, model_from_args, quiet_lightning, torchrun_placement
from lightning.pytorch.loggers import TensorBoardLogger
from tqdm import tqdm

from ddp_ring_hooks.advisor import accumulation_speedups
from ddp_ring_hooks.runtime.names import accepted_algorithms
from ddp_ring_hooks.integrations.lightning import (
    CommTimingLogger,
    RingDDPStrategy,
    ThroughputLogger,
)
from ddp_ring_hooks.telemetry import MemorySink

RESULTS_FILE = "results.json"
PLOT_FILE = "accumulation_sweep.png"
VERSION_PREFIX = "version_"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accumulate", default="1,2,4,8",
                        help="comma-separated accumulate_grad_batches values to compare (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=10,
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
    parser.add_argument("--warmup-fit-steps", type=int, default=4,
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
    args = parser.parse_args(argv)
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
    trainer.fit(model_from_args(args), make_dataloader(seq_len=args.seq_len, micro_batch=args.micro_batch, seed=args.seed))


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
    trainer.fit(model_from_args(args), make_dataloader(seq_len=args.seq_len, micro_batch=args.micro_batch, seed=args.seed))

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


# -- from rounds to one record per k ---------------------------------------------------------


def paired_speedups(runs: dict[tuple[int, int], dict], ks: Sequence[int], rounds: int) -> None:
    """Add each run's ``speedup``: its samples/s over the smallest k's *in the same round*.

    Paired within a round, the ratio cancels the load both runs shared; the smallest k's own
    per-round speedup is therefore exactly 1."""
    for r in range(rounds):
        baseline = runs[r, ks[0]]["samples_per_s"]
        for k in ks:
            runs[r, k]["speedup"] = runs[r, k]["samples_per_s"] / baseline


def combine_rounds(runs: list[dict], args: argparse.Namespace) -> dict:
    """One record per k: the median over rounds of every timing, their spread, the settings."""
    median = {name: statistics.median(run[name] for run in runs) for name in
              ("samples_per_s", "step_ms", "comm_ms_per_optimizer_step", "exposed_comm_ms_per_optimizer_step",
               "speedup")}
    by_round = {name: [run[name] for run in runs] for name in ("samples_per_s", "speedup")}
    first = runs[0]
    return {
        "accumulate_grad_batches": first["accumulate_grad_batches"],
        **median,
        "tokens_per_s": median["samples_per_s"] * args.seq_len,
        "comm_fraction": median["comm_ms_per_optimizer_step"] / median["step_ms"],
        "samples_per_s_by_round": by_round["samples_per_s"],
        "samples_per_s_spread": [min(by_round["samples_per_s"]), max(by_round["samples_per_s"])],
        "speedup_by_round": by_round["speedup"],
        "speedup_spread": [min(by_round["speedup"]), max(by_round["speedup"])],
        "rounds": len(runs),
        "measured_steps": first["measured_steps"],
        "micro_batches": (args.warmup_steps + first["measured_steps"]) * first["accumulate_grad_batches"],  # per rank, trained
        "micro_batch": args.micro_batch,
        "buckets_per_step": first["buckets_per_step"],
        "world_size": first["world_size"],
        "algorithm": args.algorithm,
        "comm_hook": first["comm_hook"],
        "final_loss": first["final_loss"],
        "warnings": [],
    }


def agreement_warnings(records: list[dict], *, tolerance: float) -> list[str]:
    """What the rounds do not agree on, in words; also added to each record it concerns.

    - Two settings whose per-round ratio (paired, same round) is above 1 in one round and
      below 1 in another: which of them is faster is uncertain.
    - A speedup whose rounds spread by more than +-``tolerance`` of their median.
    - One round only: no spread, so nothing can be said about agreement.
    """
    warnings: list[str] = []
    if records and records[0]["rounds"] < 2:
        warnings.append("one round only: no spread to judge agreement by; use --rounds 3 or more")
        return warnings
    for i, low in enumerate(records):
        for high in records[i + 1:]:
            ratios = [b / a for a, b in zip(low["samples_per_s_by_round"], high["samples_per_s_by_round"])]
            if min(ratios) < 1 < max(ratios):
                k_low, k_high = low["accumulate_grad_batches"], high["accumulate_grad_batches"]
                text = (f"ORDER UNCERTAIN: k={k_high} vs k={k_low} was {min(ratios):.2f}x-{max(ratios):.2f}x "
                        f"across rounds; the rounds disagree on which is faster")
                warnings.append(text)
                low["warnings"].append(text)
                high["warnings"].append(text)
    for record in records[1:]:
        low, high = record["speedup_spread"]
        median = record["speedup"]
        if (high - low) / 2 > tolerance * median:
            text = (f"NOISY: k={record['accumulate_grad_batches']} speedup ranged {low:.2f}x-{high:.2f}x over "
                    f"{record['rounds']} rounds, more than +-{tolerance:.0%} of its median {median:.2f}x")
            warnings.append(text)
            record["warnings"].append(text)
    return warnings


# -- output ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of the printed table: its header and how a record becomes its cell."""

    header: str
    cell: Callable[[dict], str]


def table_columns(records: list[dict]) -> list[Column]:
    """The printed table's columns. The place to add more, e.g. a *predicted* speedup next to
    the measured one: append a Column whose ``cell`` reads a key set on each record before
    :func:`print_table` runs (see :func:`add_predictions`)."""
    baseline = records[0]["accumulate_grad_batches"]
    spread = records[0]["rounds"] > 1
    columns = [
        Column("k", lambda r: f"{r['accumulate_grad_batches']}"),
        Column("samples/s", lambda r: f"{r['samples_per_s']:.1f}"),
    ]
    if spread:
        columns.append(Column("rounds", lambda r: "{:.0f}-{:.0f}".format(*r["samples_per_s_spread"])))
    columns += [
        Column("tokens/s", lambda r: f"{r['tokens_per_s']:.0f}"),
        Column("step ms", lambda r: f"{r['step_ms']:.1f}"),
        Column("comm ms/step", lambda r: f"{r['comm_ms_per_optimizer_step']:.2f}"),
        Column("exposed ms", lambda r: f"{r['exposed_comm_ms_per_optimizer_step']:.2f}"),
        Column("comm share", lambda r: f"{r['comm_fraction']:.1%}"),
        Column(f"speedup vs k={baseline}", lambda r: f"{r['speedup']:.2f}x"),
    ]
    if spread:
        columns.append(Column("rounds", lambda r: "{:.2f}-{:.2f}x".format(*r["speedup_spread"])))
    if any("predicted_speedup" in r for r in records):
        columns.append(Column("predicted", lambda r: f"{r['predicted_speedup']:.2f}x" if "predicted_speedup" in r else "-"))
        columns.append(Column("error", lambda r: f"{r['predicted_error']:+.0%}" if "predicted_error" in r else "-"))
    return columns


def add_predictions(records: list[dict], runs: dict[tuple[int, int], dict], args: argparse.Namespace) -> None:
    """Set each record's ``predicted_speedup``: the median over rounds of what the advisor
    predicted from that round's smallest-k run (see :func:`ddp_ring_hooks.advisor.accumulation_speedups`),
    and ``predicted_error`` against the measured speedup. The table and ``results.json`` show both."""
    forecasts = [runs[r, args.accumulate[0]]["predicted_speedups"] for r in range(args.rounds)]
    forecasts = [f for f in forecasts if f]
    for record in records:
        k = record["accumulate_grad_batches"]
        if forecasts:
            record["predicted_speedup"] = statistics.median(f[k] for f in forecasts)
            record["predicted_error"] = record["predicted_speedup"] / record["speedup"] - 1


def format_table(records: list[dict], warnings: list[str]) -> str:
    columns = table_columns(records)
    cells = [[c.header for c in columns]] + [[c.cell(r) for c in columns] for r in records]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in cells]
    if records[0]["rounds"] > 1:
        lines.append(f"(median of {records[0]['rounds']} rounds; 'rounds' = lowest-highest round; speedups "
                     f"paired within each round; measured optimizer steps per setting: "
                     + ", ".join(f"k={r['accumulate_grad_batches']}: {r['measured_steps']}" for r in records) + ")")
    if warnings:
        lines.append("")
        lines += [f"WARNING: {text}" for text in warnings]
    if warnings and records[0]["rounds"] > 1:
        lines.append("These rounds do not agree: rerun with more --rounds or --steps, on a quieter machine, "
                     "before trusting the numbers above.")
    return "\n".join(lines)


def log_hparams(logger: TensorBoardLogger, run: dict, args: argparse.Namespace) -> None:
    """Write one run's setting and results into its TensorBoard run (HParams tab)."""
    params = {
        "accumulate_grad_batches": run["accumulate_grad_batches"],
        "round": run["round"],
        "micro_batch": args.micro_batch,
        "measured_steps": run["measured_steps"],
        "world_size": run["world_size"],
        "algorithm": args.algorithm,
        "bucket_cap_mb": args.bucket_cap_mb,
        "seq_len": args.seq_len,
    }
    metrics = {f"sweep/{name}": run[name] for name in ("samples_per_s", "comm_ms_per_optimizer_step", "speedup")}
    metrics["sweep/comm_fraction"] = run["comm_ms_per_optimizer_step"] / run["step_ms"]
    logger.log_hyperparams(params, metrics)
    logger.finalize("success")


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


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    quiet_lightning()
    rank_zero = int(os.environ.get("RANK", "0")) == 0

    warm_up(args)
    run_dir = shared_run_dir(Path(args.output_dir), rank_zero)
    # Alternate the order (1,2,4,8 then 8,4,2,1, ...): a shared machine's load drifts, and
    # alternating spreads the drift over all settings instead of penalizing the last ones.
    order = [(r, k) for r in range(args.rounds) for k in (args.accumulate if r % 2 == 0 else args.accumulate[::-1])]
    trained = {(r, k): train_once(args, k, r, run_dir)
               for r, k in tqdm(order, desc="accumulation runs", disable=not rank_zero)}
    runs = {key: run for key, (run, _) in trained.items()}
    paired_speedups(runs, args.accumulate, args.rounds)
    records = [combine_rounds([runs[r, k] for r in range(args.rounds)], args) for k in args.accumulate]
    warnings = agreement_warnings(records, tolerance=args.tolerance)
    add_predictions(records, runs, args)
    for key, (_, logger) in trained.items():
        log_hparams(logger, runs[key], args)

    if rank_zero:
        (run_dir / RESULTS_FILE).write_text(json.dumps(records, indent=2) + "\n")
        save_plot(records, run_dir / PLOT_FILE)
        print("\n" + format_table(records, warnings))
        print(f"\nwrote {run_dir / RESULTS_FILE}, {run_dir / PLOT_FILE}; "
              f"TensorBoard: tensorboard --logdir {run_dir}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
