"""The α-β-γ cost model: predicted all-reduce times, counts from schedules, and calibration.

    predict("ring", nbytes, p, alpha=5e-6, beta=1e-11)      # closed form, seconds
    simulate(build_schedule("ring", p), nbytes, alpha=..., beta=...)  # same, from the schedule
    fit([(nbytes, seconds), ...])                           # α, β from measurements
    fit_per_algorithm(bench_records)                        # {algorithm: Calibration}

Pure Python: no torch import, so it runs anywhere the schedules do.
"""

from .fit import Calibration, fit, fit_per_algorithm, fit_records
from .formulas import coefficients, cost_terms, predict
from .schedule_costs import bytes_sent_per_rank, count_steps, simulate

__all__ = ["Calibration", "bytes_sent_per_rank", "coefficients", "cost_terms", "count_steps", "fit", "fit_per_algorithm", "fit_records", "predict", "simulate"]
