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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from ..schedules import ALGORITHMS
from .formulas import Links, coefficients

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
        Links(alpha=2.0...e-05, beta=4.76...e-10, gamma=0.0, local=None)
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
    alpha, beta = _weighted_least_squares(rows)
    # A negative parameter has no meaning (noise, or times that do not grow with size): fix
    # it at 0 and fit the other alone.
    if beta < 0:
        alpha, beta = _one_parameter(rows, 0), 0.0
    elif alpha < 0:
        alpha, beta = 0.0, _one_parameter(rows, 1)
    return Calibration(alpha, beta)


def _weighted_least_squares(rows) -> tuple[float, float]:
    """Minimize ``Σ ((α·A + β·B - t) / t)²``: the 2x2 normal equations, solved directly."""
    saa = sab = sbb = sa = sb = 0.0
    for (a, b), t in rows:
        a, b = a / t, b / t
        saa, sab, sbb, sa, sb = saa + a * a, sab + a * b, sbb + b * b, sa + a, sb + b
    determinant = saa * sbb - sab * sab
    if determinant <= 1e-12 * saa * sbb:
        raise ValueError("the measurements cannot separate alpha from beta; measure more different sizes")
    return (sa * sbb - sb * sab) / determinant, (saa * sb - sab * sa) / determinant


def _one_parameter(rows, index: int) -> float:
    """The weighted least-squares value of one parameter when the other is 0."""
    scaled = [terms[index] / t for terms, t in rows]
    return sum(scaled) / sum(x * x for x in scaled)
