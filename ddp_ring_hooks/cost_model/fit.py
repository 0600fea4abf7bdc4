"""Calibrate α and β from measured times, by weighted least squares.

Every formula in :mod:`.formulas` is linear in its parameters: ``T = α·A + β·B`` where ``A``
and ``B`` depend only on the algorithm, ``n`` and ``p``. So a set of measured
``(algorithm, p, n, T)`` gives an ordinary linear least-squares problem. γ is not fitted: in
every flat formula but the double binary tree's the γ coefficient is exactly half the β one
(a rank adds half the bytes it moves), so no measurement can tell them apart; the fitted β is
``β + γ/2``, which predicts the same times. (The double binary tree adds in its reduce, which
takes up to twice the steps of its broadcast: its fitted β stands for ``β`` plus ``γ/2`` with
many segments to ``2γ/3`` with one.)

Residuals are weighted by ``1/T`` (relative error): a 10 µs and a 100 ms measurement count
the same, which is what "predicted within 25%" means; unweighted, the largest buffers would
decide alone. A parameter that comes out negative is fixed at 0 and the other refitted.

Two ways in:

- :func:`fit` takes ``(nbytes, seconds)`` pairs of one kind of measurement: point-to-point
  one-way messages (``T = α + nβ``, the default) or all-reduces of one ``algorithm`` on
  ``world_size`` ranks: "per algorithm" parameters.
- :func:`fit_records` takes benchmark records of several algorithms and fits one shared set
  of parameters: one description of the machine for all of them.
- :func:`fit_per_algorithm` fits each algorithm's records on their own (what ``auto`` does
  with its probe, see :mod:`ddp_ring_hooks.runtime.selection`).
- :func:`fit_probe` takes the advisor's probe (:class:`ProbeSample` s: sizes timed in blocks,
  on two wire dtypes) and fits α, β and γ together, with the blocks' spread as its error bar
  (:class:`ProbeFit`). γ can be told apart there: an fp32 and a bf16 wire move and cast in
  other proportions (bf16: half the bytes, two casts per byte more).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..schedules import ALGORITHMS, with_wire
from .formulas import Links, coefficients, cost_terms

#: What a fit returns: the network's one value (:class:`~.formulas.Links`: α, β and γ), by the
#: name its callers know it by (``auto``'s probe, a checkpoint, the advisor).
Calibration = Links


def fit(
    samples: Iterable[Sequence[float]],
    *,
    algorithm: str | None = None,
    world_size: int = 2,
    **options,
) -> Calibration:
    """Fit α, β from ``(nbytes, seconds)`` pairs: one-way messages, or all-reduces of ``algorithm``.

    ``options`` are the algorithm's (``segments``, ``local_size``, ...).

    Example::

        >>> fit([(0, 20e-6), (1 << 20, 520e-6)])           # one-way messages
        Links(alpha=2.0...e-05, beta=4.76...e-10, gamma=0.0, local=None, per_call=0.0)
    """
    if algorithm is None:
        rows = [((1.0, float(n)), float(t)) for n, t in samples]
    else:
        rows = [(_terms(algorithm, n, world_size, options), float(t)) for n, t in samples]
    return _solve(rows)


def fit_records(records: Iterable[Mapping], **options) -> Calibration:
    """One shared α, β from benchmark records of several algorithms and world sizes.

    Each record has ``algorithm``, ``world_size``, ``nbytes`` and ``time_us`` (the keys of
    ``ddp-ring-hooks bench --json``); records of algorithms without a formula (``native``)
    are skipped.
    """
    rows = [
        (_terms(r["algorithm"], r["nbytes"], r["world_size"], options), r["time_us"] * 1e-6)
        for r in records
        if r["algorithm"] in ALGORITHMS
    ]
    return _solve(rows)


def fit_per_algorithm(records: Iterable[Mapping], **options) -> dict[str, Calibration]:
    """α, β for each algorithm (and world size) of benchmark records: ``{algorithm: Calibration}``.

    Each algorithm keeps its formula's shape but gets its own constants, which absorb what the
    textbook model leaves out (per-step overheads, how many ranks must be awake per step).
    Records need the keys of :func:`fit_records`; a world size other than the first one seen
    is an error (fit one world size at a time). ``options`` are per algorithm:
    ``{"tree": {"segments": 2}}``.
    """
    by_algorithm: dict[str, list[tuple[float, float]]] = {}
    world_sizes = set()
    for r in records:
        if r["algorithm"] in ALGORITHMS:
            by_algorithm.setdefault(r["algorithm"], []).append((r["nbytes"], r["time_us"] * 1e-6))
            world_sizes.add(r["world_size"])
    if len(world_sizes) > 1:
        raise ValueError(f"records span world sizes {sorted(world_sizes)}; fit one world size at a time")
    (world_size,) = world_sizes or {1}
    return {
        algorithm: fit(samples, algorithm=algorithm, world_size=world_size, **options.get(algorithm, {}))
        for algorithm, samples in by_algorithm.items()
    }


def _terms(algorithm: str, nbytes: float, world_size: int, options: Mapping) -> tuple[float, float]:
    """The coefficients ``(A, B)`` of α and β in the algorithm's formula."""
    messages, bytes_per_byte, _ = coefficients(algorithm, world_size, nbytes=nbytes, **options)
    return messages, bytes_per_byte * nbytes


def _solve(rows: list[tuple[tuple[float, float], float]]) -> Calibration:
    if any(t <= 0 for _, t in rows):
        raise ValueError("every measured time must be positive")
    if len({terms for terms, _ in rows}) < 2:
        raise ValueError(f"need measurements at 2 or more different sizes to fit alpha and beta; got {len(rows)} sample(s)")
    alpha, beta = _nonnegative_least_squares(rows)
    return Calibration(alpha, beta)


def _nonnegative_least_squares(rows) -> tuple[float, ...]:
    """Minimize ``Σ ((Σ_j x_j·A_j - t) / t)²`` over ``x >= 0``: the normal equations, solved
    directly. A parameter that comes out negative has no meaning (noise, or times that do not
    grow with what it multiplies): the last such one is fixed at 0 and the rest refitted."""
    count = len(rows[0][0])
    free = list(range(count))
    while free:
        values = _weighted_least_squares([([terms[j] for j in free], t) for terms, t in rows])
        negative = [j for j, x in zip(free, values) if x < 0]
        if not negative:
            solution = [0.0] * count
            for j, x in zip(free, values):
                solution[j] = x
            return tuple(solution)
        free.remove(negative[-1])
    return (0.0,) * count


def _weighted_least_squares(rows) -> list[float]:
    """The unconstrained minimum of ``Σ ((Σ_j x_j·A_j - t) / t)²`` (Gaussian elimination on the
    normal equations, at most a few parameters)."""
    count = len(rows[0][0])
    normal = [[0.0] * (count + 1) for _ in range(count)]
    for terms, t in rows:
        scaled = [a / t for a in terms]
        for i in range(count):
            for j in range(count):
                normal[i][j] += scaled[i] * scaled[j]
            normal[i][count] += scaled[i]
    scale = [normal[i][i] for i in range(count)]
    for column in range(count):
        pivot = max(range(column, count), key=lambda r: abs(normal[r][column]))
        normal[column], normal[pivot] = normal[pivot], normal[column]
        if abs(normal[column][column]) <= 1e-9 * max(scale[column], 1e-300):
            raise ValueError("the measurements cannot separate alpha from beta; measure more different sizes")
        for r in range(count):
            if r != column:
                factor = normal[r][column] / normal[column][column]
                normal[r] = [a - factor * b for a, b in zip(normal[r], normal[column])]
    return [normal[i][count] / normal[i][i] for i in range(count)]


@dataclass(frozen=True)
class ProbeSample:
    """One size of a probe: seconds per all-reduce of ``nbytes`` on ``wire`` (``"fp32"``,
    ``"bf16"``, ...) in each timed block (every block counts for its slowest rank).

    ``algorithm`` (with its ``options``, as ``(name, value)`` pairs) when the block timed
    another schedule than the run's (``""``): the probe's second message count at one size,
    which tells the per-call cost from the per-message one (:func:`fit_probe`)."""

    nbytes: int
    wire: str
    seconds: tuple[float, ...]
    algorithm: str = ""
    options: tuple[tuple[str, object], ...] = ()


@dataclass(frozen=True)
class ProbeFit:
    """α, β, γ fitted to a probe: to every size's lower quartile block (``links``), and, for
    the error bar, to every size's fastest block and its median (``fastest``, ``slowest``).

    A disturbance only ever slows a block (on 2-core loopback a block that waits out another
    thread's time slice takes 2-7 ms where its neighbours take 0.3-0.6), and in a probe at
    ``register`` as many as 7 of 13 blocks of a size were: their median then fitted β = 0
    (bandwidth unbounded). The lower quartile holds until three in four blocks are disturbed;
    the fastest block is the network undisturbed, the median as a block typically finds it."""

    links: Links
    fastest: Links
    slowest: Links
    #: the largest relative residual of the median fit over the sizes (how well the formula fits)
    misfit: float


def fit_probe(samples: Sequence[ProbeSample], *, algorithm: str, world_size: int, **options) -> ProbeFit:
    """Fit ``algorithm``'s formula (``options`` its own; each sample's wire dtype put in) to
    ``samples``: ``t = messages·α + n·(bytes·β + (reduced + cast)·γ)``. With one wire dtype γ
    cannot be told from β (it is fitted as 0, and β holds the additions, as in :func:`fit`).
    Samples of another schedule (``ProbeSample.algorithm``: more messages at the same size) add
    the per-call cost, ``t = per_call + messages·α + ...``: without them a call's own hand-offs
    are spread over its messages (``per_call`` 0), which overprices a schedule of many messages
    in one call (a pipelined tree's 64 against the ring's 2).

        >>> fitted = fit_probe([ProbeSample(0, "fp32", (2e-5,)), ProbeSample(1 << 20, "fp32", (1e-3,))],
        ...                    algorithm="ring", world_size=2)
        >>> round(fitted.links.alpha * 1e6, 6)           # 2 messages of 10 us
        10.0
    """
    samples = [s for s in samples if s.seconds]
    if any(t <= 0 for s in samples for t in s.seconds):
        raise ValueError("every probed time must be positive")
    terms = [_probe_terms(s.algorithm or algorithm, s, world_size, dict(s.options) if s.algorithm else options)
             for s in samples]
    # the columns the samples can tell apart: per call (two message counts at one size), α, β, γ (two wires)
    counts = {(s.nbytes, s.wire, row[1]) for row, s in zip(terms, samples)}
    per_call = len(counts) > len({(s.nbytes, s.wire) for s in samples})
    columns = [0] * per_call + [1, 2] + [3] * (len({s.wire for s in samples}) > 1)
    used = len(columns)

    def fitted(pick) -> tuple[Links, list[float]]:
        rows = [(tuple(row[j] for j in columns), pick(s.seconds)) for row, s in zip(terms, samples)]
        if len({row for row, _ in rows}) < used:
            raise ValueError(f"need probed times at {used} or more different sizes and wires to fit; got {len(rows)}")
        found = dict(zip(columns, _nonnegative_least_squares(rows)))
        links = Links(found[1], found[2], found.get(3, 0.0), per_call=found.get(0, 0.0))
        residuals = [abs(sum(found[j] * a for j, a in zip(columns, row)) / t - 1) for row, t in rows]
        return links, residuals

    links, residuals = fitted(lower_quartile)
    return ProbeFit(links, fitted(min)[0], fitted(statistics.median)[0], max(residuals))


def lower_quartile(seconds: Sequence[float]) -> float:
    """The lower quartile of a size's blocks (inclusive: with three, halfway from the fastest
    to the median; one block is its own): what the probe's network is fitted to (:class:`ProbeFit`)."""
    return statistics.quantiles(seconds, n=4, method="inclusive")[0] if len(seconds) > 1 else seconds[0]


def _probe_terms(algorithm: str, sample: ProbeSample, world_size: int,
                 options: Mapping) -> tuple[float, float, float, float]:
    """The coefficients of the per-call cost, α, β and γ for one probed size (see :func:`fit_probe`)."""
    t = cost_terms(algorithm, world_size, nbytes=sample.nbytes, **with_wire(options, sample.wire))
    n = float(sample.nbytes)
    return (1.0, t.messages + t.local_messages, n * (t.bytes + t.local_bytes), n * (t.reduced + t.cast))
