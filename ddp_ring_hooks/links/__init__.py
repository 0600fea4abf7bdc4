"""Which link is slow: pure functions over measured links (no torch, nothing else of the package).

- :mod:`.rule`: the naming rule: from each directed link's bandwidth (a matrix, or samples
  over steps) to a slow rank's network, a slow node uplink or slow links, and its summary line.
- :mod:`.pairing`: rounds of disjoint pairs that meet every pair once (the circle method).
- :mod:`.matrix`: a probe's measurements, their versioned JSON file and the text table.
- :mod:`.heatmap`: the matrix as a picture (matplotlib, imported when called).
- :mod:`.ring_order`: the ring order whose slowest link is fastest (``ring_order="measured"``).

The probe that measures on ranks is ``ddp_ring_hooks.runtime.link_probe``; the command is
``ddp-ring-hooks links`` (docs/links.md).
"""

from .matrix import FORMAT, VERSION, LinkMatrix, format_table, load_link_matrix, write_link_matrix
from .pairing import exchange_rounds, partner_in
from .ring_order import best_ring
from .rule import (
    ALL, BETWEEN, CONSISTENT_SHARE, INSIDE, MIN_TRAINING_SAMPLES, THRESHOLD, WINDOW, Link, LinkSample, LinkVerdict, SlowLinks, SlowNode, SlowRank,
    judge_links, judge_samples, recent_bandwidths,
)

__all__ = [
    "ALL", "BETWEEN", "CONSISTENT_SHARE", "FORMAT", "INSIDE", "MIN_TRAINING_SAMPLES", "THRESHOLD", "VERSION", "WINDOW", "Link", "LinkMatrix",
    "LinkSample", "LinkVerdict", "SlowLinks", "SlowNode", "SlowRank", "best_ring", "exchange_rounds", "format_table", "judge_links",
    "judge_samples", "load_link_matrix", "partner_in", "recent_bandwidths", "write_link_matrix",
]
