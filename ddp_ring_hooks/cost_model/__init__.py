"""The α-β-γ cost model: predicted all-reduce times, counts from schedules, and calibration.

    predict("ring", nbytes, p, alpha=5e-6, beta=1e-11)      # closed form, seconds (one tier)
    predict("hierarchical", nbytes, p, Links(5e-6, 1e-11, local=Links(1e-6, 1e-12)), local_size=8)
    simulate(build_schedule("ring", p), nbytes, alpha=..., beta=...)  # same, from the schedule
    fit([(nbytes, seconds), ...])                           # α, β from measurements
    fit_per_algorithm(bench_records)                        # {algorithm: Calibration}
    simulate(schedule, nbytes, links, placement=..., shared_uplinks=True)  # nodes sharing uplinks
    price(uplink_terms(schedule, placement), nbytes, links)
    TwoTier(links, ranks_per_node=G).predict(algorithm, nbytes, p)

``links`` is the one network value, :class:`Links` (α, β, γ, and the links inside a node).

Pure Python: no torch import, so it runs anywhere the schedules do.
"""

from .fit import Calibration, ProbeFit, ProbeSample, fit, fit_per_algorithm, fit_probe, fit_records
from .formulas import Links, coefficients, cost_terms, predict, price
from .schedule_costs import bytes_sent_per_rank, count_steps, simulate
from .two_tier import (
    RingCrossings, TwoTier, UplinkTraffic, hierarchical_uplink_cost, ring_crossings, ring_uplink_cost, two_tier_terms,
    uplink_terms, uplink_traffic,
)

__all__ = [
    "Calibration", "Links", "ProbeFit", "ProbeSample", "RingCrossings", "TwoTier", "UplinkTraffic", "bytes_sent_per_rank", "coefficients", "cost_terms", "count_steps",
    "fit", "fit_per_algorithm", "fit_probe", "fit_records", "hierarchical_uplink_cost", "predict", "price", "ring_crossings",
    "ring_uplink_cost", "simulate", "two_tier_terms", "uplink_terms", "uplink_traffic",
]
