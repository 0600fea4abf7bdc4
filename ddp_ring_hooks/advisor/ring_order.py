"""What the rank order costs on two tiers: the ring's crossings of node boundaries, and the fix.

A ring visits the ranks in its order; each hop between two nodes goes through both nodes'
uplinks, and a node's uplink carries every hop that leaves it. Numbered node by node, the ring
leaves each node once; numbered across nodes (what a scheduler or an elastic rendezvous can
hand out), it leaves them at every hop::

    nodes 0, 1, 0, 1     ring 0 ⇒ 1 ⇒ 2 ⇒ 3 ⇒ 0     4 crossings, 2 leave each node
    ring_order='hosts'   ring 0 → 2 ⇒ 1 → 3 ⇒ 0     2 crossings, 1 leaves each node

    the ring crosses the node boundary 4 times; ring_order='hosts' would cross it 2 times: predicted 1.9x faster

:func:`ring_order_note` says so when the ranks' nodes are known (the hook gathers each rank's
``GROUP_RANK``; the timeline records them) and the order crosses more often than grouped by
node. The speedup is the ring's time on two tiers (:mod:`~ddp_ring_hooks.cost_model.two_tier`:
``2(p-1)α + 2(p-1)/p · h·nβ``, ``h`` the hops leaving the busiest node) with ``h`` as it is and
as ``"hosts"`` makes it (1). Given a calibration fitted to the run's own buckets, its ``β``
holds the run's ``h`` already (the run measured it), so the fix divides the byte term by it;
without one, the bytes alone: "up to ``h``x".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..cost_model import Calibration, ring_crossings

FIX = "ring_order='hosts'"


@dataclass(frozen=True)
class RingOrderNote:
    """A ring that crosses node boundaries more than it must."""

    crossings: int  # hops between nodes now
    fewest: int  # ... grouped by node
    busiest: int  # hops leaving the busiest node now (through its uplink)
    speedup: float  # predicted, grouped by node
    calibrated: bool  # speedup from this run's α, β (else the bytes alone, an upper bound)

    def line(self) -> str:
        gain = f"predicted {self.speedup:.2g}x faster" if self.calibrated else f"up to {self.speedup:.2g}x faster"
        return (f"the ring crosses the node boundary {self.crossings} times; {FIX} would cross it "
                f"{self.fewest} times: {gain}")

    def as_dict(self) -> dict:
        return {"crossings": self.crossings, "fewest": self.fewest, "busiest": self.busiest,
                "speedup": self.speedup, "calibrated": self.calibrated, "line": self.line()}


def ring_order_note(
    *, order: Sequence[int] | None, nodes: Sequence[int] | None, calibration: Calibration | None = None,
    nbytes: float = 0.0,
) -> RingOrderNote | None:
    """The note for a ring in ``order`` over ranks on ``nodes`` (``None`` when either is
    unknown, all ranks share one node, or no order would cross less); ``calibration`` and
    ``nbytes``: the run's fitted ring and its bucket, for a predicted speedup."""
    if order is None or nodes is None or len(set(nodes)) < 2 or len(order) != len(nodes):
        return None
    now = ring_crossings(order, nodes)
    grouped = ring_crossings(sorted(range(len(nodes)), key=lambda rank: (nodes[rank], rank)), nodes)
    if now.busiest <= grouped.busiest and now.total <= grouped.total:
        return None
    ratio = now.busiest / grouped.busiest
    if calibration is None or nbytes <= 0:
        return RingOrderNote(now.total, grouped.total, now.busiest, ratio, calibrated=False)
    p = len(order)
    latency, transfer = 2 * (p - 1) * calibration.alpha, 2 * (p - 1) / p * nbytes * calibration.beta
    speedup = (latency + transfer) / (latency + transfer / ratio) if latency + transfer > 0 else 1.0
    return RingOrderNote(now.total, grouped.total, now.busiest, speedup, calibrated=True)


def hierarchy_note(*, schedule_nodes: Sequence[int] | None, nodes: Sequence[int] | None) -> str | None:
    """What to say when ``hierarchical``'s nodes (``schedule_nodes``: consecutive places of its
    order, ``local_size`` each) are not the ranks' real ``nodes``: its "intra-node" rings then
    cross between nodes (on the lab, 2 nodes of 2 with the ranks alternating, it took 1.28x the
    well-placed ring instead of 0.68x). ``None`` when they agree or either is unknown."""
    if schedule_nodes is None or nodes is None or len(schedule_nodes) != len(nodes):
        return None
    if _groups(schedule_nodes) == _groups(nodes):
        return None
    return (f"hierarchical's nodes are not the ranks' nodes: it groups ranks {_shown(schedule_nodes)}, the ranks "
            f"say {_shown(nodes)}; its rings inside a node cross between nodes: {FIX} makes its nodes the real ones")


def _groups(nodes: Sequence[int]) -> set[frozenset[int]]:
    return {frozenset(rank for rank, at in enumerate(nodes) if at == node) for node in set(nodes)}


def _shown(nodes: Sequence[int]) -> str:
    """``0,1 | 2,3``: the ranks of each node, nodes in order of their lowest rank."""
    return " | ".join(",".join(map(str, sorted(group))) for group in sorted(_groups(nodes), key=min))
