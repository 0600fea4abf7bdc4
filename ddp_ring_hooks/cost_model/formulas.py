"""Closed-form all-reduce times in the Hockney α-β-γ model, one formula per algorithm.

Sending a message of ``m`` bytes costs ``α + mβ`` and adding ``m`` received bytes costs
``mγ``; ``n`` is the size of the buffer every rank all-reduces, ``p`` the number of ranks::

    time ──────────────────────────────────────────────────────────▶
    │ α │ mβ ........ │ mγ │   one step: start-up, transfer, reduction

| algorithm          | time                                                                 |
|--------------------|----------------------------------------------------------------------|
| naive              | 2(p-1)(α + nβ) + (p-1)nγ                                              |
| ring               | 2(p-1)α + 2(p-1)/p·nβ + (p-1)/p·nγ                                    |
| tree (k segments)  | 2(L+k-1)(α + nβ/k) + (L+k-1)·nγ/k,  L = ⌈lg p⌉                        |
| halving_doubling   | (2 lg p' + 2f)α + (2(p'-1)/p' + 2f)nβ + ((p'-1)/p' + f)nγ             |
| hierarchical (G)   | 2(G-1)α_l + 2(G-1)/G·nβ_l + 2(N-1)α + 2(N-1)/(NG)·nβ + (p-1)/p·nγ     |

(``p'`` the largest power of two ``<= p``, ``f = 1`` when ``p != p'``; ``N = p / G`` nodes.)
Sources: Thakur, Rabenseifner and Gropp 2005 for ring, tree and halving-doubling; the naive
and hierarchical forms are derived from their schedules. Every formula counts each link on
its own (a rank may receive from two peers at once), the same rule as
:func:`~ddp_ring_hooks.cost_model.simulate`, and the tests check each one against the steps
and bytes of the schedule it describes.
"""

from __future__ import annotations

import math

from ..schedules import ALGORITHMS
from ..schedules.hierarchical import resolve_local_size


def predict(
    algorithm: str,
    nbytes: float,
    world_size: int,
    *,
    alpha: float,
    beta: float,
    gamma: float = 0.0,
    local_size: int | None = None,
    local_alpha: float | None = None,
    local_beta: float | None = None,
    segments: int = 1,
) -> float:
    """Predicted seconds to all-reduce ``nbytes`` per rank over ``world_size`` ranks.

    ``alpha`` is seconds per message, ``beta`` seconds per byte (1 / bandwidth), ``gamma``
    seconds per reduced byte. Hierarchical uses ``local_size`` ranks per node (default:
    ``LOCAL_WORLD_SIZE``) and ``local_alpha``/``local_beta`` inside a node (default: the
    global ones). ``segments`` is the tree's pipeline depth.

    Example::

        >>> predict("ring", 1e9, 64, alpha=5e-6, beta=1e-11)   # 1 GB at 100 GB/s
        0.0203...
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"no cost formula for {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if nbytes < 0 or min(alpha, beta, gamma) < 0:
        raise ValueError("nbytes, alpha, beta and gamma must be non-negative")
    p, n = world_size, float(nbytes)
    if p == 1:
        return 0.0
    if algorithm == "naive":
        return 2 * (p - 1) * (alpha + n * beta) + (p - 1) * n * gamma
    if algorithm == "ring":
        return 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta + (p - 1) / p * n * gamma
    if algorithm == "tree":
        if segments < 1:
            raise ValueError(f"tree needs segments >= 1, got {segments}")
        span = math.ceil(math.log2(p)) + segments - 1
        return 2 * span * (alpha + n / segments * beta) + span * n / segments * gamma
    if algorithm == "halving_doubling":
        pof2 = 1 << (p.bit_length() - 1)
        fold = 0 if pof2 == p else 1
        share = (pof2 - 1) / pof2
        return (2 * math.log2(pof2) + 2 * fold) * alpha + (2 * share + 2 * fold) * n * beta + (share + fold) * n * gamma
    # hierarchical
    g = resolve_local_size(p, local_size)
    nodes = p // g
    a_l = alpha if local_alpha is None else local_alpha
    b_l = beta if local_beta is None else local_beta
    intra = 2 * (g - 1) * a_l + 2 * (g - 1) / g * n * b_l
    inter = 2 * (nodes - 1) * alpha + 2 * (nodes - 1) / p * n * beta
    return intra + inter + (p - 1) / p * n * gamma


def coefficients(algorithm: str, world_size: int, **options) -> tuple[float, float, float]:
    """``(a, b, c)`` such that :func:`predict` is ``a·α + n·(b·β + c·γ)``: messages on the
    critical path, and bytes sent and bytes added there per byte of the buffer.

    Every formula above is linear in α, nβ and nγ, so three unit predictions recover them::

        >>> coefficients("ring", 4)
        (6.0, 1.5, 0.75)
    """
    units = ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0))
    a, b, c = (predict(algorithm, 1.0, world_size, alpha=x, beta=y, gamma=z, **options) for x, y, z in units)
    return a, b, c
