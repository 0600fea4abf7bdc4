"""Put the trace files of several ranks on one time axis: rank 0's monotonic clock.

Each rank's :class:`~.trace.TraceSink` file stamps events with that rank's own clock and says
how it relates to rank 0's (``ddp_ring_hooks.clock_offset_ms``: its clock minus rank 0's, from
the gathered arrivals; 0 on rank 0's host). Merging shifts every event of a rank by minus its
offset and keeps one process per rank, sorted by rank. Rank 0 does this itself at the end of
the trace window; ``ddp-ring-hooks trace merge DIR`` does it for ``per_rank`` runs.
"""

from __future__ import annotations

import glob
import json
import os

MERGED_FILE = "comm_trace.json"


def shift_events(events: list[dict], shift_ms: float) -> list[dict]:
    """Copies of ``events`` moved by ``shift_ms`` (metadata events have no time)."""
    shifted = []
    for event in events:
        if "ts" in event:
            event = {**event, "ts": event["ts"] + shift_ms * 1e3}
        shifted.append(event)
    return shifted


def rank_trace_files(directory: str | os.PathLike) -> list[str]:
    """The per-rank trace files of a ``per_rank`` run: ``DIR/rank_*/comm_trace.json``."""
    return sorted(glob.glob(os.path.join(os.fspath(directory), "rank_*", MERGED_FILE)))


def merge_trace_files(paths: list[str]) -> dict:
    """One Chrome/Perfetto trace of the files in ``paths``, aligned on rank 0's clock.

    Raises ValueError, naming the file, when a file is no rank trace of this package or two
    files hold the same rank.
    """
    merged: list[dict] = []
    ranks: dict[int, str] = {}
    errors: list[float] = []
    known: list[bool] = []
    for path in paths:
        with open(path) as file:
            trace = json.load(file)
        metadata = trace.get("ddp_ring_hooks") if isinstance(trace, dict) else None
        if not metadata or "traceEvents" not in trace:
            raise ValueError(
                f"{path} is not a trace written by ddp_ring_hooks (no 'ddp_ring_hooks' metadata); "
                "pass the comm_trace.json files that register(..., trace_steps=..., per_rank=True) wrote"
            )
        rank = int(metadata["rank"])
        if rank in ranks:
            raise ValueError(f"{path} and {ranks[rank]} both hold rank {rank}; merge the files of one run")
        ranks[rank] = path
        merged += shift_events(trace["traceEvents"], -float(metadata["clock_offset_ms"]))
        errors.append(float(metadata["clock_error_ms"]))
        known.append(bool(metadata.get("clock_known", True)))
    return {
        "traceEvents": merged,
        "displayTimeUnit": "ms",
        "ddp_ring_hooks": {
            "rank": 0, "clock_offset_ms": 0.0, "clock_error_ms": max(errors, default=0.0),
            "clock_known": all(known),
            "merged_ranks": sorted(ranks),
        },
    }
