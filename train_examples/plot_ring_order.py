"""Draw a ring over two nodes in two orders, from the schedules themselves (for docs/algorithms.md).

    python train_examples/plot_ring_order.py --placement 0,1,0,1 --output docs/ring_order.png

Each panel builds the ring's schedule (``ring_order="rank"``, then ``"hosts"``), draws every
node as a box with its ranks inside, and every hop of the ring (the first step's transfers,
which every step repeats) as an arrow: thin inside a node, thick and red when it crosses
between nodes. The title counts the crossings and the hops leaving the busiest node
(``cost_model.ring_crossings``): the bytes through its uplink grow with them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ddp_ring_hooks.cost_model import ring_crossings
from ddp_ring_hooks.schedules import build_schedule, schedule_order

ORDERS = ("rank", "hosts")


def hops(placement: tuple[int, ...], order: str) -> tuple[tuple[int, ...], list[tuple[int, int]]]:
    """The ring's order and its hops ``(src, dst)``, read off the schedule's first step."""
    options = {"ring_order": order, "node_of": placement} if order == "hosts" else {}
    schedule = build_schedule("ring", len(placement), **options)
    return schedule_order(schedule), [(t.src, t.dst) for t in schedule.steps[0].transfers]


def positions(placement: tuple[int, ...]) -> dict[int, tuple[float, float]]:
    """Ranks in columns by node, in rank order down each column."""
    where: dict[int, tuple[float, float]] = {}
    for node in sorted(set(placement)):
        members = [rank for rank, at in enumerate(placement) if at == node]
        for row, rank in enumerate(members):
            where[rank] = (3.0 * node, -1.2 * row)
    return where


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--placement", default="0,1,0,1", help="the node of each rank (default: %(default)s)")
    parser.add_argument("--output", type=Path, default=Path("ring_order.png"), help="image to write")
    args = parser.parse_args(argv)
    placement = tuple(int(node) for node in args.placement.split(","))
    if len(set(placement)) < 2:
        parser.error("give ranks on two nodes or more, e.g. --placement 0,1,0,1")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    where = positions(placement)
    rows = max(placement.count(node) for node in set(placement))
    figure, axes = plt.subplots(1, len(ORDERS), figsize=(4.2 * len(ORDERS), 1.3 + 1.1 * rows))
    for ax, name in zip(axes, ORDERS):
        order, links = hops(placement, name)
        crossings = ring_crossings(order, placement)
        for node in sorted(set(placement)):
            ys = [where[r][1] for r, at in enumerate(placement) if at == node]
            ax.add_patch(FancyBboxPatch((3.0 * node - 0.6, min(ys) - 0.5), 1.2, max(ys) - min(ys) + 1.0,
                                        boxstyle="round,pad=0.05", facecolor="#eef3fb", edgecolor="#7d96c4"))
            ax.text(3.0 * node, max(ys) + 0.75, f"node {node}", ha="center", fontsize=10, color="#3b5a8f")
        for src, dst in links:
            crossing = placement[src] != placement[dst]
            ax.add_patch(FancyArrowPatch(
                where[src], where[dst], arrowstyle="-|>", mutation_scale=14, shrinkA=14, shrinkB=14,
                connectionstyle="arc3,rad=0.18", color="#c0392b" if crossing else "#555555",
                linewidth=2.6 if crossing else 1.2,
            ))
        for rank, (x, y) in where.items():
            ax.add_patch(plt.Circle((x, y), 0.28, facecolor="white", edgecolor="black", zorder=3))
            ax.text(x, y, str(rank), ha="center", va="center", fontsize=11, zorder=4)
        ax.set_title(f'ring_order="{name}": {" → ".join(map(str, order))}\n'
                     f"{crossings.total} crossings, {crossings.busiest} leave{'s' if crossings.busiest == 1 else ''} the busiest node", fontsize=10)
        ax.set_xlim(-1.2, 3.0 * max(placement) + 1.2)
        ax.set_ylim(-1.2 * (rows - 1) - 0.9, 1.3)
        ax.set_aspect("equal")
        ax.axis("off")
    figure.tight_layout()
    figure.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
