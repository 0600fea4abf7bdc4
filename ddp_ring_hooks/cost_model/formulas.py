"""Closed-form all-reduce times in the Hockney α-β-γ model, from each algorithm's cost terms.

Sending a message of ``m`` bytes costs ``α + mβ`` and adding ``m`` received bytes costs
``mγ``; ``n`` is the size of the buffer every rank all-reduces, ``p`` the number of ranks::

    time ──────────────────────────────────────────────────────────▶
    │ α │ mβ ........ │ mγ │   one step: start-up, transfer, reduction

| algorithm          | time                                                                 |
|--------------------|----------------------------------------------------------------------|
| naive              | 2(p-1)(α + nβ) + (p-1)nγ                                              |
| ring               | 2(p-1)α + 2(p-1)/p·nβ + (p-1)/p·nγ                                    |
| tree (k segments)  | 2(L+k-1)(α + nβ/k) + (L+k-1)·nγ/k,  L = ⌈lg p⌉                        |
| double_binary_tree | (U+L+2k-2)(α + nβ/2k) + (U+k-1)·nγ/2k,  U = 2L-2 (+1 for p = 2^L)      |
| halving_doubling   | (2 lg p' + 2f)α + (2(p'-1)/p' + 2f)nβ + ((p'-1)/p' + f)nγ             |
| hierarchical (G)   | 2(G-1)α_l + 2(G-1)/G·nβ_l + 2(N-1)α + 2(N-1)/(NG)·nβ + (p-1)/p·nγ     |

(``p'`` the largest power of two ``<= p``, ``f = 1`` when ``p != p'``; ``N = p / G`` nodes.)
Sources: Thakur, Rabenseifner and Gropp 2005 for ring, tree and halving-doubling; the naive,
double binary tree and hierarchical forms are derived from their schedules. Each formula lives beside its
schedule (``ring_cost`` in ``schedules/ring.py``, ...) as :class:`CostTerms`, reached through
the algorithm registry; this module multiplies them out. Every formula counts each link on
its own (a rank may receive from two peers at once), the same rule as
:func:`~ddp_ring_hooks.cost_model.simulate`, and the tests check each one against the steps
and bytes of the schedule it describes. Links that share a NIC or a node's uplink are
priced by :mod:`.two_tier` and by ``simulate(..., shared_uplinks=True)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ..schedules import CostTerms, get_algorithm, is_narrow, resolve_options, shape_options, wire_ratio
from ..schedules.wire import CAST_PASSES


def cost_terms(algorithm: str, world_size: int, *, nbytes: float = 0, **options) -> CostTerms:
    """The algorithm's :class:`~ddp_ring_hooks.schedules.CostTerms` for ``world_size`` ranks,
    from its registry record (options checked and resolved there; those chosen by size, such
    as hierarchical's ``segments``, for an ``nbytes`` buffer), on the wire the options name
    (:func:`on_the_wire`)."""
    record = get_algorithm(algorithm)
    if record.cost is None:
        raise ValueError(
            f"the {algorithm} algorithm has no cost formula (it is not a schedule of ours); "
            "measure it with `ddp-ring-hooks bench` instead"
        )
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    resolved = resolve_options(algorithm, options, nbytes=int(nbytes))
    return on_the_wire(record.cost(world_size, **shape_options(algorithm, resolved)), resolved)


def on_the_wire(terms: CostTerms, options: Mapping[str, object]) -> CostTerms:
    """``terms`` of an fp32 buffer on the wire dtype resolved ``options`` name: a narrower wire
    (bf16, fp16) moves :func:`~ddp_ring_hooks.schedules.wire_ratio` of the bytes, adds as many
    (received in the wire dtype, added in fp32: the addition's pass is over the same fp32
    chunk), and casts each rank's buffer down and up once (``cast = 2``, priced at γ). With
    ``gamma = 0`` (the default) casts are free, as additions are; a fitted β absorbs them.
    """
    if not is_narrow(options):
        return terms
    ratio = wire_ratio(options)
    return dataclasses.replace(
        terms, bytes=terms.bytes * ratio, local_bytes=terms.local_bytes * ratio, cast=terms.cast + CAST_PASSES,
    )


def predict(
    algorithm: str,
    nbytes: float,
    world_size: int,
    *,
    alpha: float,
    beta: float,
    gamma: float = 0.0,
    local_alpha: float | None = None,
    local_beta: float | None = None,
    **options,
) -> float:
    """Predicted seconds to all-reduce ``nbytes`` per rank over ``world_size`` ranks.

    ``alpha`` is seconds per message, ``beta`` seconds per byte (1 / bandwidth), ``gamma``
    seconds per reduced byte. ``local_alpha``/``local_beta`` price links inside a node
    (hierarchical; default: the global ones). ``options`` are the algorithm's own (e.g.
    ``segments=`` for tree, ``local_size=`` for hierarchical, default ``LOCAL_WORLD_SIZE``).

    Example::

        >>> predict("ring", 1e9, 64, alpha=5e-6, beta=1e-11)   # 1 GB at 100 GB/s
        0.0203...
    """
    terms = cost_terms(algorithm, world_size, nbytes=nbytes, **options)
    return price(terms, nbytes, alpha=alpha, beta=beta, gamma=gamma, local_alpha=local_alpha, local_beta=local_beta)


def price(
    terms: CostTerms,
    nbytes: float,
    *,
    alpha: float,
    beta: float,
    gamma: float = 0.0,
    local_alpha: float | None = None,
    local_beta: float | None = None,
) -> float:
    """Seconds for ``terms`` on an ``nbytes`` buffer: ``messages·α + n·(bytes·β + (reduced + cast)·γ)
    + local_messages·α_l + n·local_bytes·β_l`` (``α_l, β_l`` default to ``α, β``)."""
    if nbytes < 0 or min(alpha, beta, gamma) < 0:
        raise ValueError("nbytes, alpha, beta and gamma must be non-negative")
    n = float(nbytes)
    a_l = alpha if local_alpha is None else local_alpha
    b_l = beta if local_beta is None else local_beta
    return (
        terms.messages * alpha + n * (terms.bytes * beta + (terms.reduced + terms.cast) * gamma)
        + terms.local_messages * a_l + n * terms.local_bytes * b_l
    )


def coefficients(algorithm: str, world_size: int, *, nbytes: float = 0, **options) -> tuple[float, float, float]:
    """``(a, b, c)`` such that :func:`predict` is ``a·α + n·(b·β + c·γ)`` when links inside a
    node cost what links between nodes do: messages on the critical path, and bytes sent and
    bytes added there per byte of the buffer (of an ``nbytes`` buffer, for the options chosen
    by size).

        >>> coefficients("ring", 4)
        (6, 1.5, 0.75)
    """
    terms = cost_terms(algorithm, world_size, nbytes=nbytes, **options)
    return terms.messages + terms.local_messages, terms.bytes + terms.local_bytes, terms.reduced
