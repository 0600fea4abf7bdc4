"""Run a schedule in memory on example numbers, remembering where every partial sum came from.

Each chunk of each rank carries two things: its value, and the set of ranks whose
contribution it already holds (its *provenance*). A reduce adds both; a copy takes both::

    rank 1 holds c0 = 2 {1}     rank 0 sends c0 = 1 {0} and rank 1 adds it
                           ──▶  rank 1 holds c0 = 3 {0,1}

The run goes through :func:`~ddp_ring_hooks.schedules.replay`, the same step semantics the
checker proves and the executor implements, so what the explanation prints and the animation
draws is exactly what the hook executes. The result is a list of :class:`Frame` s: the start,
one frame after each step, and the end (``len(schedule.steps) + 2`` frames).

By default rank ``r`` holds ``r + 1`` in every element (the article's 1, 2, 3, 4), so every
sum is easy to read: ``c2 = 7 {0,2,3}`` is ``1 + 3 + 4``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..schedules import Schedule, Transfer, replay

START = "start"
STEP = "step"
END = "end"


@dataclass(frozen=True, slots=True)
class ChunkState:
    """One chunk on one rank: its value and the ranks whose contributions it holds."""

    value: float
    contributors: frozenset[int]


@dataclass(frozen=True, slots=True)
class Frame:
    """A snapshot of every rank's chunks, and the transfers that led to it.

    ``kind`` is ``"start"`` (before any step), ``"step"`` (after step ``step``) or ``"end"``
    (the final state again, with nothing in flight). ``phase_step`` counts from 1 within the
    phase of ``phase_length`` steps.
    """

    kind: str
    step: int | None
    phase: str
    phase_step: int
    phase_length: int
    transfers: tuple[Transfer, ...]
    state: tuple[tuple[ChunkState, ...], ...]

    @property
    def title(self) -> str:
        """``"reduce-scatter step 2/3"``; ``"start"`` and ``"done"`` for the outer frames."""
        if self.kind == START:
            return "start: every rank holds only its own input"
        if self.kind == END:
            return "done: every rank holds the full sum"
        return f"{self.phase} step {self.phase_step}/{self.phase_length}"


@dataclass(frozen=True, slots=True)
class Simulation:
    """The frames of one in-memory run, and the element count of every chunk."""

    schedule: Schedule
    chunk_elements: tuple[int, ...]
    frames: tuple[Frame, ...]

    @property
    def final(self) -> tuple[tuple[ChunkState, ...], ...]:
        """Every rank's chunks after the last step."""
        return self.frames[-1].state

    def complete_chunks(self, state: tuple[tuple[ChunkState, ...], ...]) -> tuple[tuple[int, ...], ...]:
        """Per rank, the chunks of ``state`` that hold every rank's contribution."""
        everyone = frozenset(range(self.schedule.world_size))
        return tuple(tuple(c for c, chunk in enumerate(chunks) if chunk.contributors == everyone) for chunks in state)


def split_sizes(elements: int, num_chunks: int) -> tuple[int, ...]:
    """Chunk sizes of ``torch.tensor_split(elements, num_chunks)``: the first ones get the extra."""
    if elements < 0:
        raise ValueError(f"the element count must be 0 or more, got {elements}")
    base, extra = divmod(elements, num_chunks)
    return tuple(base + (1 if c < extra else 0) for c in range(num_chunks))


def default_values(world_size: int) -> tuple[int, ...]:
    """Rank ``r`` holds ``r + 1``: sums stay small and name their contributors (1+3+4 = 8)."""
    return tuple(range(1, world_size + 1))


def simulate(
    schedule: Schedule,
    *,
    elements: int | None = None,
    values: Sequence[float] | Sequence[Sequence[float]] | None = None,
) -> Simulation:
    """Run ``schedule`` in memory and return its frames (start, one per step, end).

    ``elements`` is the buffer's element count (default: one element per chunk); it only
    decides the chunk sizes. ``values[r]`` is rank ``r``'s value in every element, or
    ``values[r][c]`` its value in chunk ``c`` (default: :func:`default_values`).
    """
    p, chunks = schedule.world_size, schedule.num_chunks
    sizes = split_sizes(chunks if elements is None else elements, chunks)
    if values is None:
        values = default_values(p)
    if len(values) != p:
        raise ValueError(f"values has {len(values)} entries for {p} ranks; give one per rank")
    initial = [
        [ChunkState(value, frozenset({rank})) for value in _row(values, rank, chunks)]
        for rank in range(p)
    ]
    # Per step: where its phase starts and how many steps the phase has.
    phase_of = {index: (first, stop - first) for _, first, stop in schedule.phases for index in range(first, stop)}
    state = tuple(tuple(row) for row in initial)
    frames = [Frame(START, None, "", 0, 0, (), state)]
    for index, step, state in replay(schedule, initial, _combine):
        first, length = phase_of[index]
        # Sorted, so schedules that list the same transfers in another order give equal frames.
        transfers = tuple(sorted(step.transfers, key=lambda t: (t.src, t.dst, t.chunk)))
        frames.append(Frame(STEP, index, step.phase, index - first + 1, length, transfers, state))
    frames.append(Frame(END, None, "", 0, 0, (), state))
    return Simulation(schedule, sizes, tuple(frames))


def _combine(mine: ChunkState, received: ChunkState) -> ChunkState:
    return ChunkState(mine.value + received.value, mine.contributors | received.contributors)


def _row(values, rank: int, chunks: int) -> list[float]:
    row = values[rank]
    if isinstance(row, (int, float)):
        return [row] * chunks
    if len(row) != chunks:
        raise ValueError(f"values[{rank}] has {len(row)} entries; give one per chunk ({chunks})")
    return list(row)
