"""The telemetry options, listed and checked in one place.

``Telemetry``, ``HookState``, ``register`` and the Lightning strategy take these names; the
checks run when the object is built, so a bad value fails at construction with a message
that names the option and the fix (a ``log_dir`` that cannot be written, a trace window
without a ``log_dir``), not later on the writer thread.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile

def group_log_dir(log_dir: str, group=None) -> str:
    """Where a hook group's files go: ``log_dir`` itself when the group is every rank, else
    ``log_dir/{group_dir_name(ranks)}`` (``group_0-3`` for ranks 0 to 3).

    The group's rank 0 writes them (not global rank 0, which need not be in the group). An SPMD
    script passes the same ``log_dir`` on every rank; with several data-parallel groups (say
    ranks 0-3 and 4-7), each group's files land in a directory of its own, and TensorBoard shows
    each group as a run of its own instead of one run mixing both.
    """
    import torch.distributed as dist

    if group is None or not dist.is_initialized() or dist.get_world_size(group) == dist.get_world_size():
        return log_dir
    return os.path.join(log_dir, group_dir_name(dist.get_process_group_ranks(group)))


def group_dir_name(ranks) -> str:
    """A directory name that tells the group's global ranks apart from any other group's:
    ``group_0-3`` (consecutive), ``group_0-24_step8`` (evenly spaced: 0, 8, 16, 24), else
    ``group_{first}_{hash of the ranks}``."""
    ranks = sorted(ranks)
    first, last = ranks[0], ranks[-1]
    if len(ranks) == 1:
        return f"group_{first}"
    step = ranks[1] - first
    if ranks == list(range(first, last + 1, step)):
        return f"group_{first}-{last}" + (f"_step{step}" if step != 1 else "")
    digest = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:8]
    return f"group_{first}_{digest}"


#: Every telemetry option a hook state, ``register`` or the Lightning strategy accepts.
TELEMETRY_OPTIONS = ("log_dir", "log_every", "trace_steps", "per_rank", "spread_every", "sinks")


@dataclasses.dataclass(frozen=True)
class TelemetryOptions:
    """Checked telemetry options (see :class:`~.recorder.Telemetry` for what each means)."""

    log_dir: str | None
    log_every: int
    trace_steps: range | None
    per_rank: bool
    spread_every: int
    capacity: int
    summary_window: int

    @classmethod
    def checked(
        cls, *, log_dir=None, log_every=1, trace_steps=None, per_rank=False, spread_every=0,
        capacity=1024, summary_window=1024,
    ) -> TelemetryOptions:
        """The options, each checked; raises ``ValueError`` naming the option and the fix."""
        return cls(
            log_dir=_writable_log_dir(log_dir),
            log_every=_positive_int("log_every", log_every),
            trace_steps=_trace_window(trace_steps, log_dir),
            per_rank=_per_rank(per_rank, log_dir),
            spread_every=_non_negative_int("spread_every", spread_every),
            capacity=_positive_int("capacity", capacity),
            summary_window=_positive_int("summary_window", summary_window),
        )


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _non_negative_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0 (0 turns it off), got {value!r}")
    return value


def _writable_log_dir(log_dir) -> str | None:
    """``log_dir`` as a string, created if missing, checked writable now: a directory that
    cannot be written would otherwise fail later on the writer thread, after training began."""
    if log_dir is None:
        return None
    path = os.fspath(log_dir)
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):  # what the writer will do; os.access trusts root
            pass
    except OSError as error:
        raise ValueError(
            f"log_dir={path!r} cannot be written ({error.strerror or error}); pass log_dir= a directory "
            "this process can create and write, or leave it out to log nothing"
        ) from error
    return path


def _trace_window(trace_steps, log_dir) -> range | None:
    if trace_steps is None:
        return None
    if log_dir is None:
        raise ValueError("trace_steps needs log_dir=PATH: the trace is written to log_dir/comm_trace.json")
    if isinstance(trace_steps, int) and not isinstance(trace_steps, bool):
        return range(2, 2 + _positive_int("trace_steps", trace_steps))
    if (
        isinstance(trace_steps, tuple | list) and len(trace_steps) == 2
        and all(isinstance(s, int) and not isinstance(s, bool) for s in trace_steps)
        and 1 <= trace_steps[0] < trace_steps[1]
    ):
        return range(trace_steps[0], trace_steps[1])
    raise ValueError(
        f"trace_steps must be a step count N or a (start, stop) pair of optimizer steps with "
        f"1 <= start < stop, got {trace_steps!r}"
    )


def _per_rank(per_rank: bool, log_dir) -> bool:
    if per_rank and log_dir is None:
        raise ValueError("per_rank=True writes each rank to log_dir/rank_{r}; pass log_dir=PATH too")
    return bool(per_rank)


def check_sink(sink) -> None:
    if not callable(getattr(sink, "write", None)):
        raise TypeError(f"a telemetry sink needs write(record), flush() and close(); got {type(sink).__name__}")
