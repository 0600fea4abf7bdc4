"""What one bucket's all-reduce costs: α-β per algorithm, from this run, a benchmark or two numbers.

Several sources, one shape (:class:`Network`: the network's one value, a
:class:`~ddp_ring_hooks.cost_model.Links`, per algorithm, ``"*"`` for the rest; every algorithm is
priced with its registry record's formula, ``formula_for``: ``native`` with the ring's):

- :func:`from_probe`: α, β and γ fitted to the short probe every rank ran when the hook was
  registered (:mod:`~ddp_ring_hooks.runtime.network_probe`: the run's algorithm at a few sizes,
  on its wire and on the other), with the error bar of the probe's fastest and median blocks
  (``Network.bounds``). What the advisor uses when the run has one.
- :func:`from_run`: α and β fitted to this run's own buckets (``(nbytes, time)`` of each
  bucket, median over steps) with the run algorithm's formula. These are *in-training*
  times: two lanes sharing the link and backward sharing the cores are in them. Every other
  algorithm is costed with the same α, β through its own formula (one description of the
  machine); ``native`` (the group's own ``all_reduce``) with the ring formula, since gloo's
  and NCCL's large-message all-reduce are rings: an assumption, said in the advice.
- :func:`from_bench`: ``ddp-ring-hooks bench --json`` records from the target cluster, one
  fit per algorithm (``native`` included, ring-shaped), measured outside training.
- :func:`from_latency_bandwidth`: ``--latency 5us --bandwidth 25GB/s``, for every algorithm.
- :func:`from_two_tier`: a :class:`~ddp_ring_hooks.cost_model.TwoTier` network (nodes whose
  ranks share one uplink; ``advise --placement``): every algorithm priced from its schedule
  on it, the ring's crossings and the hierarchy's shard included.

A sparse bucket (``nn.Embedding(sparse=True)``, a :class:`SparseBucket`) is priced by
:func:`bucket_cost` as it travels, with the same links (``s``: one rank's indices and values,
``D``: the table as a dense tensor, ``p`` ranks)::

    gathered (gloo's sparse all-reduce)    3(p-1)·α + (p-1)·s·β + 2p·s·γ
        three ring all-gathers (counts, indices, values), each rank's s bytes reaching the other
        p-1; then every rank adds the p shares and coalesces the sum (2p·s bytes of local passes)
    densified (sparse="dense")             the algorithm on D bytes + 2·D·γ
        e.g. the ring: 2(p-1)·α + 2(p-1)/p·D·β + (p-1)/p·D·γ; plus the scatter into a dense table
        and the gather of its non-zero rows back (a pass over D each)

The gather grows with ``p`` (every rank receives every other rank's rows), the densified ring
does not: which wins depends on the table, the rows touched and the world size
(:mod:`.sparse_verdict`).
"""

from __future__ import annotations

import functools
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from ..cost_model import Links, ProbeSample, TwoTier, bytes_sent_per_rank, coefficients, cost_terms, fit, fit_probe
from ..cost_model.fit import lower_quartile
from ..schedules import CostTerms, algorithm_names, build_schedule, formula_for, get_algorithm, wire_of
from .link_directions import link_directions
from .replay import BucketCost

ANY = "*"
#: How a run of ``auto`` (a mix of the registry's algorithms, not one of them) is priced.
MIX_PRICED_AS = "ring"


def _formula(algorithm: str) -> str:
    """The registry's formula for ``algorithm`` (:func:`~ddp_ring_hooks.schedules.formula_for`);
    a run that mixed them (``auto``) as :data:`MIX_PRICED_AS`."""
    return formula_for(algorithm) if algorithm in algorithm_names() else MIX_PRICED_AS


def bytes_factor(algorithm: str, world_size: int, **options) -> float:
    """Bytes the busiest rank sends per byte of bucket (it receives and adds as many): what
    the communication threads' CPU time grows with.

    Counted on the schedule itself, not read off the formula's β term: that term counts the
    critical path (a whole-buffer message per tree level, halving-doubling's fold twice),
    while the busiest rank sends what the schedule says (tree at p=2: 1, not 2;
    halving-doubling at p=3: 2, not 3). ``native`` is counted as the ring it is priced as.
    """
    if world_size < 2:
        return 0.0
    formula = _formula(algorithm)
    closed_form = get_algorithm(formula).busiest_sends
    if closed_form is not None:  # the ring: the same number without building 2p(p-1) transfers
        return closed_form(world_size, **options)
    return _schedule_bytes_factor(formula, world_size, tuple(sorted(options.items())))


@functools.lru_cache(maxsize=64)
def _schedule_bytes_factor(algorithm: str, world_size: int, options: tuple = ()) -> float:
    return max(bytes_sent_per_rank(build_schedule(algorithm, world_size, **dict(options)), 1.0))


@dataclass(frozen=True)
class Network:
    """α-β costs per algorithm, and where they came from (said in the advice).

    ``bounds``: the same network at the two ends of its error bar (the fastest, then the
    slowest, network the measurements allow), where the source gives one (a probe).
    """

    calibrations: Mapping[str, Links]
    source: str
    from_this_run: bool = False
    two_tier: TwoTier | None = None  # prices every algorithm when given
    #: measured on the run's own network (its buckets, its probe): the step model calibrates
    #: the run's own setting with it (another cluster's network is calibrated with the run's fit)
    here: bool = False
    bounds: tuple[Network, Network] | None = None
    #: the world size its records were measured at (bench records; ``None``: any, or not said)
    measured_at: int | None = None
    #: ``((nbytes, ms), (nbytes, ms))``: a probe's two largest all-reduces of the run's own
    #: algorithm and wire, the times this network was fitted to there (each size's lower quartile
    #: block; the fastest or the median for the error bar's ends). Their difference is the link's
    #: own rate for large buckets, without α or a shaper's burst in it, which the step model
    #: scales the link's price to (:func:`~.step_model.link_scale`). ``None``: no probe, or one
    #: with a single large size (timelines before the tenth series).
    large_blocks: tuple[tuple[int, float], tuple[int, float]] | None = None
    #: The run's own network this one was laid out from (``advise --placement`` without
    #: ``--latency``: the run's probe on each node's uplink). The step model calibrates the run's
    #: own setting on it, so that the calibration's offset is what that network leaves
    #: unexplained, not what the run's bucket fit does (``None``: a network given as it is).
    laid_out_from: Network | None = None

    def calibration(self, algorithm: str) -> Links:
        return self.calibrations.get(algorithm) or self.calibrations[ANY]

    def scaled(self, factor: float, why: str) -> Network:
        """This network with every cost (α, β, γ, per call; a node's links too) times ``factor``,
        its error bar and its large blocks alike, and ``why`` added to its source."""
        return replace(
            self, source=f"{self.source}; {why}",
            calibrations={name: _scaled_links(links, factor) for name, links in self.calibrations.items()},
            bounds=None if self.bounds is None else tuple(b.scaled(factor, why) for b in self.bounds),
            large_blocks=None if self.large_blocks is None else tuple((n, ms * factor) for n, ms in self.large_blocks),
        )

    def terms(self, algorithm: str, nbytes: float, world_size: int, **options) -> tuple[CostTerms, Links]:
        """The cost terms of one all-reduce of ``nbytes`` and the links that price them (a
        ``ValueError`` when a two-tier network has no shape for ``world_size`` ranks)."""
        formula = _formula(algorithm)
        if self.two_tier is not None:
            return self.two_tier.terms(formula, nbytes, world_size, **options), self.two_tier.links
        return cost_terms(formula, world_size, nbytes=nbytes, **options), self.calibration(algorithm)

    def cost_ms(self, algorithm: str, nbytes: float | SparseBucket, world_size: int, **options) -> float:
        """Predicted ms to all-reduce one bucket of ``nbytes`` (or a :class:`SparseBucket`) over
        ``world_size`` ranks, alone."""
        return bucket_cost(self, algorithm, nbytes, world_size, **options).total_ms

    def as_dict(self) -> dict:
        return {
            "source": self.source,
            "per_algorithm": {
                name: {"alpha_us": c.alpha * 1e6, "bandwidth_GBps": (1e-9 / c.beta) if c.beta else None,
                       "cast_gamma_ns_per_B": c.gamma * 1e9, "per_call_us": c.per_call * 1e6}
                for name, c in self.calibrations.items()
            },
        }


#: How a sparse bucket travels (``register(sparse=...)``): gathered by the group, or densified.
GATHER, DENSIFY = "gather", "dense"


@dataclass(frozen=True)
class SparseBucket:
    """A sparse gradient bucket as the advisor prices it: ``sparse_bytes``, one rank's indices
    and values (coalesced: what it puts in the gather); ``dense_bytes``, the table as a dense
    tensor (what densifying reduces); ``way``, :data:`GATHER` or :data:`DENSIFY`."""

    sparse_bytes: float
    dense_bytes: float
    way: str = GATHER

    def __post_init__(self) -> None:
        if self.way not in (GATHER, DENSIFY):
            raise ValueError(f"a sparse bucket travels {GATHER!r} or {DENSIFY!r}, not {self.way!r}")

    def going(self, way: str) -> SparseBucket:
        """The same bucket, reduced the other ``way``."""
        return replace(self, way=way)

    @property
    def nbytes(self) -> float:
        """Its bytes as the telemetry counts them for its way (``runtime/wire.py``)."""
        return self.sparse_bytes if self.way == GATHER else self.dense_bytes


def bucket_cost(network: Network, algorithm: str, nbytes: float | SparseBucket, world_size: int,
                **options) -> BucketCost:
    """What one bucket of ``nbytes`` costs the replay (:mod:`.replay`): the one price of a
    bucket, for every row of the advice. ``link``: its bytes on the links (``bytes·β``, and inside
    a node ``local_bytes·β_l``), in the parts of the link's two ways the algorithm's schedule
    holds (:func:`~.link_directions.link_directions`: a ring both ways at once, a tree's root
    in then out); ``fixed``: the rest, on its lane (every message's ``α``, the additions and
    casts at ``γ``). A :class:`SparseBucket` is priced as it travels (the module docstring):
    gathered whatever ``algorithm`` (its options do not apply; ring all-gathers, both ways), or
    densified through ``algorithm``. A new kind of bucket is priced by extending this function."""
    if isinstance(nbytes, SparseBucket):
        return _sparse_cost(network, algorithm, nbytes, world_size, **options)
    terms, links = network.terms(algorithm, nbytes, world_size, **options)
    n, inside = float(nbytes), links.inside
    fixed = (links.call_cost(terms) + terms.messages * links.alpha + terms.local_messages * inside.alpha
             + n * (terms.reduced + terms.cast) * links.gamma)
    link = n * (terms.bytes * links.beta + terms.local_bytes * inside.beta)
    ways = link_directions(algorithm, world_size, nbytes=n, **options)
    return BucketCost(fixed_ms=1e3 * fixed, link_ms=1e3 * link, link_directions=ways)


def _sparse_cost(network: Network, algorithm: str, bucket: SparseBucket, world_size: int, **options) -> BucketCost:
    """A sparse bucket's price (the module docstring's two lines)."""
    if world_size < 2:
        return BucketCost(0.0, 0.0)
    links = network.two_tier.links if network.two_tier is not None else network.calibration(algorithm)
    if bucket.way == DENSIFY:  # the schedule on the dense table, and the table made and unmade
        dense = bucket_cost(network, algorithm, bucket.dense_bytes, world_size, **options)
        return replace(dense, fixed_ms=dense.fixed_ms + 1e3 * 2 * bucket.dense_bytes * links.gamma)
    s, others = float(bucket.sparse_bytes), world_size - 1
    fixed = links.per_call + 3 * others * links.alpha + 2 * world_size * s * links.gamma
    return BucketCost(fixed_ms=1e3 * fixed, link_ms=1e3 * others * s * links.beta)


def gather_equivalent_bytes(sparse_bytes: float, world_size: int, algorithm: str, **options) -> float:
    """The dense bucket whose bytes on the links under ``algorithm``'s formula are what gathering
    ``sparse_bytes`` sends (``(p-1)·s``): how a gathered bucket's time joins the fit of a run's
    dense buckets (:func:`from_run`)."""
    per_byte = coefficients(_formula(algorithm), world_size, **options)[1]
    return (world_size - 1) * sparse_bytes / per_byte if per_byte else float(sparse_bytes)


def from_probe(
    samples: Iterable[ProbeSample], *, algorithm: str, world_size: int, options: Mapping[str, object] | None = None,
) -> Network:
    """α, β, γ fitted to the probe's ``samples`` (``algorithm`` timed with ``options`` on
    ``world_size`` ranks when the hook was registered: each size's lower quartile block,
    :class:`~ddp_ring_hooks.cost_model.ProbeFit`), with the error bar of its fastest and median
    blocks. Every algorithm is priced with these links through its own formula."""
    samples = list(samples)
    formula = _formula(algorithm)
    shaping = {k: v for k, v in (options or {}).items()}
    fitted = fit_probe(samples, algorithm=formula, world_size=world_size, **shaping)
    sizes = sorted({s.nbytes for s in samples})
    wires = sorted({s.wire for s in samples})
    links = fitted.links
    scatter = max(((statistics.median(s.seconds) - min(s.seconds)) / min(s.seconds) for s in samples if s.seconds),
                  default=0.0)
    per_call = f" + {links.per_call * 1e6:.0f} us per call" if any(s.algorithm for s in samples) else ""
    source = (f"probed when the hook was registered: {algorithm} at {_size(sizes[0])}-{_size(sizes[-1])} on "
              f"{' and '.join(wires)}; alpha {links.alpha * 1e6:.0f} us{per_call}, {_rate(links.beta)}, cast "
              f"{links.gamma * 1e9:.2f} ns/B (each size's lower quartile block); its blocks' median lay up to "
              f"{scatter:.0%} above their fastest (each row's speedup_range){_unpriced(links)}")

    wire = wire_of(shaping)
    own = sorted((s for s in samples if not s.algorithm and s.wire == wire), key=lambda s: s.nbytes)
    large = own[-2:] if len(own) >= 3 else []  # beside the small size, two large ones

    def network(found: Links, note: str, block) -> Network:
        blocks = tuple((s.nbytes, 1e3 * block(s.seconds)) for s in large)
        return Network({ANY: found}, note, here=True, large_blocks=blocks or None)

    return replace(network(links, source, lower_quartile),
                   bounds=(network(fitted.fastest, "the probe's fastest blocks", min),
                           network(fitted.slowest, "the probe's median blocks", statistics.median)))


def _scaled_links(links: Links, factor: float) -> Links:
    return replace(links, alpha=links.alpha * factor, beta=links.beta * factor, gamma=links.gamma * factor,
                   per_call=links.per_call * factor,
                   local=None if links.local is None else _scaled_links(links.local, factor))


def unpriced_costs(links: Links) -> list[str]:
    """The costs a fit left at 0, which every row then prices free: the bytes (``β``), a message
    (``α`` and the per-call cost both). A disturbed probe's sign (and the sparse verdict's test
    of a network it can price both ways on)."""
    free = ["the bytes (beta)"] if links.beta <= 0 else []
    return free + (["a message (alpha and per call)"] if links.alpha <= 0 and links.per_call <= 0 else [])


def _unpriced(links: Links) -> str:
    """What the source says of a fit that left a cost at 0: a probe whose blocks were disturbed
    past the lower quartile (four ranks on two cores: every block)."""
    missing = unpriced_costs(links)
    if not missing:
        return ""
    return (f"; WARNING: its blocks left {' and '.join(missing)} at 0, priced free in every row (more than three "
            f"in four blocks disturbed): rerun on quieter cores, or give --network")


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 and nbytes % (1 << 20) == 0 else f"{nbytes >> 10} KiB"


def _rate(beta: float) -> str:
    """``β`` as a rate: 48.6 MB/s (1e6 B), or GB/s when faster."""
    if beta <= 0:
        return "bandwidth unbounded"
    rate = 1.0 / beta
    return f"{rate / 1e9:.2f} GB/s" if rate >= 1e9 else f"{rate / 1e6:.1f} MB/s"


def from_run(
    *, algorithm: str, world_size: int, samples: Iterable[tuple[int, float]], options: Mapping[str, object] | None = None
) -> Network:
    """Fit α, β to ``(nbytes, ms)`` of this run's buckets, with ``algorithm``'s formula and the
    ``options`` it ran with."""
    if world_size < 2:
        raise ValueError("a run on one rank communicates nothing; train on 2 or more ranks to get advice")
    samples = [(n, ms * 1e-3) for n, ms in samples if ms > 0]
    if not samples:
        raise ValueError("no bucket of this run took any time (one rank?); give a network: --network or --latency/--bandwidth")
    formula, options = _formula(algorithm), dict(options or {})
    if len({n for n, _ in samples}) >= 2:
        try:
            calibration = fit(samples, algorithm=formula, world_size=world_size, **options)
            note = "fitted to this run's buckets (in training: lanes sharing the link and cores included)"
        except ValueError:
            calibration, note = _bandwidth_only(samples, formula, world_size, options)
    else:
        calibration, note = _bandwidth_only(samples, formula, world_size, options)
    return Network({ANY: calibration}, note, from_this_run=True, here=True)


def _bandwidth_only(samples, formula: str, world_size: int, options: Mapping[str, object]) -> tuple[Links, str]:
    """All buckets one size: α and β cannot be told apart; put everything into β."""
    b = coefficients(formula, world_size, **options)[1]
    beta = statistics.median(t / (b * n) for n, t in samples if n > 0)
    return Links(0.0, beta), "this run's buckets all have one size: bandwidth only (alpha 0)"


def from_bench(records: Iterable[Mapping], *, world_size: int | None = None) -> Network:
    """A fit per algorithm of ``bench --json`` records: those at ``world_size`` (the run's) when
    they cover it, else at the largest world size they cover (``measured_at`` says which)."""
    records = [r for r in records if r.get("time_us", 0) > 0]
    if not records:
        raise ValueError("the network file holds no timed records; write one with `ddp-ring-hooks bench --json FILE`")
    covered = Counter(r["world_size"] for r in records)
    world_size = world_size if world_size in covered else max(covered)
    by_algorithm: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        if r["world_size"] == world_size:
            by_algorithm.setdefault(r["algorithm"], []).append((r["nbytes"], r["time_us"] * 1e-6))
    calibrations = {}
    for algorithm, samples in by_algorithm.items():
        if algorithm not in algorithm_names():  # "auto" is a mix, not one formula
            continue
        try:
            calibrations[algorithm] = fit(samples, algorithm=_formula(algorithm), world_size=world_size)
        except ValueError:
            continue  # one size only: this algorithm falls back to the shared fit
    shared = [(n, t) for samples in by_algorithm.values() for n, t in samples]
    calibrations[ANY] = calibrations.get("ring") or fit(shared, algorithm="ring", world_size=world_size)
    return Network(calibrations, f"bench records at {world_size} ranks, fitted per algorithm", measured_at=world_size)


def from_latency_bandwidth(*, latency_s: float, bandwidth_Bps: float) -> Network:
    """The same α (seconds per message) and β = 1 / bandwidth for every algorithm."""
    if latency_s < 0 or bandwidth_Bps <= 0:
        raise ValueError(f"latency must be >= 0 and bandwidth > 0, got {latency_s} s and {bandwidth_Bps} B/s")
    return Network({ANY: Links(latency_s, 1.0 / bandwidth_Bps)},
                   f"given: latency {latency_s * 1e6:g} us, bandwidth {bandwidth_Bps / 1e9:g} GB/s")


def from_two_tier(network: TwoTier) -> Network:
    """Every algorithm priced on ``network`` (two tiers: each node's ranks share its uplink)."""
    where = (f"nodes of {network.ranks_per_node} ranks" if network.placement is None
             else f"nodes {', '.join(map(str, network.placement))}")
    links, inside = network.links, network.links.inside
    return Network(
        {ANY: links},
        f"given, two tiers ({where}): uplink latency {links.alpha * 1e6:g} us, {1e-9 / links.beta:g} GB/s; "
        f"inside a node {inside.alpha * 1e6:g} us, {1e-9 / inside.beta:g} GB/s"
        if links.beta and inside.beta else "given, two tiers",
        two_tier=network,
    )
