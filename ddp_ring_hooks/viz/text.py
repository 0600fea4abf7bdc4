"""The step-by-step explanation of a schedule, as plain text for terminals and docs.

For every frame of a :func:`~ddp_ring_hooks.viz.simulate.simulate` run it prints the sends of
the step and every rank's chunks, each as ``value {contributing ranks}``::

    step 2/6 - reduce-scatter step 2/3
      sends    0 +> 1 c2   1 +> 2 c3   2 +> 3 c0   3 +> 0 c1
      rank 0   c0=1 {0}      c1=9 {0,2,3}  c2=7 {2,3}    c3=4 {3}
      ...

``a +> b c2`` means rank ``a`` sends chunk 2 and rank ``b`` adds it to its own; ``a => b c2``
means ``b`` overwrites its chunk 2 with it. A ``*`` marks a chunk that holds every rank's
contribution. At the end of each phase a line says which ranks hold complete chunks: after
ring reduce-scatter each rank holds ONE complete chunk and partial sums in the others (not,
as often drawn, one rank with the total and the others with 0).
"""

from __future__ import annotations


from .. import cost_model
from ..schedules import WIRE_BYTES, Schedule, is_narrow, schedule_order, wire_of
from .simulate import END, START, ChunkState, Frame, Simulation


def explain(
    simulation: Simulation,
    *,
    element_size: int = 4,
    alpha: float,
    beta: float,
) -> str:
    """The whole explanation: header, every frame, the final check and the cost summary."""
    schedule = simulation.schedule
    lines = _header(simulation)
    phase_ends = {stop - 1 for _, _, stop in schedule.phases}
    for frame in simulation.frames:
        lines += ["", *format_frame(simulation, frame)]
        if frame.kind != START and frame.kind != END and frame.step in phase_ends:
            lines.append(_phase_summary(simulation, frame))
    lines += ["", _result(simulation), "", *format_cost(simulation, element_size=element_size, alpha=alpha, beta=beta)]
    return "\n".join(lines) + "\n"


def format_frame(simulation: Simulation, frame: Frame) -> list[str]:
    """The lines of one frame: its title, the sends of its step, then one line per rank."""
    total = len(simulation.schedule.steps)
    if frame.kind == START or frame.kind == END:
        lines = [frame.title]
    else:
        lines = [f"step {frame.step + 1}/{total} - {frame.title}"]
        lines.append("  sends    " + "   ".join(str(t) for t in frame.transfers))
    p = simulation.schedule.world_size
    cells = [[_format_chunk(c, chunk, simulation.chunk_elements[c], p) for c, chunk in enumerate(chunks)] for chunks in frame.state]
    widths = [max(len(row[c]) for row in cells) for c in range(simulation.schedule.num_chunks)]
    label = len(f"rank {p - 1}")
    for rank, row in enumerate(cells):
        text = "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
        lines.append(f"  {f'rank {rank}'.ljust(label)}   {text}")
    return lines


def format_cost(
    simulation: Simulation,
    *,
    element_size: int,
    alpha: float,
    beta: float,
) -> list[str]:
    """Steps, bytes sent per rank and α-β time of one all-reduce of this buffer.

    The numbers come from :mod:`ddp_ring_hooks.cost_model`: stepped through the schedule
    (what the executor runs) and, where the algorithm has one, its closed form.
    The closed form takes the options the schedule was built with (``schedule.options``).
    """
    schedule = simulation.schedule
    nbytes = sum(simulation.chunk_elements) * element_size
    sent = cost_model.bytes_sent_per_rank(schedule, nbytes)
    per_rank = ", ".join(f"rank {rank}: {format_bytes(b)}" for rank, b in enumerate(sent))
    stepped = cost_model.simulate(schedule, nbytes, alpha=alpha, beta=beta)
    try:
        closed = cost_model.predict(schedule.algorithm, nbytes, schedule.world_size, alpha=alpha, beta=beta, **dict(schedule.options))
    except (TypeError, ValueError):  # an algorithm (or option) the formulas do not cover
        closed = None
    uneven = len(set(simulation.chunk_elements)) > 1
    wire = [] if not is_narrow(schedule.options) else [format_wire(schedule, element_size=element_size)]
    return [*wire,
        f"cost of one all-reduce of {format_bytes(nbytes)} per rank, α-β model "
        f"(α = {format_seconds(alpha)} per step, β = {format_seconds(beta)} per byte):",
        f"  steps        {cost_model.count_steps(schedule)}",
        f"  bytes sent   {per_rank}"
        + (f"  (busiest rank: {max(sent) / nbytes:.2f} x the buffer)" if nbytes else "")
        + (f"  ({WIRE_BYTES[wire_of(schedule.options)] / element_size:.2f}x that on the wire)" if wire else "")
        + ("  (as if chunks were even)" if uneven else ""),
        f"  time         {format_seconds(stepped)} stepping through the schedule"
        + (f", {format_seconds(closed)} by the closed-form formula" if closed is not None else ""),
    ]


def format_wire(schedule: Schedule, *, element_size: int) -> str:
    """What the transfers carry when the schedule's wire dtype is narrower than the buffer."""
    wire = wire_of(schedule.options)
    return (
        f"{wire} on the wire: every chunk travels as {wire} ({WIRE_BYTES[wire]} bytes per element, "
        f"{WIRE_BYTES[wire] / element_size:.2f}x the bytes of {element_size}-byte elements); each rank adds a "
        f"received partial sum in the buffer's dtype and sends it rounded to {wire} once, and the rank that "
        f"completes a chunk rounds it too, so every rank ends with the same {wire} values"
    )


def format_ring_order(schedule: Schedule) -> str:
    """``"ring order 0, 2, 1, 3: ..."`` when the rings visit the ranks in another order than
    their numbers (the schedule's ring order), else ``""``."""
    order = schedule_order(schedule)
    if order == tuple(range(schedule.world_size)):
        return ""
    return (
        f"ring order {', '.join(map(str, order))}: the rings visit the ranks in this order, "
        f"not {', '.join(map(str, range(schedule.world_size)))}"
    )


def format_bytes(count: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def format_seconds(seconds: float) -> str:
    """``2.5e-05`` -> ``"25 µs"``."""
    if seconds == 0:
        return "0 s"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-12:.3g} ps"


def format_ranks(ranks: frozenset[int]) -> str:
    """``frozenset({3, 0, 2})`` -> ``"{0,2,3}"``."""
    return "{" + ",".join(str(r) for r in sorted(ranks)) + "}"


def _format_chunk(index: int, chunk: ChunkState, elements: int, world_size: int) -> str:
    if not elements:
        return f"c{index} empty"
    mark = "*" if len(chunk.contributors) == world_size else ""
    return f"c{index}={chunk.value:g} {format_ranks(chunk.contributors)}{mark}"


def _header(simulation: Simulation) -> list[str]:
    schedule = simulation.schedule
    p = schedule.world_size
    first = simulation.frames[0].state
    values = [row[0].value for row in first]
    sizes = sorted(set(simulation.chunk_elements))
    size_text = f"{sizes[0]} element{'s' if sizes[0] != 1 else ''} each" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]} elements"
    phases = ", then ".join(f"{name} ({stop - start} steps)" for name, start, stop in schedule.phases) or "no steps"
    order = format_ring_order(schedule)
    return [
        f"{schedule.algorithm} all-reduce on {p} ranks: {schedule.num_chunks} chunk{'s' if schedule.num_chunks != 1 else ''} ({size_text}), "
        f"{len(schedule.steps)} steps: {phases}",
        *([order] if order else []),
        "rank r starts with r + 1 in every element; the sum every rank must end with is "
        f"{' + '.join(f'{v:g}' for v in values)} = {sum(values):g}"
        if values == list(range(1, p + 1))
        else f"rank inputs {', '.join(f'{v:g}' for v in values)}",
        "each chunk shows value {ranks whose contribution it holds}; * marks a complete chunk",
        "a +> b cK: a sends chunk K and b adds it; a => b cK: b overwrites its chunk K with it",
    ]


def _phase_summary(simulation: Simulation, frame: Frame) -> str:
    complete = simulation.complete_chunks(frame.state)
    if all(len(chunks) == simulation.schedule.num_chunks for chunks in complete):
        return f"  -> end of {frame.phase}: every rank holds every chunk complete"
    holders = "; ".join(
        f"rank {rank}: {' '.join(f'c{c}' for c in chunks) or 'none'}" for rank, chunks in enumerate(complete)
    )
    line = f"  -> end of {frame.phase}: complete chunks per rank: {holders}"
    if all(len(chunks) == 1 for chunks in complete) and simulation.schedule.num_chunks > 1:
        line += (
            "\n     each rank holds ONE fully reduced chunk and partial sums in the others"
            ' (not "one rank holds the total, the others 0")'
        )
    return line


def _result(simulation: Simulation) -> str:
    p = simulation.schedule.world_size
    final = simulation.final
    if not any(simulation.chunk_elements):
        return "result: the buffer is empty, so nothing moves (the executor returns at once)"
    values = {chunk.value for row in final for chunk, n in zip(row, simulation.chunk_elements) if n}
    everyone = all(len(chunk.contributors) == p for row in final for chunk in row)
    if len(values) == 1 and everyone:
        return f"result: every rank holds {values.pop():g} in every element, with the contributions of all {p} ranks"
    return f"result: NOT an all-reduce: final values {sorted(values)}"
