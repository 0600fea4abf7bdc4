"""``algorithm="auto"``: per bucket, the algorithm the calibrated cost model says is fastest.

One choice code for everyone: the hook (``HookState(algorithm="auto")``), ``all_reduce(t,
algorithm="auto")`` and the benchmark all ask an :class:`AutoSelector`. It lives in the
runtime, below the hooks, because choosing needs only the group and the executors.

At registration every rank takes part in a short probe: each candidate algorithm all-reduces
a small, a medium and a large buffer a few times, through the same executors the hook uses
(``native``, the group's own ``all_reduce``, is a candidate by default, so ``auto`` is never
predicted slower than what DDP would run without a hook; ``candidates=`` can leave it out).
Rank 0 fits α and β *per algorithm* to its timings (:func:`~ddp_ring_hooks.cost_model.fit`)
and broadcasts them, so every rank holds the same numbers and, for a bucket of a given size,
computes the same choice (ranks that disagreed on the schedule would deadlock)::

    probe (all ranks) ─▶ fit per algorithm ─▶ broadcast from ─▶ per bucket size n:
    candidates x sizes    on rank 0            rank 0            argmin_a  α_a·A_a(n) + β_a·B_a(n)

Why per algorithm: the textbook model prices every step the same, but real steps are not
equal. On a host with fewer cores than ranks, a ring step needs every rank awake at once
while a tree step needs two, and a step of the executor pays Python and batching overheads
the formula knows nothing about. Fitting α, β per algorithm keeps each formula's shape (how
time grows with ``n``) and lets the measurement set the constants.

``native`` has no schedule and no formula of its own (NCCL and gloo pick their algorithm
inside): its registry record prices it with the ring's shape (``priced_as="ring"``; both
libraries run rings for the bandwidth-bound sizes) and its own fitted α, β, which carry the difference.

Small buckets go to the latency-lean algorithms, large ones to the bandwidth-optimal ones.
Each distinct bucket size is decided once, cached, and logged on the ``ddp_ring_hooks.auto``
logger with the winner's margin over the runner-up. Ties go to the candidate listed first
(the schedules in ``ALGORITHMS`` order, then ``native``).
"""

from __future__ import annotations

import copy
import logging
import statistics
import threading
import weakref
from collections.abc import Mapping

import torch
import torch.distributed as dist

from ..cost_model import Calibration, fit
from ..schedules import checked_schedule, formula_for, get_algorithm, resolve_options
from ..schedules.hierarchical import resolve_local_size
from .collectives import all_gather_ints, device_of, time_calls
from .compat import broadcast_from_first
from .executor import run_schedule
from .names import AUTO, NATIVE, has_schedule, runnable_algorithms
from .native import run_native

__all__ = ["AUTO", "NATIVE", "AutoSelector", "agreed_local_size", "calibrate", "default_candidates", "selector_for"]


#: Bytes per rank of the probe's all-reduces: latency-bound, middle, bandwidth-bound.
PROBE_SIZES = (1024, 128 * 1024, 2 * 1024 * 1024)
#: Calls timed back to back in one probe block (see :func:`_time_all_reduce`).
CALLS_PER_BLOCK = 3

logger = logging.getLogger("ddp_ring_hooks.auto")


def calibrate(
    group: dist.ProcessGroup | None = None,
    *,
    candidates: tuple[str, ...] = ("ring",),
    options: Mapping[str, Mapping] | None = None,
    sizes: tuple[int, ...] = PROBE_SIZES,
    repeats: int = 3,
    device: torch.device | str | None = None,
) -> dict[str, Calibration]:
    """Time all-reduces of each candidate at ``sizes`` bytes on ``group``; fit α, β per candidate.

    Collective: every rank of ``group`` must call it with the same arguments. Rank 0's fits
    are broadcast, so every rank returns the same numbers. ``options[algorithm]`` are the
    schedule options of that algorithm (``segments``, ``local_size``). ``device``: where the
    probe's buffers live (the model's device; see :func:`~.collectives.device_of`).
    """
    world_size = dist.get_world_size(group)
    options = options or {}
    if world_size == 1:
        return {a: Calibration(0.0, 0.0) for a in candidates}
    device = device_of(group, device)
    fitted = []
    for algorithm in candidates:
        samples = [(nbytes, _time_all_reduce(algorithm, options.get(algorithm, {}), nbytes, group, device, repeats)) for nbytes in sizes]
        mine = fit(samples, algorithm=formula_for(algorithm), world_size=world_size, **options.get(algorithm, {}))
        fitted += [mine.alpha, mine.beta]
    agreed = torch.tensor(fitted, dtype=torch.float64, device=device)
    broadcast_from_first(agreed, group=group)
    values = agreed.tolist()
    return {a: Calibration(values[2 * i], values[2 * i + 1]) for i, a in enumerate(candidates)}


def _time_all_reduce(algorithm: str, options: Mapping, nbytes: int, group, device: torch.device, repeats: int) -> float:
    """Seconds per all-reduce of ``nbytes``, measured the way the benchmark measures it.

    After one warm-up, ``repeats`` blocks of :data:`CALLS_PER_BLOCK` calls, each block started
    by a barrier; a block counts for its slowest rank (an all-reduce is over when the last
    rank is done), and the median block is the answer. Timing rank 0 alone would reward
    algorithms that finish early on rank 0 and make the choice disagree with the benchmark.
    """
    buffer = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    if has_schedule(algorithm):
        schedule = checked_schedule(algorithm, dist.get_world_size(group), **options)
        call = lambda: run_schedule(schedule, buffer, group=group)  # noqa: E731
    else:
        call = lambda: run_native(buffer, group=group).wait()  # noqa: E731
    blocks = [
        time_calls(call, device, warmup=1 if block == 0 else 0, iters=CALLS_PER_BLOCK, group=group)
        for block in range(repeats)
    ]
    return statistics.median(blocks)


class AutoSelector:
    """Chooses, per bucket size, the algorithm with the least predicted time.

    Args:
        calibration: α, β (and γ) to predict with, one :class:`Calibration` shared by all
            algorithms or one per algorithm (as :func:`calibrate` returns); the same on
            every rank.
        world_size: ranks in the group.
        local_size: ranks per node for ``hierarchical`` (default ``LOCAL_WORLD_SIZE``); without
            one that makes more than one node of more than one rank, hierarchical is not a
            candidate.
        segments: the tree's pipeline depth.
        candidates: the algorithms to choose from (default: all that apply, ``native`` included).

    Example::

        >>> selector = AutoSelector(Calibration(alpha=50e-6, beta=1e-9), world_size=8)
        >>> selector.choose(4096)
        ('halving_doubling', {})
    """

    def __init__(
        self,
        calibration: Calibration | Mapping[str, Calibration],
        world_size: int,
        *,
        local_size: int | None = None,
        segments: int = 1,
        candidates: tuple[str, ...] | None = None,
    ) -> None:
        self.world_size = world_size
        self.candidates = tuple(candidates) if candidates is not None else default_candidates(world_size, local_size)
        self.options = schedule_options(world_size, self.candidates, local_size=local_size, segments=segments)
        if isinstance(calibration, Calibration):
            calibration = {a: calibration for a in self.candidates}
        missing = [a for a in self.candidates if a not in calibration]
        if missing:
            raise ValueError(f"auto has no calibration for {', '.join(missing)}; calibrate every candidate")
        self.calibration = dict(calibration)
        self._choices: dict[int, str] = {}

    @classmethod
    def probed(
        cls,
        group: dist.ProcessGroup | None = None,
        *,
        calibration: Calibration | Mapping[str, Calibration] | None = None,
        local_size: int | None = None,
        segments: int = 1,
        candidates: tuple[str, ...] | None = None,
        device: torch.device | str | None = None,
    ) -> AutoSelector:
        """Calibrate every candidate on ``group`` (collective) unless ``calibration`` is given.
        ``device``: the model's device, where the probe runs (default: see
        :func:`~.collectives.device_of`)."""
        world_size = dist.get_world_size(group)
        if calibration is None:
            # The probe runs every candidate on every rank: the ranks must agree on them first.
            local_size = agreed_local_size(group, local_size, device=device)
            if candidates is None:
                candidates = _candidates_for(world_size, local_size)
            elif "hierarchical" in candidates and local_size is None:
                raise ValueError(
                    "auto: hierarchical is a candidate but the ranks do not agree on the number of "
                    "ranks per node (LOCAL_WORLD_SIZE differs between nodes or is missing); pass "
                    "local_size=G, the same on every rank, or leave hierarchical out of candidates"
                )
            options = schedule_options(world_size, candidates, local_size=local_size, segments=segments)
            calibration = calibrate(group, candidates=candidates, options=options, device=device)
            for algorithm, fitted in calibration.items():
                logger.info("auto: %s calibrated to alpha=%.1f us, beta=%.3f ns/B", algorithm, fitted.alpha * 1e6, fitted.beta * 1e9)
        return cls(calibration, world_size, local_size=local_size, segments=segments, candidates=candidates)

    def recalibrated(self, calibration: Mapping[str, Calibration]) -> AutoSelector:
        """This selector with another calibration (one per candidate), e.g. one restored from a
        checkpoint: the same candidates and options, choices made afresh."""
        selector = copy.copy(self)
        selector.calibration = {a: calibration[a] for a in self.candidates}
        selector._choices = {}
        return selector

    def predictions(self, nbytes: int) -> dict[str, float]:
        """Predicted seconds of every candidate for a bucket of ``nbytes``."""
        return {
            a: self.calibration[a].predict(formula_for(a), nbytes, self.world_size, **self.options.get(a, {}))
            for a in self.candidates
        }

    def choose(self, nbytes: int) -> tuple[str, dict[str, int]]:
        """``(algorithm, schedule options)`` for a bucket of ``nbytes``; decided once per size."""
        if nbytes not in self._choices:
            predicted = self.predictions(nbytes)
            best = min(predicted.values())
            # A relative tolerance so that equal formulas (ring and halving-doubling on 2 ranks) tie.
            chosen = next(a for a in self.candidates if predicted[a] <= best * (1 + 1e-9))
            self._choices[nbytes] = chosen
            logger.info(
                "auto: %d-byte bucket on %d ranks -> %s (predicted %s)%s", nbytes, self.world_size, chosen,
                ", ".join(f"{a} {t * 1e6:.0f} us" for a, t in sorted(predicted.items(), key=lambda item: item[1])),
                _margin(chosen, predicted),
            )
        chosen = self._choices[nbytes]
        return chosen, dict(self.options.get(chosen, {}))


def _margin(chosen: str, predicted: Mapping[str, float]) -> str:
    """``"; ring wins by 1.23x over native"``: the winner against the runner-up."""
    others = sorted((t, a) for a, t in predicted.items() if a != chosen)
    if not others:
        return ""
    runner_time, runner = others[0]
    ratio = runner_time / predicted[chosen] if predicted[chosen] > 0 else float("inf")
    return f"; {chosen} wins by {ratio:.2f}x over {runner}"


def default_candidates(world_size: int, local_size: int | None = None) -> tuple[str, ...]:
    """Every algorithm, ``native`` last; hierarchical only when ``local_size`` (or
    ``LOCAL_WORLD_SIZE``) makes more than one node of more than one rank (otherwise it is
    just a slower ring)."""
    return _candidates_for(world_size, _resolved_or_none(world_size, local_size))


def _candidates_for(world_size: int, ranks_per_node: int | None) -> tuple[str, ...]:
    return tuple(a for a in runnable_algorithms() if get_algorithm(a).applies(world_size, ranks_per_node))


def _resolved_or_none(world_size: int, local_size: int | None) -> int | None:
    try:
        return resolve_local_size(world_size, local_size)
    except ValueError:
        return None


def agreed_local_size(
    group: dist.ProcessGroup | None, local_size: int | None, *, device: torch.device | str | None = None
) -> int | None:
    """The ranks per node (``local_size``, else ``LOCAL_WORLD_SIZE``) if every rank of ``group``
    resolves the same valid number, else ``None``. Collective: one small all-gather.

    Nodes that run different numbers of ranks (torchrun sets ``LOCAL_WORLD_SIZE`` per node) would
    otherwise give ranks different candidate lists, and a probe in which ranks run different
    schedules deadlocks.
    """
    world_size = dist.get_world_size(group)
    mine = _resolved_or_none(world_size, local_size)
    sizes = {size for (size,) in all_gather_ints([mine or 0], group, device=device)}
    if len(sizes) > 1:
        logger.warning(
            "auto: the ranks disagree on the number of ranks per node (%s; 0: none or invalid), "
            "so hierarchical is not a candidate", ", ".join(str(size) for size in sorted(sizes)),
        )
        return None
    return mine


def schedule_options(
    world_size: int, candidates: tuple[str, ...], *, local_size: int | None, segments: int
) -> dict[str, dict[str, int]]:
    """The schedule options each candidate runs with; checks the candidates' names."""
    known = runnable_algorithms()
    unknown = [a for a in candidates if a not in known]
    if unknown or not candidates:
        raise ValueError(f"auto candidates must be some of {', '.join(known)}; got {candidates}")
    given = {"segments": segments, "local_size": local_size}
    return {
        a: resolve_options(a, {name: given[name] for name in get_algorithm(a).option_names if given.get(name) is not None})
        for a in candidates
    }


_SELECTORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SELECTORS_LOCK = threading.Lock()


def selector_for(group: dist.ProcessGroup | None = None, *, device: torch.device | str | None = None, **options) -> AutoSelector:
    """The :class:`AutoSelector` of ``group`` for these ``options`` (``candidates``,
    ``local_size``, ``segments``, ``calibration``), probed on the first call and kept.

    Collective on the first call with given options (every rank of ``group`` must make it,
    as every rank calls a collective): what ``all_reduce(t, algorithm="auto")`` and the
    benchmark use, so they choose exactly as the hook does."""
    group = group if group is not None else dist.group.WORLD
    key = tuple(sorted((name, repr(value)) for name, value in options.items()))
    with _SELECTORS_LOCK:
        known = _SELECTORS.setdefault(group, {})
        selector = known.get(key)
    if selector is None:
        selector = AutoSelector.probed(group, device=device, **options)
        with _SELECTORS_LOCK:
            known[key] = selector
    return selector
