"""Which steps gather across ranks: every N-th, or as often as keeps diagnosis within 1% of a step.

A gathered step costs something the training pays for: the exchange's CPU time after the step
(:mod:`.exchange`, on cores the ranks share), and with the probe under ``native`` its bytes on
the links. ``spread_every=N`` gathers every N-th step whatever that costs. ``spread_every="auto"``
(what ``diagnose=True`` asks for) measures it and gathers only as often as keeps it within
:data:`BUDGET` of the step::

    step        1  2  3 ... 12 | 13 ...  19 ...  25 ...
    gathers     x  x  x ...  x |  x       x       x        (gap decided from the cost)
                  warm-up      |
    row         each gathered step's one gather carries, from every rank:
                [what its previous exchange cost (ms), its median step time since (ms)]

1. **Warm-up.** The first :data:`WARMUP` steps gather, every one: a straggler is named within
   them (the tally wants :data:`~.stragglers.MIN_STEPS` steps), a slow link from the fifth
   (the link rule's :data:`~ddp_ring_hooks.links.MIN_TRAINING_SAMPLES`; under ``native``, whose
   links the probe times every 2nd gathered step, the ninth).
2. **Measure.** What a gathered step costs this rank, on every thread of ours that works for it:
   the exchange (its thread's CPU time, plus the probe's time on the links), the telemetry
   writer (the step's records, which ``log_every="auto"`` writes on gathered steps only) and the
   hook thread (handing a marked step's buckets to the watchers), each charged with
   :meth:`Cadence.charge`; every step's start is one clock reading on the hook thread. Not
   priced: the per-transfer marks on the communication threads and gloo's own threads' share
   of the exchange's messages (``benchmarks/telemetry_overhead.py --breakdown`` shows them).
3. **Decide, every rank alike.** After each gather every rank holds the same rows and computes
   the same gap::

       cost = median over the last COST_WINDOW gathers of (the costliest rank's cost)
       gap  = ceil(cost / (BUDGET x median step)),   1 <= gap <= MAX_GAP

4. **Apply with a lag.** The gap decided at gather ``k`` is the distance from gather ``k + LAG``
   to the next one. The hook thread settles each gathered step's successor as that step starts,
   at least ``LAG`` steps after gather ``k``'s exchange began, so the decision is there; if it is
   not, the hook thread waits for it (every rank must gather the same steps; at most
   :data:`DECISION_WAIT_S`, then this rank gathers no more, with a warning).

What it promises: from the start, a straggler named within :data:`WARMUP` steps and a slow link
from the fifth gathered step (the ninth under ``native``); a link that turns slow later within ``3/4 x`` the link rule's window
of gathered steps, i.e. ``12 x gap`` steps (the summary line states the gap).
"""

from __future__ import annotations

import math
import statistics
import threading
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from .records import Scalars

#: The share of a step that what the cadence clocks (2. of the module docstring) may cost, on
#: average: under diagnosis's strictest target, 0.5% of a step on a network, with room for what
#: it cannot clock. On loopback (target 1%) that is gloo's own threads carrying the exchange's
#: messages and the per-transfer marks on the communication threads, about a third of a gathered
#: step's CPU (``benchmarks/telemetry_overhead.py --breakdown``, ring, 2 ranks). On the lab the
#: clocked cost is nearly all of it: at 0.5% clocked, ``native`` (the probe) measured 1.004-1.007
#: in three 40-round runs (its gathered steps priced at 0.43-0.48% of a step; rank 0's CPU by
#: thread +0.05 ms a step), so the budget is 0.35%, and a link that turns slow later is named
#: about 1.4x later than at 0.5% (``12 x gap`` steps, the summary line says).
BUDGET = 0.0035
#: The first steps gather, every one (a straggler is named within them).
WARMUP = 12
#: The gap decided at gather k applies from gather k + LAG (see the module docstring, 4.).
LAG = 2
#: The cost is the median of the costliest rank's over this many recent gathers.
COST_WINDOW = 8
#: Never fewer gathers than one every MAX_GAP steps (a slow link is still named within 12 of them).
MAX_GAP = 64
#: How long the hook thread waits for a decision that is late before this rank stops gathering.
DECISION_WAIT_S = 60.0
#: Steps whose answer is remembered, for the threads that ask after the hook thread did.
_REMEMBERED = 4096
AUTO = "auto"


class Cadence:
    """Which optimizer steps gather across ranks (see the module docstring): ``every`` is
    ``spread_every``, an integer (``0``: never) or ``"auto"``."""

    def __init__(self, every: int | str) -> None:
        self.every = every
        self.auto = every == AUTO
        self._lock = threading.Condition()
        self._asked = 0  # the latest step the hook thread asked about
        self._next = 1  # the next step that gathers (auto)
        self._gathered: deque[int] = deque(maxlen=_REMEMBERED)  # recent gathered steps (auto), in order
        self._recent: set[int] = set(self._gathered)  # the same, to look up (a deque's `in` walks it)
        self._count = 0  # gathered steps settled so far
        self._gaps: list[int] = []  # the gap decided at each gather, by gather index
        self._costs: deque[float] = deque(maxlen=COST_WINDOW)  # the costliest rank's, per gather
        self._starts: deque[float] = deque(maxlen=64)  # recent steps' start times (s, hook thread)
        self._spent_ms = 0.0  # what this rank's last exchange cost
        self._charged_ms = 0.0  # what other threads spent on gathered steps since (charge())
        self._decided: tuple[int, float, float] | None = None  # (gap, cost ms, step ms), the latest
        self._stopped = False

    # -- the hook thread ---------------------------------------------------------------------

    def gathers(self, step: int) -> bool:
        """Whether optimizer ``step`` gathers across ranks: the same answer on every rank. Asked
        first on the hook thread, as the step starts; later by others, about steps it settled."""
        if not self.auto:
            return self.every > 0 and step % self.every == 0
        with self._lock:
            if step <= self._asked:  # the latest first: the hook thread asks again about its own step
                gathered = self._gathered
                return bool(gathered) and (gathered[-1] == step or (step < gathered[-1] and step in self._recent))
            self._asked = step
            if self._stopped or step < self._next:
                return False
            index, self._count = self._count, self._count + 1
            if len(self._gathered) == self._gathered.maxlen:
                self._recent.discard(self._gathered[0])
            self._gathered.append(step)
            self._recent.add(step)
        self._next = step + self._gap_after(index)
        return True

    def _gap_after(self, index: int) -> int:
        """The distance from gather ``index`` to the next (4. of the module docstring)."""
        if index < WARMUP:
            return 1
        deciding = index - LAG
        with self._lock:
            if not self._lock.wait_for(lambda: self._stopped or len(self._gaps) > deciding, DECISION_WAIT_S):
                self._stopped = True
                warnings.warn(f"spread_every='auto': the exchange of a gathered step did not finish within "
                              f"{DECISION_WAIT_S:.0f} s; this rank gathers no more", stacklevel=1)
            return MAX_GAP if self._stopped else self._gaps[deciding]

    def charge(self, cpu_ms: float) -> None:
        """Any thread: ``cpu_ms`` more that gathered steps cost this rank (the writer's records, the
        hook thread's marked buckets); the next exchange's cost includes it. Only with ``auto``."""
        if self.auto:
            with self._lock:
                self._charged_ms += cpu_ms

    def started(self, now_s: float) -> None:
        """Hook thread: a step's first bucket was handed over at ``now_s`` (seconds)."""
        self._starts.append(now_s)

    # -- the exchange worker -----------------------------------------------------------------

    def row(self) -> tuple[float, ...]:
        """This rank's share of the step's gather: what its last exchange cost (ms) and its
        median step time (ms) over the recent steps; nothing unless ``auto``."""
        if not self.auto:
            return ()
        starts = list(self._starts)
        intervals = [b - a for a, b in zip(starts, starts[1:])]
        return (self._spent_ms, statistics.median(intervals) * 1e3 if intervals else 0.0)

    def spent(self, cost_ms: float) -> None:
        """What this rank's exchange of a gathered step just cost (ms); what other threads were
        charged since the last exchange is added to it."""
        with self._lock:
            self._spent_ms, self._charged_ms = cost_ms + self._charged_ms, 0.0

    def decide(self, rows: Sequence[Sequence[float]]) -> tuple[int, float, float]:
        """Every rank's :meth:`row` of this gather (the same on every rank): the gap it decides,
        with the cost (ms) and the step time (ms) it was decided from."""
        self._costs.append(max(row[0] for row in rows))
        cost_ms = statistics.median(self._costs)
        step_ms = statistics.median(row[1] for row in rows)
        gap = gap_for(cost_ms, step_ms)
        with self._lock:
            self._gaps.append(gap)
            self._decided = (gap, cost_ms, step_ms)
            self._lock.notify_all()
        return self._decided

    def stop(self) -> None:
        """The exchange broke (a peer gone): no more gathered steps on this rank."""
        with self._lock:
            self._stopped = True
            self._lock.notify_all()

    # -- reading -------------------------------------------------------------------------------

    def summary_line(self) -> str | None:
        """With ``"auto"``: how often steps gather, from what cost, and what that promises."""
        if not self.auto:
            return None
        with self._lock:
            decided, count, asked = self._decided, self._count, self._asked
        if decided is None:
            return f"cadence: auto, {count} of {asked} steps gathered (warm-up: the first {WARMUP} gather)"
        gap, cost_ms, step_ms = decided
        share = cost_ms / gap / step_ms if step_ms > 0 else 0.0
        return (f"cadence: auto, {count} of {asked} steps gathered, now every {_nth(gap)} (a gathered step costs "
                f"{cost_ms:.3g} ms, {share:.2%} of the {step_ms:.3g} ms step when spread); a slow link that "
                f"appears is named within {12 * gap} steps")


@dataclass(frozen=True)
class CadenceRecord(Scalars):
    """A decision of the cadence, at the gathered step it was made: ``comm/diagnosis/gather_every``
    (the gap), ``cost_ms`` (a gathered step's cost) and ``step_ms`` (the step it was weighed
    against). In TensorBoard and the trace; the summary has its own line."""

    summarized = False

    @classmethod
    def of(cls, step: int, gap: int, cost_ms: float, step_ms: float, *, rank: int = 0) -> CadenceRecord:
        return cls(step, {"comm/diagnosis/gather_every": gap, "comm/diagnosis/cost_ms": cost_ms,
                          "comm/diagnosis/step_ms": step_ms}, rank=rank)


def gap_for(cost_ms: float, step_ms: float) -> int:
    """How many steps apart gathers must be for ``cost_ms`` each to be :data:`BUDGET` of a step
    of ``step_ms`` (1 before any step was timed)."""
    if not step_ms > 0 or not math.isfinite(cost_ms):
        return 1
    return max(1, min(MAX_GAP, math.ceil(cost_ms / (BUDGET * step_ms))))


def _nth(gap: int) -> str:
    if gap == 1:
        return "step"
    suffix = "th" if 10 <= gap % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(gap % 10, "th")
    return f"{gap}{suffix} step"
