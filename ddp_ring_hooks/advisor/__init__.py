"""The advisor: from one run's timeline to what to change, with the predicted gain.

Pure: it reads timeline records (``log_dir/timeline.jsonl`` or ``state.timeline``), never
process groups, so it runs offline and in unit tests without ranks::

    records -> profile_run -> StepModel(profile, network) -> predict(Setting) -> advise()

- :mod:`.bucketing`: DDP's bucketing rules for another ``bucket_cap_mb``;
- :mod:`.ready_curve`: bytes of gradient ready vs time in backward;
- :mod:`.replay`: buckets queued through the communication lanes and the link's two ways, exposed time;
- :mod:`.link_directions`: which way of the link (out, in, both) each part of an all-reduce holds;
- :mod:`.network`: α-β per algorithm from this run, a ``bench --json`` file, two numbers, or two tiers;
- :mod:`.ring_order`: what the rank order costs when the ring crosses nodes more than it must;
- :mod:`.profile`: the run's medians (compute, contention, optimizer, buckets);
- :mod:`.step_model`: one optimizer step in another setting;
- :mod:`.advice`: what-if tables, the recommendation, the ``--json`` shape and its text.
"""

from .advice import advise, format_advice, step_model, what_if
from .network import Network, from_bench, from_latency_bandwidth, from_run, from_two_tier
from .ring_order import RingOrderNote, hierarchy_note, ring_order_note
from .profile import RunProfile, profile_run
from .step_model import Prediction, Setting, StepModel, run_setting
from .sweep import accumulation_speedups, format_predicted_vs_measured

__all__ = [
    "Network", "Prediction", "RingOrderNote", "RunProfile", "Setting", "StepModel", "accumulation_speedups", "advise",
    "format_advice", "format_predicted_vs_measured", "from_bench", "from_latency_bandwidth", "from_run",
    "from_two_tier", "hierarchy_note", "profile_run", "ring_order_note", "run_setting", "step_model", "what_if",
]
