"""Chrome/Perfetto trace events, built the same way by every record that has some (pure).

A record shows itself in the trace as a list of events (``Record.trace_events``, :mod:`.records`);
these helpers make the event dicts (times in ms on the recording rank's clock, written in µs)
and hold the track numbers, so the records and the trace sink (:mod:`.trace`) agree on them::

    pid = rank                 tid = bucket index            one track per bucket
                               EXPOSED_TID, ARRIVAL_TID      the exposed part, the arrival
                               COUNTERS ("C" events)         every watcher's scalars, by tag
    pid = LINKS_PID            tid = link_tid(src, dst)      one track per directed link

Our own metadata travels as events too: a ``CLOCK`` event (``ph: "M"``) says how the rank's
clock relates to rank 0's; the trace sink takes it into the file's header instead of writing it.
"""

from __future__ import annotations

#: Track numbers after every bucket's (bucket i is track i).
EXPOSED_TID, ARRIVAL_TID = 1_000_000, 1_000_001
#: The process that holds every link's track, sorted after the ranks.
LINKS_PID = 1_000_000
#: The name of our clock metadata event (see the module docstring).
CLOCK = "ddp_ring_hooks.clock"


def link_tid(src: int, dst: int) -> int:
    """The track of the directed link ``src``→``dst``."""
    return src * 100_000 + dst


def track_names(pid: int, tid: int, process: str, thread: str) -> list[dict]:
    """The metadata events that name (and sort) a process and one of its tracks."""
    return [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": process}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": thread}},
        {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}},
    ]


def slice_event(name: str, pid: int, tid: int, start_ms: float, dur_ms: float, args: dict | None = None) -> dict:
    """A complete (``"X"``) slice from ``start_ms`` lasting ``dur_ms`` (a negative one is empty)."""
    event = {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": start_ms * 1e3, "dur": max(dur_ms, 0.0) * 1e3}
    if args:
        event["args"] = args
    return event


def counter_event(tag: str, pid: int, at_ms: float, value: float) -> dict:
    """A counter (``"C"``) sample: Perfetto draws one track per ``tag`` of the rank ``pid``."""
    return {"ph": "C", "name": tag, "pid": pid, "tid": 0, "ts": at_ms * 1e3, "args": {"value": value}}


def clock_event(rank: int, offset_ms: float, error_ms: float) -> dict:
    """How ``rank``'s clock relates to rank 0's (its clock minus rank 0's, and the error)."""
    return {"ph": "M", "name": CLOCK, "pid": rank, "tid": 0, "args": {"clock_offset_ms": offset_ms,
                                                                      "clock_error_ms": error_ms}}
