"""The main job's statistics: from interleaved rounds to one result per k, or a warning that there is none.

The sweep (``accumulation_sweep.py``) trains every setting k once per round and hands this
module one run per (round, k)::

    runs[(round, k)] = {"samples_per_s": ..., "step_ms": ..., "comm_ms_per_optimizer_step": ..., ...}

1. **Pair within a round** (:func:`paired_speedups`): a run's speedup is its samples/s over
   the smallest k's *in the same round*. Both ran minutes apart at most, under the same load,
   so the ratio cancels what they shared; the smallest k's own per-round speedup is exactly 1.
2. **Combine rounds** (:func:`combine_rounds`): per k, the median over rounds of every timing
   and the spread (lowest-highest round); never a mean, which one stalled round would move.
3. **Say what the rounds disagree on** (:func:`agreement_warnings`): two settings whose paired
   ratio is above 1 in one round and below in another (ORDER UNCERTAIN), and a speedup whose
   rounds spread by more than +-tolerance of its median (NOISY).
4. **Set the forecast beside it** (:func:`add_predictions`): the advisor's speedup predicted
   from each round's smallest-k timeline, median over rounds, and its error.
5. **Print** (:func:`format_table`): one row per k, the spread next to each median.

Pure Python: the numbers in, the numbers out, testable without a process group.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping, Sequence

#: The timings combined per k (median over rounds).
TIMINGS = ("samples_per_s", "step_ms", "comm_ms_per_optimizer_step", "exposed_comm_ms_per_optimizer_step", "speedup")


def paired_speedups(runs: dict[tuple[int, int], dict], ks: Sequence[int], rounds: int) -> None:
    """Add each run's ``speedup``: its samples/s over the smallest k's in the same round."""
    for r in range(rounds):
        baseline = runs[r, ks[0]]["samples_per_s"]
        for k in ks:
            runs[r, k]["speedup"] = runs[r, k]["samples_per_s"] / baseline


def combine_rounds(runs: Sequence[dict], *, settings: Mapping[str, object], tokens_per_sample: int,
                   warmup_steps: int) -> dict:
    """One record per k from its runs (one per round): the median of every timing, their
    spread, and ``settings`` (the sweep's own: micro-batch, algorithm, ...) copied in."""
    median = {name: statistics.median(run[name] for run in runs) for name in TIMINGS}
    by_round = {name: [run[name] for run in runs] for name in ("samples_per_s", "speedup")}
    first = runs[0]
    return {
        "accumulate_grad_batches": first["accumulate_grad_batches"],
        **median,
        "tokens_per_s": median["samples_per_s"] * tokens_per_sample,
        "comm_fraction": median["comm_ms_per_optimizer_step"] / median["step_ms"],
        "samples_per_s_by_round": by_round["samples_per_s"],
        "samples_per_s_spread": [min(by_round["samples_per_s"]), max(by_round["samples_per_s"])],
        "speedup_by_round": by_round["speedup"],
        "speedup_spread": [min(by_round["speedup"]), max(by_round["speedup"])],
        "rounds": len(runs),
        "measured_steps": first["measured_steps"],
        # Trained per rank, warm-up steps included: k=8 computes more micro-batches than k=1.
        "micro_batches": (warmup_steps + first["measured_steps"]) * first["accumulate_grad_batches"],
        **settings,
        "buckets_per_step": first["buckets_per_step"],
        "world_size": first["world_size"],
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


def add_predictions(records: list[dict], forecasts: Sequence[Mapping[int, float] | None]) -> None:
    """Set each record's ``predicted_speedup``, the median over rounds of the advisor's
    forecast for its k (``forecasts``: one per round, ``None`` where the advisor had none; see
    :func:`ddp_ring_hooks.advisor.accumulation_speedups`), and ``predicted_error`` against the
    measured speedup."""
    forecasts = [f for f in forecasts if f]
    if not forecasts:
        return
    for record in records:
        record["predicted_speedup"] = statistics.median(f[record["accumulate_grad_batches"]] for f in forecasts)
        record["predicted_error"] = record["predicted_speedup"] / record["speedup"] - 1


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of the printed table: its header and how a record becomes its cell."""

    header: str
    cell: Callable[[dict], str]


def table_columns(records: list[dict]) -> list[Column]:
    """The printed table's columns; a new one is a :class:`Column` whose ``cell`` reads a key
    set on each record before :func:`format_table` runs (as :func:`add_predictions` does)."""
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


def format_table(records: list[dict], warnings: list[str]) -> str:
    """The table, what its columns mean, and every warning with what to do about it."""
    columns = table_columns(records)
    cells = [[c.header for c in columns]] + [[c.cell(r) for c in columns] for r in records]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in cells]
    if records[0]["rounds"] > 1:
        lines.append(f"(median of {records[0]['rounds']} rounds; 'rounds' = lowest-highest round; speedups "
                     f"paired within each round; measured optimizer steps per setting: "
                     + ", ".join(f"k={r['accumulate_grad_batches']}: {r['measured_steps']}" for r in records) + ")")
    if "predicted_speedup" in records[0]:
        lines.append(f"(predicted: the speedup the advisor forecast from each round's k={records[0]['accumulate_grad_batches']} "
                     "timeline, median over rounds; error: predicted / measured - 1)")
    if warnings:
        lines.append("")
        lines += [f"WARNING: {text}" for text in warnings]
    if warnings and records[0]["rounds"] > 1:
        lines.append("These rounds do not agree: rerun with more --rounds or --steps, on a quieter machine, "
                     "before trusting the numbers above.")
    return "\n".join(lines)
