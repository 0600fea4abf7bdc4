"""Which link is slow: the naming rule, from each directed link's bandwidth.

A slow network on one rank (a bad NIC or cable) shows in the bandwidth matrix as a cross: its
row (links out of it) and its column (links into it) are low and the rest is not; one slow
link is one low cell, or two (both directions), that make no cross::

              to: 0     1     2     3                       to: 0     1     2     3
    from 0        .    48    12    47             from 0        .    12    48    47
         1       47     .    12    48                  1       12     .    48    47
         2       12    12     .    12                  2       48    47     .    48
         3       48    47    12     .                  3       47    48    47     .
    "rank 2's network is slow"                      "0→1 and 1→0 are slow"

The rule (``threshold`` 0.6, ``window`` 16 by default):

1. **Consistently below.** A link's bandwidth is the median of its last ``window`` samples
   (bytes / seconds); a link is *below* a reference when at least 3/4 of those samples are
   below ``threshold`` x the reference, and it has ``min_samples`` of them. One bad sample (a
   busy core, a page fault, a first step's cold connection) makes nothing slow, nor does one
   good sample clear a slow link. (A matrix is one sample a link, judged as it is:
   ``min_samples`` 1; during training a link needs :data:`MIN_TRAINING_SAMPLES`.)
2. **Tiers.** With the ranks' nodes known, links inside a node (GPUs of one box, NVLink or
   PCIe; on the lab, the node's unshaped bridge) and links between nodes (the network) are
   judged only against links of their own tier: between-node links being slower is the design
   of a two-tier cluster, not a fault. Without nodes (or on one node, or one rank per node)
   all links are one tier.
3. **A node's uplink** (two tiers, 3 nodes or more, a node of 2 ranks or more) is slow when
   every between-node link into and out of its ranks is below the median of the
   between-node links that touch none of its ranks. With 2 nodes every between-node link
   crosses both uplinks: a slow uplink there is a slower network, which no comparison can
   tell from the design.
4. **A rank** is slow in a tier when it has links into it and out of it there, to 2 peers or
   more, and every one of them is below the median of the tier's links that do not touch
   the rank (links of a slow uplink left out of both). Between nodes (or in one tier) that is
   the rank's *network*; inside a node, its links inside the node. With one peer in the tier
   the two ends cannot be told apart: that is a link pair (step 6).
5. **Explained** links are the between-node links of a named node (3) and those of a rank
   named in their tier (4).
6. **A link** that is not explained is slow when below the median of its tier's other
   unexplained links (neither it nor its reverse). Both directions of a pair are named when
   both are slow. "Others", in the summary line, is the median of a tier's links that
   nothing names.

Why 0.6: a link at 0.6x of the others is 1.7x slower, far outside what links of one switch
differ by (a few percent on the lab's shaped links; single samples on a loaded machine stray
further, which step 1 takes out), and a network at half speed (0.5x) is still caught.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

#: A link is slow below this fraction of the others' median bandwidth.
THRESHOLD = 0.6
#: Each link is judged on its last this many samples.
WINDOW = 16
#: ... and is below a reference when at least this share of them are.
CONSISTENT_SHARE = 0.75
#: During training, a link is named only once it has this many samples: with one, a single
#: cold first step (a connection's slow start, DDP's provisional buckets) would name it; with
#: three, a rank starved of CPU for three early steps did (loopback, 3 ranks and 2 busy cores:
#: 8 of 36 runs named a network at some step; with five, 3 of 36, 4 steps in all). A slow
#: NIC stays slow, so the cost is two more timed steps before it is named.
MIN_TRAINING_SAMPLES = 5

ALL, INSIDE, BETWEEN = "all", "inside nodes", "between nodes"

Link = tuple[int, int]  # (source rank, destination rank)


@dataclass(frozen=True, slots=True)
class LinkSample:
    """One timed transfer: ``nbytes`` from ``src`` to ``dst`` in ``seconds`` (once both ends were ready)."""

    src: int
    dst: int
    nbytes: int
    seconds: float

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.seconds


@dataclass(frozen=True, slots=True)
class SlowRank:
    """A rank whose every link of a ``tier`` is slow: its network (between nodes, or ``all``),
    or its links inside its node; medians in bytes per second."""

    rank: int
    tier: str
    in_Bps: float
    out_Bps: float
    others_Bps: float | None  # None: every link of the tier is named


@dataclass(frozen=True, slots=True)
class SlowNode:
    """A node whose every between-node link is slow: its uplink."""

    node: int
    ranks: tuple[int, ...]
    in_Bps: float
    out_Bps: float
    others_Bps: float | None


@dataclass(frozen=True, slots=True)
class SlowLinks:
    """One slow link, or both directions of a pair (``links``), against the others of its tier."""

    links: tuple[Link, ...]
    bytes_per_s: tuple[float, ...]
    tier: str
    others_Bps: float


@dataclass(frozen=True)
class LinkVerdict:
    """What the rule found (see the module docstring); bandwidths in bytes per second."""

    world_size: int
    bandwidths: Mapping[Link, float]  # each link's median
    tiers: Mapping[Link, str]  # each link's tier: ALL, or INSIDE / BETWEEN nodes
    nodes: tuple[int, ...] | None
    threshold: float
    samples: int  # the fewest samples any link's median was taken over
    judged: int  # links that had others to be compared with
    tier_medians: Mapping[str, float]  # the median of each tier's links
    others_Bps: Mapping[str, float | None]  # ... of each tier's links that nothing names (step 6)
    slow_ranks: tuple[SlowRank, ...] = ()
    slow_nodes: tuple[SlowNode, ...] = ()
    slow_links: tuple[SlowLinks, ...] = ()

    @property
    def median_Bps(self) -> float | None:
        """The median bandwidth of all links."""
        return statistics.median(self.bandwidths.values()) if self.bandwidths else None

    @property
    def slowest(self) -> Link | None:
        """The link of the lowest bandwidth."""
        return min(self.bandwidths, key=self.bandwidths.__getitem__) if self.bandwidths else None

    @property
    def slow_nic_rank(self) -> int:
        """The first rank whose network is slow (its between-node or only tier), ``-1`` when none."""
        return next((s.rank for s in self.slow_ranks if s.tier != INSIDE), -1)

    @property
    def anything_slow(self) -> bool:
        return bool(self.slow_ranks or self.slow_nodes or self.slow_links)

    def named_links(self) -> set[Link]:
        """Every link the verdict names: a slow link, or a link of a named rank (in its tier) or
        node (between nodes)."""
        named = {link for found in self.slow_links for link in found.links}
        for rank in self.slow_ranks:
            named |= {link for link, tier in self.tiers.items() if rank.rank in link and tier == rank.tier}
        for node in self.slow_nodes:
            named |= {link for link, tier in self.tiers.items() if tier == BETWEEN and set(link) & set(node.ranks)}
        return named

    def summary_line(self, *, per: str = "samples") -> str:
        """One line, e.g. ``links: rank 2's network is slow: 11.9 MB/s in, 12.1 MB/s out, others
        47.8 MB/s (12 steps)``; ``per`` names what the samples were (``steps``, ``repeats``)."""
        counted = f"({self.samples} {per if self.samples != 1 else per.removesuffix('s')})"
        if not self.bandwidths:
            return "links: no link measured yet"
        if not self.judged:
            values = ", ".join(f"{_arrow(link)} {_mbps(b)}" for link, b in sorted(self.bandwidths.items()))
            return f"links: nothing to compare with at {self.world_size} ranks: {values} {counted}"
        if not self.anything_slow:
            tiers = (f"median {_mbps(self.median_Bps)}" if ALL in self.tier_medians else
                     ", ".join(f"{tier} {_mbps(b)}" for tier, b in self.tier_medians.items()) + " (medians)")
            slowest = self.slowest
            return (f"links: no slow link: {tiers}, slowest {_arrow(slowest)} at {_mbps(self.bandwidths[slowest])} "
                    f"({len(self.bandwidths)} links, {counted[1:]}")
        found = [_rank_clause(s) for s in self.slow_ranks] + [_node_clause(s) for s in self.slow_nodes]
        found += [_links_clause(s) for s in self.slow_links[:3]]
        if len(self.slow_links) > 3:
            found.append(f"{sum(len(s.links) for s in self.slow_links[3:])} more slow links")
        return "links: " + "; ".join(found) + f" {counted}"

    def as_dict(self, *, per: str = "samples") -> dict:
        """Plain JSON data (bandwidths in bytes per second, links as ``[src, dst]``; ``per`` as
        in :meth:`summary_line`)."""
        slowest = self.slowest
        return {
            "threshold": self.threshold, "samples": self.samples, "judged": self.judged,
            "median_Bps": self.median_Bps, "slowest": list(slowest) if slowest else None,
            "slowest_Bps": self.bandwidths[slowest] if slowest else None,
            "tier_medians_Bps": dict(self.tier_medians), "others_Bps": dict(self.others_Bps),
            "slow_nic_rank": self.slow_nic_rank,
            "slow_ranks": [{"rank": s.rank, "tier": s.tier, "in_Bps": s.in_Bps, "out_Bps": s.out_Bps,
                            "others_Bps": s.others_Bps} for s in self.slow_ranks],
            "slow_nodes": [{"node": s.node, "ranks": list(s.ranks), "in_Bps": s.in_Bps, "out_Bps": s.out_Bps,
                            "others_Bps": s.others_Bps} for s in self.slow_nodes],
            "slow_links": [{"links": [list(link) for link in s.links], "Bps": list(s.bytes_per_s), "tier": s.tier,
                            "others_Bps": s.others_Bps} for s in self.slow_links],
            "summary": self.summary_line(per=per),
        }


def recent_bandwidths(samples: Iterable[LinkSample], *, window: int | None = WINDOW) -> dict[Link, tuple[float, ...]]:
    """Each link's bandwidths (bytes per second) of its last ``window`` samples in the order
    given (``None``: all of them)."""
    per_link: dict[Link, list[float]] = defaultdict(list)
    for sample in samples:
        if not sample.seconds > 0 or sample.nbytes <= 0:
            raise ValueError(f"sample {sample} needs nbytes > 0 and seconds > 0")
        per_link[(sample.src, sample.dst)].append(sample.bytes_per_s)
    return {link: tuple(values[-window:] if window else values) for link, values in per_link.items()}


def judge_samples(
    samples: Iterable[LinkSample], *, world_size: int, nodes: Sequence[int] | None = None,
    threshold: float = THRESHOLD, window: int | None = WINDOW, min_samples: int = 1,
) -> LinkVerdict:
    """The rule of the module docstring on each link's last ``window`` samples (``None``: all);
    a link with fewer than ``min_samples`` of them is measured but never below (step 1)."""
    return _judge(recent_bandwidths(samples, window=window), world_size=world_size, nodes=nodes, threshold=threshold,
                  min_samples=min_samples)


def judge_links(
    bandwidths: Mapping[Link, float], *, world_size: int, nodes: Sequence[int] | None = None,
    threshold: float = THRESHOLD,
) -> LinkVerdict:
    """The rule of the module docstring on a matrix: one bandwidth (bytes per second) per
    directed link; links not measured are left out. ``nodes``: the node of each rank, when known."""
    return _judge({link: (value,) for link, value in bandwidths.items()}, world_size=world_size, nodes=nodes,
                  threshold=threshold)


def _judge(
    recent: Mapping[Link, tuple[float, ...]], *, world_size: int, nodes: Sequence[int] | None, threshold: float,
    min_samples: int = 1,
) -> LinkVerdict:
    _check(recent, world_size, nodes, threshold)
    if min_samples < 1:
        raise ValueError(f"min_samples={min_samples}: a link is judged on 1 sample or more")
    nodes = tuple(nodes) if nodes is not None else None
    measured = _Measured(recent, threshold, min_samples)
    bandwidths = measured.bandwidths
    tier_of = _tiers(bandwidths, nodes)
    by_tier: dict[str, list[Link]] = {tier: [] for tier in (ALL, INSIDE, BETWEEN) if tier in tier_of.values()}
    for link in bandwidths:
        by_tier[tier_of[link]].append(link)

    # 3. Node uplinks.
    named_nodes = _slow_nodes(measured, by_tier.get(BETWEEN, []), nodes) if BETWEEN in by_tier else []
    of_named_nodes = {link for link in by_tier.get(BETWEEN, []) for _, ranks in named_nodes if set(link) & set(ranks)}
    # 4. Ranks, in each tier, among the links no named node explains.
    named_ranks = [(rank, tier) for tier, links in by_tier.items()
                   for rank in _slow_ranks(measured, [l for l in links if l not in of_named_nodes], world_size)]
    # 5. What they explain.
    explained = of_named_nodes | {link for link in bandwidths if any((end, tier_of[link]) in named_ranks for end in link)}
    unexplained = {tier: [link for link in links if link not in explained] for tier, links in by_tier.items()}
    # 6. Links; then the others: each tier's links that nothing names.
    slow_links, judged = _slow_links(measured, unexplained, tier_of)
    named = explained | {link for found in slow_links for link in found.links}
    others = {tier: measured.median(l for l in links if l not in named) for tier, links in by_tier.items()}

    def endpoint(tier: str, ranks: Sequence[int]) -> tuple[float, float, float | None]:
        own = [link for link in by_tier[tier] if set(link) & set(ranks)]
        into = measured.median(l for l in own if l[1] in ranks)
        out = measured.median(l for l in own if l[0] in ranks)
        return into, out, others[tier]

    return LinkVerdict(
        world_size=world_size, bandwidths=bandwidths, tiers=tier_of, nodes=nodes, threshold=threshold,
        samples=min((len(values) for values in recent.values()), default=0), judged=judged + len(explained),
        tier_medians={tier: measured.median(links) for tier, links in by_tier.items()}, others_Bps=others,
        slow_ranks=tuple(SlowRank(rank, tier, *endpoint(tier, (rank,))) for rank, tier in sorted(named_ranks)),
        slow_nodes=tuple(SlowNode(node, ranks, *endpoint(BETWEEN, ranks)) for node, ranks in named_nodes),
        slow_links=slow_links,
    )


class _Measured:
    """Each link's recent bandwidths and their median; "below a reference" (step 1)."""

    def __init__(self, recent: Mapping[Link, tuple[float, ...]], threshold: float, min_samples: int = 1) -> None:
        self.recent, self.threshold, self.min_samples = recent, threshold, min_samples
        self.bandwidths = {link: statistics.median(values) for link, values in recent.items()}

    def median(self, links: Iterable[Link]) -> float | None:
        """The median of the links' bandwidths; ``None`` for no link."""
        values = [self.bandwidths[link] for link in links]
        return statistics.median(values) if values else None

    def below(self, link: Link, reference: float) -> bool:
        values = self.recent[link]
        return (len(values) >= self.min_samples
                and sum(value < self.threshold * reference for value in values) >= CONSISTENT_SHARE * len(values))

    def all_below(self, links: Sequence[Link], reference: float | None) -> bool:
        return reference is not None and all(self.below(link, reference) for link in links)


def _slow_nodes(measured: _Measured, between: list[Link], nodes: tuple[int, ...]) -> list[tuple[int, tuple[int, ...]]]:
    """Step 3: ``(node, its ranks)`` for each node (of 2 ranks or more, with 2 peer nodes or more)
    whose every between-node link is slow against the between-node links that miss the node."""
    named = []
    for node in sorted(set(nodes)):
        ranks = tuple(rank for rank, n in enumerate(nodes) if n == node)
        own = [link for link in between if set(link) & set(ranks)]
        peer_nodes = {nodes[end] for link in own for end in link} - {node}
        away = [link for link in between if not set(link) & set(ranks)]
        if len(ranks) >= 2 and len(peer_nodes) >= 2 and measured.all_below(own, measured.median(away)):
            named.append((node, ranks))
    return named


def _slow_ranks(measured: _Measured, links: list[Link], world_size: int) -> list[int]:
    """Step 4, in one tier: ranks with links in and out (to 2 peers or more), every one slow
    against the tier's links that miss the rank."""
    named = []
    for rank in range(world_size):
        own = [link for link in links if rank in link]
        peers = {end for link in own for end in link} - {rank}
        has_both = any(link[1] == rank for link in own) and any(link[0] == rank for link in own)
        if has_both and len(peers) >= 2 and measured.all_below(own, measured.median(l for l in links if rank not in l)):
            named.append(rank)
    return named


def _slow_links(
    measured: _Measured, unexplained: Mapping[str, list[Link]], tier_of: Mapping[Link, str],
) -> tuple[tuple[SlowLinks, ...], int]:
    """Step 6: the slow links among the unexplained ones, a pair's two directions together; and
    how many links had others to be compared with."""
    slow: dict[Link, float] = {}  # slow link -> the median it was compared with
    judged = 0
    for links in unexplained.values():
        for link in links:
            reference = measured.median(l for l in links if l not in (link, link[::-1]))
            if reference is not None:
                judged += 1
                if measured.below(link, reference):
                    slow[link] = reference
    found = []
    for pair in sorted({tuple(sorted(link)) for link in slow}):
        directions = tuple(link for link in (pair, pair[::-1]) if link in slow)
        found.append(SlowLinks(directions, tuple(measured.bandwidths[l] for l in directions),
                               tier_of[directions[0]], slow[directions[0]]))
    return tuple(found), judged


def _check(recent: Mapping[Link, tuple[float, ...]], world_size: int, nodes, threshold: float) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}")
    if not 0 < threshold < 1:
        raise ValueError(f"threshold must lie between 0 and 1 (a fraction of the others' bandwidth), got {threshold!r}")
    if nodes is not None and len(nodes) != world_size:
        raise ValueError(f"nodes must give the node of each of the {world_size} ranks, got {len(nodes)}: {list(nodes)}")
    for (src, dst), values in recent.items():
        if not (0 <= src < world_size and 0 <= dst < world_size) or src == dst:
            raise ValueError(f"link {src}→{dst} is not a link between two of the {world_size} ranks")
        for value in values:
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"link {src}→{dst}: bandwidth {value!r} must be a positive number of bytes per second")


def _tiers(bandwidths: Mapping[Link, float], nodes: tuple[int, ...] | None) -> dict[Link, str]:
    """Each link's tier; a single tier is :data:`ALL`."""
    if nodes is None:
        return dict.fromkeys(bandwidths, ALL)
    tiers = {link: INSIDE if nodes[link[0]] == nodes[link[1]] else BETWEEN for link in bandwidths}
    return tiers if len(set(tiers.values())) > 1 else dict.fromkeys(bandwidths, ALL)


def _megabytes(bytes_per_s: float) -> str:
    """Bytes per second as MB/s (1e6 bytes), three significant digits, never in exponent form."""
    value = bytes_per_s / 1e6
    return f"{value:.0f}" if value >= 100 else f"{value:#.3g}"


def _mbps(bytes_per_s: float) -> str:
    return f"{_megabytes(bytes_per_s)} MB/s"


def _arrow(link: Link) -> str:
    return f"{link[0]}→{link[1]}"


def _others(tier: str, bytes_per_s: float | None) -> str:
    """``, others 47.8 MB/s``: what a finding is compared with (nothing when every link is named)."""
    if bytes_per_s is None:
        return ""
    return f", {'others' if tier == ALL else f'other links {tier}'} {_mbps(bytes_per_s)}"


def _rank_clause(slow: SlowRank) -> str:
    what = "links inside its node are" if slow.tier == INSIDE else "network is"
    return (f"rank {slow.rank}'s {what} slow: {_mbps(slow.in_Bps)} in, {_mbps(slow.out_Bps)} out"
            + _others(slow.tier, slow.others_Bps))


def _node_clause(slow: SlowNode) -> str:
    ranks = ", ".join(map(str, slow.ranks))
    return (f"node {slow.node}'s uplink is slow (ranks {ranks}): {_mbps(slow.in_Bps)} in, {_mbps(slow.out_Bps)} out"
            + _others(BETWEEN, slow.others_Bps))


def _links_clause(slow: SlowLinks) -> str:
    names = " and ".join(map(_arrow, slow.links))
    values = " and ".join(map(_megabytes, slow.bytes_per_s))
    verb = "are" if len(slow.links) > 1 else "is"
    return f"{names} {verb} slow: {values} MB/s{_others(slow.tier, slow.others_Bps)}"
