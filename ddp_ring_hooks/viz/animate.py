"""Animate a schedule: ranks on the algorithm's layout, chunks as bars, sends as arrows.

Each rank is a box of chunk bars. A bar has one cell per rank, stacked from rank 0 at the
bottom; a cell is coloured in that rank's colour once the chunk holds its contribution, so
a partial sum is a partly filled bar and a complete chunk is a full bar (outlined in black)::

    rank 2               arrows: red  = send, receiver adds  (reduce)
    ▓ ░ ▓ ░   <- rank 3          blue = send, receiver copies (copy)
    ▓ ░ ▓ ▓   <- rank 2
    ░ ░ ▓ ▓   <- rank 1
    ▓ ▓ ▓ ░   <- rank 0
    c0 c1 c2 c3

Frames are those of :func:`~ddp_ring_hooks.viz.simulate.simulate`: the start, one per step
(with that step's arrows and the state after it), and the end. Files: ``.gif`` (Pillow),
``.html`` (matplotlib's JavaScript player, frames embedded) and ``.mp4`` (needs ffmpeg).

matplotlib is imported only here and only when drawing; figures are drawn on an Agg canvas,
so no display is needed and the caller's pyplot backend is left alone.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..progress import progress_bar
from .layout import Layout
from .simulate import END, START, Frame, Simulation

SUFFIXES = (".gif", ".html", ".mp4")
REDUCE_COLOUR = "#c0392b"
COPY_COLOUR = "#2e6fbf"
EMPTY_CELL = "#eeeeee"


def render_animation(
    simulation: Simulation,
    layout: Layout,
    output: str | Path,
    *,
    fps: float = 1.0,
    dpi: int = 80,
    subtitle: str = "",
    progress: bool = True,
) -> Path:
    """Draw every frame of ``simulation`` on ``layout`` and write ``output`` (.gif/.html/.mp4)."""
    output = Path(output)
    if output.suffix.lower() not in SUFFIXES:
        raise ValueError(f"cannot write {output.name!r}: the output must end in {', '.join(SUFFIXES)}")
    if fps <= 0 or dpi < 1:
        raise ValueError(f"fps and dpi must be positive, got fps={fps}, dpi={dpi}")
    writer = _writer_for(output.suffix.lower(), fps)
    figure = new_figure()
    frames = simulation.frames
    bar = progress_bar(len(frames), f"drawing {output.name}", unit="frame", enabled=progress)
    output.parent.mkdir(parents=True, exist_ok=True)
    with writer.saving(figure, str(output), dpi):
        for frame in frames:
            draw_frame(figure, simulation, layout, frame, subtitle=subtitle)
            writer.grab_frame()
            bar.update(1)
    bar.close()
    return output


def new_figure():
    """A figure on its own Agg canvas (no pyplot, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 8))
    FigureCanvasAgg(figure)
    return figure


def draw_frame(figure, simulation: Simulation, layout: Layout, frame: Frame, *, subtitle: str = "") -> None:
    """Clear ``figure`` and draw ``frame``: groups, links, rank boxes with chunk bars, arrows."""
    figure.clear()
    schedule = simulation.schedule
    p = schedule.world_size
    box = _box_size(layout, schedule.num_chunks)
    axes = figure.add_axes((0.02, 0.07, 0.96, 0.83))
    xs = [x for x, _ in layout.positions]
    ys = [y for _, y in layout.positions]
    margin = 0.2 if layout.groups else 0.08
    axes.set_xlim(min(xs) - box[0] / 2 - margin, max(xs) + box[0] / 2 + margin)
    axes.set_ylim(min(ys) - box[1] / 2 - margin - 0.1, max(ys) + box[1] / 2 + margin + 0.1)
    axes.set_aspect("equal")
    axes.axis("off")
    _draw_groups(axes, layout, box)
    for a, b in layout.links:
        (xa, ya), (xb, yb) = layout.positions[a], layout.positions[b]
        axes.plot([xa, xb], [ya, yb], color="#d0d0d0", linewidth=1.0, zorder=0)
    colours = rank_colours(p)
    for rank, chunks in enumerate(frame.state):
        _draw_rank(axes, layout.positions[rank], rank, chunks, simulation.chunk_elements, colours, box)
    for transfer in frame.transfers:
        _draw_transfer(axes, layout, transfer, box)
    steps = len(schedule.steps)
    where = frame.title if frame.kind in (START, END) else f"step {frame.step + 1}/{steps}: {frame.title}"
    figure.suptitle(f"{schedule.algorithm} all-reduce, {p} ranks\n{where}", fontsize=15, y=0.985)
    legend = (
        "bar = chunk; coloured cells = ranks whose contribution it holds (rank 0 at the bottom); "
        "black outline = complete\nred arrow: send, receiver adds (reduce)   blue arrow: send, receiver copies"
    )
    figure.text(0.5, 0.015, (subtitle + "\n" if subtitle else "") + legend, ha="center", va="bottom", fontsize=8.5)


def rank_colours(world_size: int) -> list:
    """One distinct colour per rank (tab10, then tab20, then a colour wheel)."""
    from matplotlib import colormaps

    name = "tab10" if world_size <= 10 else "tab20" if world_size <= 20 else "hsv"
    colormap = colormaps[name]
    if name == "hsv":
        return [colormap(r / world_size) for r in range(world_size)]
    return [colormap(r) for r in range(world_size)]


def _box_size(layout: Layout, num_chunks: int) -> tuple[float, float]:
    """Rank boxes as wide as the closest pair of ranks allows."""
    points = layout.positions
    closest = min(
        (math.dist(a, b) for i, a in enumerate(points) for b in points[i + 1 :]),
        default=1.0,
    )
    width = min(0.9, 0.62 * closest, 0.16 * num_chunks + 0.16)
    return width, min(0.6, 0.42 * closest)


def _draw_groups(axes, layout: Layout, box: tuple[float, float]) -> None:
    from matplotlib.patches import FancyBboxPatch

    width, height = box
    for index, group in enumerate(layout.groups):
        xs = [layout.positions[r][0] for r in group]
        ys = [layout.positions[r][1] for r in group]
        left, bottom = min(xs) - width / 2 - 0.05, min(ys) - height / 2 - 0.12
        right, top = max(xs) + width / 2 + 0.05, max(ys) + height / 2 + 0.1
        axes.add_patch(
            FancyBboxPatch(
                (left, bottom), right - left, top - bottom, boxstyle="round,pad=0.02",
                facecolor="#f7f7f2", edgecolor="#999999", linewidth=1.0, zorder=0,
            )
        )
        axes.text(left + 0.02, top + 0.01, f"node {index}", fontsize=8, color="#666666", va="bottom")


def _draw_rank(axes, position, rank, chunks, chunk_elements, colours, box) -> None:
    from matplotlib.patches import Rectangle

    x, y = position
    width, height = box
    p = len(colours)
    left, bottom = x - width / 2, y - height / 2
    axes.add_patch(Rectangle((left, bottom), width, height, facecolor="white", edgecolor="#555555", linewidth=1.2, zorder=2))
    axes.text(x, y + height / 2 + 0.015, f"rank {rank}", ha="center", va="bottom", fontsize=10, fontweight="bold", zorder=5)
    count = len(chunks)
    pad = 0.1 * width / count
    column = (width - pad) / count - pad
    cell = (height - 2 * pad) / p
    for c, chunk in enumerate(chunks):
        cx = left + pad + c * (column + pad)
        for contributor in range(p):
            held = contributor in chunk.contributors
            axes.add_patch(
                Rectangle(
                    (cx, bottom + pad + contributor * cell), column, cell,
                    facecolor=colours[contributor] if held else EMPTY_CELL, edgecolor="none", zorder=3,
                )
            )
        complete = len(chunk.contributors) == p
        axes.add_patch(
            Rectangle(
                (cx, bottom + pad), column, p * cell, facecolor="none",
                edgecolor="black" if complete else "#bbbbbb", linewidth=1.8 if complete else 0.6,
                linestyle="-" if chunk_elements[c] else ":", zorder=4,
            )
        )
        if count <= 8:
            label = f"c{c}={chunk.value:g}" if count <= 4 and chunk_elements[c] else f"c{c}"
            axes.text(cx + column / 2, bottom - 0.01, label, ha="center", va="top", fontsize=7, color="#444444", zorder=5)


def _draw_transfer(axes, layout: Layout, transfer, box) -> None:
    from matplotlib.patches import FancyArrowPatch

    centre_a, centre_b = layout.positions[transfer.src], layout.positions[transfer.dst]
    start, end = _box_edge(centre_a, centre_b, box), _box_edge(centre_b, centre_a, box)
    reduce = transfer.op.value == "reduce"
    colour = REDUCE_COLOUR if reduce else COPY_COLOUR
    bend = 0.18
    axes.add_patch(
        FancyArrowPatch(
            start, end, connectionstyle=f"arc3,rad={bend}", arrowstyle="-|>,head_length=6,head_width=3.5",
            color=colour, linewidth=2.0, shrinkA=2, shrinkB=2, alpha=0.9, zorder=6,
        )
    )
    # The label sits on the arc's midpoint: a quadratic Bézier through the arc3 control point.
    (x1, y1), (x2, y2) = start, end
    mx, my = (x1 + x2) / 2 + bend * (y2 - y1) / 2, (y1 + y2) / 2 - bend * (x2 - x1) / 2
    axes.text(
        mx, my, f"{'+' if reduce else '='}c{transfer.chunk}", ha="center", va="center", fontsize=8,
        color=colour, fontweight="bold", zorder=7,
        bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": colour, "linewidth": 0.6},
    )


def _box_edge(centre, toward, box) -> tuple[float, float]:
    """Where the straight line from ``centre`` to ``toward`` leaves the rank box."""
    (x, y), (tx, ty) = centre, toward
    dx, dy = tx - x, ty - y
    half_width, half_height = box[0] / 2, box[1] / 2
    scale = min(half_width / abs(dx) if dx else math.inf, half_height / abs(dy) if dy else math.inf)
    if not math.isfinite(scale):
        return centre
    return x + scale * dx, y + scale * dy


def _writer_for(suffix: str, fps: float):
    from matplotlib import animation

    if suffix == ".gif":
        return animation.PillowWriter(fps=fps)
    if suffix == ".html":
        return animation.HTMLWriter(fps=fps, embed_frames=True, default_mode="once")
    if not animation.writers.is_available("ffmpeg"):
        raise RuntimeError("writing .mp4 needs ffmpeg on PATH; install ffmpeg or write a .gif or .html instead")
    return animation.FFMpegWriter(fps=fps)
