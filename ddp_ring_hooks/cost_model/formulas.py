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

**One network value.** What the links cost is one :class:`Links`::

    time = messages·α + n·(bytes·β + (reduced + cast)·γ)   the links between nodes (every link, on one tier)
         + local_messages·α_l + n·local_bytes·β_l          the links inside a node (``local``; default: the same)
         + per_call                                        once per all-reduce (default 0)

``α`` seconds per message, ``β`` per byte, ``γ`` per reduced or cast byte (a narrower wire's
casts, :func:`on_the_wire`, are passes over the buffer like an addition's), and, for two tiers, the
links inside a node (``local``, a ``Links`` of its own). ``per_call`` is what one all-reduce
costs apart from its messages (the executor handing the call to its worker and back): only the
advisor's probe can tell it from α, by timing two message counts at one size
(:func:`~.fit.fit_probe`); every other fit leaves it 0, and α then holds its share.

Every caller prices with it: :func:`price` and :func:`predict`, a fit (:func:`~.fit.fit` returns
one; ``Calibration`` is its name there), a :class:`~.two_tier.TwoTier` network (the ``Links``
whose uplinks each node's ranks share, and where the ranks are), ``auto``'s choice, and the
advisor's ``Network`` (a ``Links`` per algorithm). A new term is one more field of ``Links`` and
one more product in :meth:`Links.price`, as the casts of a compressed wire were (priced with
``γ``: ``cast·γ``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from ..schedules import CostTerms, get_algorithm, is_narrow, resolve_options, shape_options, wire_ratio
from ..schedules.wire import CAST_PASSES


@dataclass(frozen=True, slots=True)
class Links:
    """α, β, γ of the links (between nodes, or all of them), and the links inside a node.

    Example::

        >>> Links(5e-6, 1 / 25e9)                                   # one tier: 5 µs, 25 GB/s
        >>> Links(200e-6, 1 / 50e6, local=Links(50e-6, 1 / 1e9))    # uplinks 400 Mbit/s, nodes 1 GB/s
    """

    alpha: float
    beta: float
    gamma: float = 0.0
    local: Links | None = None
    #: seconds per all-reduce call apart from its messages (see the module docstring)
    per_call: float = 0.0

    def __post_init__(self) -> None:
        if min(self.alpha, self.beta, self.gamma, self.per_call) < 0:
            raise ValueError("alpha, beta, gamma and per_call must be non-negative")

    @property
    def inside(self) -> Links:
        """The links inside a node (these, where no ``local`` is given)."""
        return self.local if self.local is not None else self

    def price(self, terms: CostTerms, nbytes: float) -> float:
        """Seconds for ``terms`` on an ``nbytes`` buffer (see the module docstring)."""
        if nbytes < 0:
            raise ValueError("nbytes must be non-negative")
        n, inside = float(nbytes), self.inside
        return (
            terms.messages * self.alpha + n * (terms.bytes * self.beta + (terms.reduced + terms.cast) * self.gamma)
            + terms.local_messages * inside.alpha + n * terms.local_bytes * inside.beta
            + self.call_cost(terms)
        )

    def call_cost(self, terms: CostTerms) -> float:
        """``per_call`` for a call that sends anything (one rank's all-reduce sends nothing)."""
        return self.per_call if terms.messages or terms.local_messages else 0.0

    def predict(self, algorithm: str, nbytes: float, world_size: int, **options) -> float:
        """:func:`predict` on these links."""
        return predict(algorithm, nbytes, world_size, self, **options)


def links_of(links: Links | None, alpha: float | None, beta: float | None, gamma: float) -> Links:
    """``links``, or the one a caller spelled as ``alpha=, beta=`` (and ``gamma=``): one of the two."""
    if links is not None:
        if alpha is not None or beta is not None or gamma:
            raise TypeError("give the network as links=Links(...) or as alpha=, beta= (gamma=), not both")
        return links
    if alpha is None or beta is None:
        raise TypeError("give the network: links=Links(alpha, beta, ...), or alpha= and beta=")
    return Links(alpha, beta, gamma)


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
    links: Links | None = None,
    *,
    alpha: float | None = None,
    beta: float | None = None,
    gamma: float = 0.0,
    **options,
) -> float:
    """Predicted seconds to all-reduce ``nbytes`` per rank over ``world_size`` ranks on ``links``
    (or, on one tier, ``alpha=`` seconds per message, ``beta=`` seconds per byte and ``gamma=``
    seconds per reduced byte: the same as ``Links(alpha, beta, gamma)``). ``options`` are the
    algorithm's own (e.g. ``segments=`` for tree, ``local_size=`` for hierarchical, default
    ``LOCAL_WORLD_SIZE``); hierarchical prices its links inside a node with ``links.local``.

    Example::

        >>> predict("ring", 1e9, 64, alpha=5e-6, beta=1e-11)   # 1 GB at 100 GB/s
        0.0203...
    """
    links = links_of(links, alpha, beta, gamma)
    return price(cost_terms(algorithm, world_size, nbytes=nbytes, **options), nbytes, links)


def price(terms: CostTerms, nbytes: float, links: Links) -> float:
    """Seconds for ``terms`` on an ``nbytes`` buffer on ``links`` (:meth:`Links.price`)."""
    return links.price(terms, nbytes)


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
