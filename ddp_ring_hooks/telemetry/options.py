"""The telemetry options: defined once, checked once, collected in one place.

:class:`TelemetryOptions` is the one definition: its fields are the options' names, defaults
and checks. ``HookState``, ``register`` and the Lightning strategy take either a
``telemetry=TelemetryOptions(...)`` (or a ready :class:`~.recorder.Telemetry`) or the same
fields as keywords, and :func:`collect_telemetry_options` is where the two meet: a field given
both ways is an error that names it, never a value silently dropped. Every watcher of the
observation (:mod:`.observation`) reads the one options object, so every field reaches every
watcher.

The checks run when the options are built, so a bad value fails at construction with a
message that names the option and the fix (a ``log_dir`` that cannot be written, a trace
window without a ``log_dir``), not later on the writer thread.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import tempfile
from collections.abc import Mapping

from .cadence import AUTO


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


@dataclasses.dataclass(frozen=True)
class TelemetryOptions:
    """Every telemetry option, checked when built (``ValueError`` naming the option and the fix).

    Args:
        log_dir: write TensorBoard events, the trace and the advisor's ``timeline.jsonl`` here;
            the group's rank 0 only unless ``per_rank``.
        log_every: observe every N-th optimizer step (1: every step, the default), or
            ``"auto"``: the steps that gather (``spread_every``), the default with ``diagnose=True``,
            so the per-bucket records cost no more often than the gather the cadence prices.
        trace_steps: steps for a Chrome/Perfetto trace ``log_dir/comm_trace.json``: a
            ``(start, stop)`` pair of optimizer steps (``stop`` excluded) or a count N, which
            means the N steps after the first (step 1 runs DDP's provisional bucket layout).
            Kept as a ``range``.
        per_rank: every rank writes to ``log_dir/rank_{r}`` (to compare ranks in TensorBoard).
        spread_every: every N-th step, gather when each rank arrived (handed its last bucket
            over) and log the straggler, its cost, the arrival spread and the ranks' step
            times (0: never); ``"auto"``: as often as keeps what a gathered step costs within
            1% of a step, measured as training runs (the first 12 steps gather; :mod:`.cadence`).
        sinks: more sinks (e.g. :class:`~.sinks.MemorySink`), on every rank, fed logged steps;
            they are not pickled (a sink holds files or memory of this process).
        capacity: how many finished steps may wait for the writer before new ones are dropped.
        summary_window: how many recent samples per bucket the summary's percentiles use.
        stall_after: seconds a bucket may wait without progress (a transfer done, a step
            completed) before this rank judges the wait: who waits for whom, read through the
            process group's store, and the rank at the end of the chain named: stalled when it
            stopped reporting (logged, warned, and with ``log_dir`` the ``comm/stall`` panel and
            ``stall_rank{r}.json``, repeated every ``stall_after`` while it lasts), busy when it
            is alive outside the all-reduce (one line), nothing when it is paused (:mod:`.stall`).
        stall_timeout: seconds without progress after which, if a rank stopped reporting, the
            waiting bucket's Future fails with an error naming it and the group's pending
            transfers are aborted, so the process can exit and be restarted from a checkpoint;
            longer than ``stall_after``. Never for a busy or paused rank: the group's own timeout
            ends such a wait. ``None``: 90% of the process group's own timeout, so this error,
            which names the rank, comes before the backend's, which names none.
        links: on the steps that gather across ranks (``spread_every``, the trace window), also
            time every directed link from the hook's own transfers and name a slow one
            (:mod:`.link_timing`); under ``native``, whose transfers the hook cannot see, from a
            small probe between ring neighbours after the step instead; needs ``spread_every``
            or ``trace_steps``. Off by default.
        diagnose: the one switch for diagnosis that stays on: the straggler gather and per-link
            timing at ``spread_every="auto"`` (unless ``spread_every`` gives a cadence), with
            the stall watchdog (always on) and a summary line and TensorBoard tags of each.

    Nothing is recorded unless ``log_dir``, ``spread_every`` or ``sinks`` ask for it; the stall
    watchdog always watches (a timestamp per transfer; its thread sleeps).
    """

    log_dir: str | os.PathLike | None = None
    log_every: int | str | None = None
    trace_steps: int | tuple[int, int] | range | None = None
    per_rank: bool = False
    spread_every: int = 0
    sinks: tuple = ()
    capacity: int = 1024
    summary_window: int = 1024
    stall_after: float = 60.0
    stall_timeout: float | None = None
    links: bool = False
    diagnose: bool = False

    def __post_init__(self) -> None:
        if _diagnose(self.diagnose):  # the one switch: the gather and the links, at "auto"
            object.__setattr__(self, "spread_every", self.spread_every or AUTO)
            object.__setattr__(self, "links", True)
        if self.log_every is None:  # diagnose's records at its cadence, not every step
            object.__setattr__(self, "log_every", AUTO if self.diagnose else 1)
        checked = {
            "log_dir": _writable_log_dir(self.log_dir),
            "log_every": _log_every(self.log_every, self.spread_every),
            "trace_steps": _trace_window(self.trace_steps, self.log_dir),
            "per_rank": _per_rank(self.per_rank, self.log_dir),
            "spread_every": _cadence(self.spread_every),
            "sinks": _sinks(self.sinks),
            "capacity": _positive_int("capacity", self.capacity),
            "summary_window": _positive_int("summary_window", self.summary_window),
            **_stall_seconds(self.stall_after, self.stall_timeout),
            "links": _links(self.links, self.spread_every, self.trace_steps),
        }
        for name, value in checked.items():  # normalized (a str log_dir, a range, a tuple)
            object.__setattr__(self, name, value)

    # Pickled without the sinks (they hold files, writers, memory of this process). States
    # pickled before a field existed get its default.
    def __getstate__(self) -> dict:
        return {name: getattr(self, name) for name in TELEMETRY_OPTIONS if name != "sinks"}

    def __setstate__(self, state: dict) -> None:
        for field in dataclasses.fields(self):
            object.__setattr__(self, field.name, state.get(field.name, field.default))


#: Every telemetry option, by name: the fields of :class:`TelemetryOptions`.
TELEMETRY_OPTIONS = tuple(field.name for field in dataclasses.fields(TelemetryOptions))


def collect_telemetry_options(given: TelemetryOptions | None, fields: Mapping[str, object]) -> TelemetryOptions:
    """The one place telemetry options are collected: ``given`` (``telemetry=``) or ``fields``
    (the same options as keywords), not the same option both ways.

    Raises ``ValueError`` naming every option given both ways; keywords that are not telemetry
    options are the caller's to sort out before (``HookState`` hands them to the algorithm).
    """
    if given is None:
        return TelemetryOptions(**fields)
    if not isinstance(given, TelemetryOptions):
        raise TypeError(f"telemetry= takes TelemetryOptions(...) (HookState also a ready Telemetry(...)), got {type(given).__name__}")
    twice = sorted(fields)
    if twice:
        names = ", ".join(map(repr, twice))
        raise ValueError(
            f"telemetry option{'s' if len(twice) > 1 else ''} {names} given twice: in telemetry= and as "
            f"{'keywords' if len(twice) > 1 else 'a keyword'}; put {'them' if len(twice) > 1 else 'it'} into "
            "the telemetry object (e.g. Telemetry(log_dir=..., spread_every=...)) or pass only keywords"
        )
    return given


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _log_every(log_every, spread_every) -> int | str:
    if log_every != AUTO:
        return _positive_int("log_every", log_every)
    if not spread_every:
        raise ValueError("log_every='auto' records the steps that gather across ranks, and none do: "
                         "pass spread_every=N (or 'auto'), diagnose=True, or an integer log_every")
    return AUTO


def _cadence(spread_every) -> int | str:
    if spread_every == AUTO:
        return AUTO
    if isinstance(spread_every, bool) or not isinstance(spread_every, int) or spread_every < 0:
        raise ValueError(f"spread_every must be an integer >= 0 (0 turns it off) or 'auto' (as often as keeps "
                         f"its cost within 1% of a step), got {spread_every!r}")
    return spread_every


def _diagnose(diagnose) -> bool:
    if not isinstance(diagnose, bool):
        raise ValueError(f"diagnose must be True or False, got {diagnose!r}")
    return diagnose


def _stall_seconds(stall_after, stall_timeout) -> dict[str, float | None]:
    """The watchdog's two durations, checked: positive seconds, the timeout after the warning."""
    checked = {"stall_after": _positive_seconds("stall_after", stall_after)}
    checked["stall_timeout"] = None if stall_timeout is None else _positive_seconds("stall_timeout", stall_timeout)
    if checked["stall_timeout"] is not None and checked["stall_timeout"] <= checked["stall_after"]:
        raise ValueError(
            f"stall_timeout={checked['stall_timeout']:g} s must be longer than stall_after={checked['stall_after']:g} s: the watchdog "
            "first reports a stall, then fails the bucket; pass a longer stall_timeout or a shorter stall_after"
        )
    return checked


def _positive_seconds(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


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
    if isinstance(trace_steps, range) and trace_steps.step == 1 and 1 <= trace_steps.start < trace_steps.stop:
        return trace_steps
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


def _links(links, spread_every, trace_steps) -> bool:
    if not isinstance(links, bool):
        raise ValueError(f"links must be True or False, got {links!r}")
    if links and not spread_every and trace_steps is None:
        raise ValueError("links=True times every link on the steps that gather across ranks; pass spread_every=N "
                         "too (every N-th step), or trace_steps=... for the trace window")
    return links


def _sinks(sinks) -> tuple:
    sinks = tuple(sinks)
    for sink in sinks:
        check_sink(sink)
    return sinks


def check_sink(sink) -> None:
    if not callable(getattr(sink, "write", None)):
        raise TypeError(f"a telemetry sink needs write(record), flush() and close(); got {type(sink).__name__}")
