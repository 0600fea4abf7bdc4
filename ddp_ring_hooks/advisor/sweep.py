"""Predicted speedup per accumulation k, next to the measured one (for the accumulation sweep).

    predicted = accumulation_speedups(strategy.hook_state.timeline.records(), ks=[1, 2, 4, 8])
    print(format_predicted_vs_measured(predicted, {1: 1.0, 2: 1.4, ...}))

Speedups are samples per second relative to the run the records come from (run it at the
smallest k, and the two columns share their baseline).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from .advice import step_model
from .profile import TimelineRecord
from .step_model import run_setting


def accumulation_speedups(records: Sequence[TimelineRecord], *, ks: Iterable[int]) -> dict[int, float]:
    """``{k: predicted samples/s relative to the run}`` from one run's timeline ``records``."""
    model = step_model(records)
    here = run_setting(model.profile)
    return {k: model.speedup(replace(here, accumulate=k)) for k in ks}


def format_predicted_vs_measured(predicted: Mapping[int, float], measured: Mapping[int, float]) -> str:
    """A table ``k | predicted | measured | error`` (error relative to measured)."""
    lines = [f"{'k':>3} {'predicted':>10} {'measured':>9} {'error':>7}"]
    for k in sorted(predicted):
        if k in measured:
            error = predicted[k] / measured[k] - 1
            lines.append(f"{k:>3} {predicted[k]:>9.2f}x {measured[k]:>8.2f}x {error:>+7.1%}")
        else:
            lines.append(f"{k:>3} {predicted[k]:>9.2f}x {'-':>9} {'':>7}")
    return "\n".join(lines)
