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

Options: ``auto``'s own (:data:`AUTO_OPTIONS`, records like an algorithm's) and every option of
a registered algorithm, which goes to the candidates that declare it; names, defaults and
checks all come from the registry. Before the probe the ranks all-gather a checksum of every
algorithm's resolved options, and one they resolve differently (``LOCAL_WORLD_SIZE`` differing
between nodes) is left out of the default candidates, on every rank alike.

``auto`` never picks compression by itself: compression changes the numbers, so the wire dtype
is the user's choice (``wire_dtype=``, an option every algorithm declares). Given, it goes to
every candidate like any shared option, the probe times the candidates on that wire (the casts
included) and the formulas price its bytes (``cost_model.on_the_wire``); not given, every
candidate sends the bucket as it is.

Small buckets go to the latency-lean algorithms, large ones to the bandwidth-optimal ones.
Each distinct bucket size is decided once, cached, and logged on the ``ddp_ring_hooks.auto``
logger with the winner's margin over the runner-up. Ties go to the candidate listed first
(the schedules in ``ALGORITHMS`` order, then ``native``).
"""

from __future__ import annotations

import copy
import difflib
import logging
import statistics
import zlib
from collections.abc import Mapping

import torch
import torch.distributed as dist

from ..cost_model import Calibration, TwoTier, fit
from ..schedules import (
    Option, check_given_options, checked_schedule, formula_for, get_algorithm, options_by_name, options_for,
    resolve_options,
)
from .collectives import all_gather_ints, device_of, time_calls
from .compat import broadcast_from_first
from .executor import run_schedule
from .group_context import context_of
from .names import AUTO, NATIVE, has_schedule, runnable_algorithms
from .native import run_native
from .ring_orders import settle_ring_order
from .wire import wire_dtype_for

__all__ = [
    "AUTO", "AUTO_OPTIONS", "NATIVE", "AutoSelector", "agreed_option_sets", "auto_option_names", "calibrate",
    "candidate_option_sets", "default_candidates", "selector_for",
]


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
    """Seconds per all-reduce of ``nbytes``, measured the way the benchmark measures it: the
    median of :func:`time_all_reduce_blocks`."""
    return statistics.median(time_all_reduce_blocks(algorithm, options, nbytes, group, device, repeats))


def time_all_reduce_blocks(
    algorithm: str, options: Mapping, nbytes: int, group, device: torch.device, repeats: int,
    *, calls: int = CALLS_PER_BLOCK, budget_s: float = 0.0, most: int | None = None,
) -> list[float]:
    """Seconds per all-reduce of ``nbytes`` in each of ``repeats`` blocks, through the executors
    the hook uses, on the wire the options name (the casts are timed too). Collective; every
    rank returns the same numbers.

    After one warm-up, ``repeats`` blocks of ``calls`` calls, each block started by a barrier;
    a block counts for its slowest rank (an all-reduce is over when the last rank is done).
    Timing rank 0 alone would reward algorithms that finish early on rank 0 and make the
    choice disagree with the benchmark. Then, with a ``budget_s``, more blocks while those so
    far took less than it in all, up to ``most``: a quick size gets enough blocks that a few
    preempted ones cannot move its lower quartile, a slow one (a shaped link) only ``repeats``. Every
    rank holds the same block times, so every rank decides alike. (Also the advisor's probe:
    :mod:`~ddp_ring_hooks.runtime.network_probe`.)
    """
    buffer = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    if has_schedule(algorithm):
        schedule = checked_schedule(algorithm, dist.get_world_size(group), nbytes=nbytes, **options)
        call = lambda: run_schedule(schedule, buffer, group=group)  # noqa: E731
    else:
        wire = wire_dtype_for(buffer.dtype, resolve_options(algorithm, options))
        call = lambda: run_native(buffer, group=group, wire=wire).wait()  # noqa: E731
    blocks: list[float] = []
    while len(blocks) < repeats or (len(blocks) < (most or repeats) and sum(blocks) * calls < budget_s):
        blocks.append(time_calls(call, device, warmup=0 if blocks else 1, iters=calls, group=group))
    return blocks


def _calibration_check(value: object) -> str | None:
    if value is None or isinstance(value, Calibration):
        return None
    if isinstance(value, Mapping) and all(isinstance(c, Calibration) for c in value.values()):
        return None
    return "must be a Calibration, or a mapping from algorithm name to Calibration"


def _network_check(value: object) -> str | None:
    return None if value is None or isinstance(value, TwoTier) else "must be a ddp_ring_hooks.cost_model.TwoTier"


def _candidates_check(value: object) -> str | None:
    known = runnable_algorithms()
    if value is None or (isinstance(value, (tuple, list)) and value and all(a in known for a in value)):
        return None
    return f"must be some of {', '.join(known)}"


#: ``auto``'s own options, declared as an algorithm declares its (see the registry's ``Option``).
#: Every option of a registered algorithm is ``auto``'s too: it goes to the candidates that
#: declare it (``segments=4``: the tree candidate pipelines in 4 segments).
AUTO_OPTIONS: tuple[Option, ...] = (
    Option("calibration", None, "α, β to predict with, one Calibration for every candidate or one per "
           "candidate (default: probe the group)", check=_calibration_check),
    Option("candidates", None, "the algorithms to choose from (default: every one that applies, native included)",
           check=_candidates_check),
    Option("network", None, "a two-tier network (cost_model.TwoTier: each node's uplink, the links inside a node, "
           "which rank is where) to price the candidates on, instead of probing the group", check=_network_check),
)


def auto_option_names() -> tuple[str, ...]:
    """Every option ``algorithm="auto"`` takes: its own (:data:`AUTO_OPTIONS`), then every
    registered algorithm's, for the candidates."""
    return (*(option.name for option in AUTO_OPTIONS), *options_by_name())


class AutoSelector:
    """Chooses, per bucket size, the algorithm with the least predicted time.

    Args:
        calibration: α, β (and γ) to predict with, one :class:`Calibration` shared by all
            algorithms or one per algorithm (as :func:`calibrate` returns); the same on
            every rank. ``None`` with ``network``.
        world_size: ranks in the group.
        candidates: the algorithms to choose from (default: all that apply, ``native`` included).
        network: a :class:`~ddp_ring_hooks.cost_model.TwoTier` network to price every candidate
            on instead (each node's ranks share its uplink: the ring's crossings, the
            hierarchy's shard, the trees' fan-out through one uplink all count).
        **candidate_options: options of the candidates, each passed to the candidates that
            declare it (``local_size=`` for ``hierarchical``, default ``LOCAL_WORLD_SIZE``;
            ``segments=`` for ``tree``). A default candidate must resolve its options and
            apply to them (hierarchical: more than one node of more than one rank).

    Example::

        >>> selector = AutoSelector(Calibration(alpha=50e-6, beta=1e-9), world_size=8)
        >>> selector.choose(4096)
        ('halving_doubling', {})
        >>> lab = TwoTier(Links(200e-6, 1 / 50e6, local=Links(50e-6, 1 / 1e9)), ranks_per_node=2)
        >>> AutoSelector(None, 4, network=lab, local_size=2).choose(16 << 20)[0]
        'hierarchical'
    """

    def __init__(
        self,
        calibration: Calibration | Mapping[str, Calibration] | None,
        world_size: int,
        *,
        candidates: tuple[str, ...] | None = None,
        network: TwoTier | None = None,
        **candidate_options,
    ) -> None:
        _check_auto_options(calibration=calibration, candidates=candidates, network=network, **candidate_options)
        self.world_size = world_size
        self.network = network
        if candidates is None:
            candidates = default_candidates(world_size, **candidate_options)
            candidate_options = _taken_by(candidates, candidate_options)
        self.candidates = tuple(candidates)
        self.options = _options_of(self.candidates, candidate_options)
        if network is not None:
            network.nodes(world_size)  # a network of another shape is refused here, not per bucket
            calibration = calibration or {}
        elif calibration is None:
            raise ValueError("auto needs a calibration (or network=TwoTier(...)) to predict with")
        if isinstance(calibration, Calibration):
            calibration = {a: calibration for a in self.candidates}
        missing = [] if network is not None else [a for a in self.candidates if a not in calibration]
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
        candidates: tuple[str, ...] | None = None,
        network: TwoTier | None = None,
        device: torch.device | str | None = None,
        **candidate_options,
    ) -> AutoSelector:
        """Calibrate every candidate on ``group`` (collective) unless ``calibration`` or
        ``network`` is given. ``device``: the model's device, where the probe runs (default: see
        :func:`~.collectives.device_of`)."""
        _check_auto_options(calibration=calibration, candidates=candidates, network=network, **candidate_options)
        world_size = dist.get_world_size(group)
        candidate_options = settle_ring_order(candidate_options, group)  # one probe for every candidate
        if calibration is None and network is None:
            # The probe runs every candidate on every rank: the ranks must agree on them first.
            agreed = agreed_option_sets(group, candidate_options, device=device)
            if candidates is None:
                candidates = _applying(world_size, agreed)
                candidate_options = _taken_by(candidates, candidate_options)
            options = _options_of(candidates, candidate_options)  # this rank's; each refusal is the same on every rank
            disagreeing = [a for a in candidates if agreed[a] is None]
            if disagreeing:
                raise ValueError(_disagreement(disagreeing[0]))
            calibration = calibrate(group, candidates=candidates, options=options, device=device)
            for algorithm, fitted in calibration.items():
                logger.info("auto: %s calibrated to alpha=%.1f us, beta=%.3f ns/B", algorithm, fitted.alpha * 1e6, fitted.beta * 1e9)
        return cls(calibration, world_size, candidates=candidates, network=network, **candidate_options)

    def recalibrated(self, calibration: Mapping[str, Calibration]) -> AutoSelector:
        """This selector with another calibration (one per candidate), e.g. one restored from a
        checkpoint: the same candidates and options, choices made afresh. A selector that
        prices on a ``network`` has no calibration to restore: it is returned as it is."""
        if self.network is not None:
            return self
        selector = copy.copy(self)
        selector.calibration = {a: calibration[a] for a in self.candidates}
        selector._choices = {}
        return selector

    def predictions(self, nbytes: int) -> dict[str, float]:
        """Predicted seconds of every candidate for a bucket of ``nbytes``."""
        if self.network is not None:
            return {
                a: self.network.predict(a, nbytes, self.world_size, **self.options.get(a, {})) for a in self.candidates
            }
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


def default_candidates(world_size: int, **candidate_options) -> tuple[str, ...]:
    """Every algorithm whose options resolve here (given, from the environment, or defaults) and
    that applies to them, ``native`` last: hierarchical only when ``local_size`` (or
    ``LOCAL_WORLD_SIZE``) makes more than one node of more than one rank (otherwise it is just a
    slower ring)."""
    return _applying(world_size, candidate_option_sets(world_size, candidate_options))


def candidate_option_sets(world_size: int, candidate_options: Mapping[str, object]) -> dict[str, dict | None]:
    """Every runnable algorithm's resolved options on this rank, from ``candidate_options``, the
    environment and the defaults; ``None`` where they do not resolve (a node size neither given
    nor in ``LOCAL_WORLD_SIZE``). Not collective: see :func:`agreed_option_sets`."""
    check_given_options(candidate_options)
    found: dict[str, dict | None] = {}
    for algorithm in runnable_algorithms():
        try:
            found[algorithm] = resolve_options(algorithm, options_for(algorithm, candidate_options))
        except ValueError:
            found[algorithm] = None
    return found


def agreed_option_sets(
    group: dist.ProcessGroup | None, candidate_options: Mapping[str, object], *, device: torch.device | str | None = None
) -> dict[str, dict | None]:
    """:func:`candidate_option_sets`, with ``None`` also where the ranks of ``group`` do not all
    resolve the same options. Collective: one small all-gather (a checksum per algorithm).

    Nodes that run different numbers of ranks (torchrun sets ``LOCAL_WORLD_SIZE`` per node) would
    otherwise give ranks different candidate lists, and a probe in which ranks run different
    schedules deadlocks.
    """
    mine = candidate_option_sets(dist.get_world_size(group), candidate_options)
    checksums = [_checksum(options) for options in mine.values()]
    table = all_gather_ints(checksums, group, device=device)
    agreed = {}
    for column, (algorithm, options) in enumerate(mine.items()):
        if len({row[column] for row in table}) > 1:
            logger.warning(
                "auto: the ranks do not agree on the options of %s (here: %s), so it is not a candidate",
                algorithm, "none resolve" if options is None else ", ".join(f"{k}={v!r}" for k, v in options.items()),
            )
            options = None
        agreed[algorithm] = options
    return agreed


def _checksum(options: dict | None) -> int:
    """The same number on every rank that resolved the same options (``-1``: none resolved)."""
    return -1 if options is None else zlib.crc32(repr(sorted(options.items())).encode())


def _applying(world_size: int, option_sets: Mapping[str, dict | None]) -> tuple[str, ...]:
    return tuple(
        a for a, options in option_sets.items() if options is not None and get_algorithm(a).applies(world_size, options)
    )


def _taken_by(candidates: tuple[str, ...], candidate_options: Mapping[str, object]) -> dict[str, object]:
    """The options some candidate takes. For default candidates the rest were weighed and not
    needed (``local_size`` on one node: hierarchical does not apply); they are not an error."""
    return {name: value for name, value in candidate_options.items() if any(name in get_algorithm(a).option_names for a in candidates)}


def _options_of(candidates: tuple[str, ...], candidate_options: Mapping[str, object]) -> dict[str, dict]:
    """The options each candidate runs with; an option that none of them takes is refused (with
    candidates given by the caller, it would be silently dropped)."""
    unused = sorted(set(candidate_options) - set(_taken_by(candidates, candidate_options)))
    if unused:
        raise TypeError(
            f"auto: {', '.join(unused)} {'is an option' if len(unused) == 1 else 'are options'} of none of the "
            f"candidates {', '.join(candidates)}; drop {'it' if len(unused) == 1 else 'them'} or add a candidate that takes "
            f"{'it' if len(unused) == 1 else 'them'}"
        )
    return {a: resolve_options(a, options_for(a, candidate_options)) for a in candidates}


def _check_auto_options(**options) -> None:
    """``auto``'s options: an unknown name is a ``TypeError`` naming them all, a bad value of its
    own a ``ValueError`` with the option's message; the candidates' options are the registry's."""
    unknown = sorted(set(options) - set(auto_option_names()))
    if unknown:
        close = difflib.get_close_matches(unknown[0], auto_option_names(), n=1)
        raise TypeError(
            f"auto got unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}"
            + (f" (did you mean {close[0]!r}?)" if close else "") + f"; it takes {', '.join(auto_option_names())}"
        )
    for option in AUTO_OPTIONS:
        problem = option.check(options.get(option.name))
        if problem:
            raise ValueError(f"auto: {option.name}={options[option.name]!r} {problem}")


def _disagreement(algorithm: str) -> str:
    """Why a requested candidate cannot be probed: the ranks resolve its options differently."""
    record = get_algorithm(algorithm)
    sources = [f"{o.name} from {o.environment}, which differs between nodes" for o in record.options if o.environment]
    # The options read from the environment are the ones that can differ; name those to pass.
    to_pass = [o for o in record.options if o.environment] or list(record.options)
    return (
        f"auto: {algorithm} is a candidate but the ranks do not agree on its options"
        + (f" ({'; '.join(sources)})" if sources else "")
        + f"; pass {', '.join(f'{o.name}={o.metavar}' for o in to_pass)}, the same on every rank, "
        f"or leave {algorithm} out of candidates"
    )


def selector_for(group: dist.ProcessGroup | None = None, *, device: torch.device | str | None = None, **options) -> AutoSelector:
    """The :class:`AutoSelector` of ``group`` for these ``options`` (``candidates``,
    ``local_size``, ``segments``, ``calibration``), probed on the first call and kept in the
    group's context.

    Collective on the first call with given options (every rank of ``group`` must make it,
    as every rank calls a collective): what ``all_reduce(t, algorithm="auto")`` and the
    benchmark use, so they choose exactly as the hook does."""
    context = context_of(group)
    key = tuple(sorted((name, repr(value)) for name, value in options.items()))
    with context.lock:
        selector = context.selectors.get(key)
    if selector is None:
        selector = AutoSelector.probed(group, device=device, **options)
        with context.lock:
            context.selectors[key] = selector
    return selector
