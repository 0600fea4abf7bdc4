"""The bandwidth matrix as a picture: one cell per directed link, named links outlined.

Rows are sources, columns destinations; each cell shows the link's bandwidth in MB/s, and its
colour is that bandwidth over the others' median in its tier (the links no finding explains:
1 is a typical link, dark is slow), so that on two tiers the links between nodes, slower by
design, are not all dark next to the links inside nodes. A link
the verdict names (a slow link, or one of a named rank or node) gets a red frame: a slow
network reads as a red cross, a slow link as one or two red cells. With two tiers, white
lines separate the nodes. matplotlib is imported only here, when a picture is asked for.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

from .matrix import LinkMatrix
from .rule import ALL, LinkVerdict


def plot_heatmap(matrix: LinkMatrix, verdict: LinkVerdict, path: str | Path, *, title: str = "") -> None:
    """Save the heatmap of ``matrix`` with ``verdict``'s findings to ``path`` (PNG, SVG, ...)."""
    try:
        import matplotlib
    except ImportError as error:
        raise RuntimeError("--plot needs matplotlib: pip install 'ddp_ring_hooks[viz]'") from error
    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    p = matrix.world_size
    rows = matrix.rows()
    def typical(link) -> float:
        tier = verdict.tiers[link]
        return verdict.others_Bps[tier] or verdict.tier_medians[tier]

    relative = [[math.nan if b is None else b / typical((s, d)) for d, b in enumerate(row)] for s, row in enumerate(rows)]
    size = min(12.0, 3.0 + 0.6 * p)
    figure, axes = plt.subplots(figsize=(size + 1.5, size))
    image = axes.imshow(relative, cmap="viridis", vmin=0, vmax=1.5)
    figure.colorbar(image, ax=axes, label="bandwidth / the others' median in its tier", shrink=0.8)
    if p <= 16:  # the numbers stay readable
        for src, row in enumerate(rows):
            for dst, value in enumerate(row):
                if value is not None:
                    axes.text(dst, src, f"{value / 1e6:.3g}", ha="center", va="center", fontsize=8,
                              color="white" if relative[src][dst] < 0.75 else "black")
    for src, dst in verdict.named_links():
        axes.add_patch(Rectangle((dst - 0.5, src - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2.5))
    if verdict.nodes is not None and ALL not in verdict.tier_medians:
        for rank in range(1, p):
            if verdict.nodes[rank] != verdict.nodes[rank - 1]:
                axes.axhline(rank - 0.5, color="white", linewidth=1.5)
                axes.axvline(rank - 0.5, color="white", linewidth=1.5)
    axes.set_xticks(range(p))
    axes.set_yticks(range(p))
    axes.set_xlabel("to rank (cells: MB/s, 1e6 bytes per second)")
    axes.set_ylabel("from rank")
    axes.set_title("\n".join(textwrap.wrap(title or verdict.summary_line(), 70)), fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
