"""Record the point-to-point operations the executor really ran, and rebuild the schedule.

A :class:`TraceRecorder` is an :class:`~ddp_ring_hooks.runtime.observer.ExecutionObserver`:
pass it to ``all_reduce(..., observer=recorder)`` (or anything that runs the executor) and
it writes down, for every step of every all-reduce, what this rank sent and received::

    rank 1, run 0, step 0 (reduce-scatter):  send c0 (40 B) to 2    receive c3 (40 B) from 0, reduce

Each rank saves its own recording (JSON, :func:`save_recordings`). Loaded together,
:func:`schedule_from_recordings` pairs every receive with the matching send of its peer and
rebuilds the :class:`~ddp_ring_hooks.schedules.Schedule` that ran, which the explainer and
the animation replay like any other: ``ddp-ring-hooks animate --trace rank*.json``.

A chunk with 0 bytes (an empty chunk of a small buffer) is recorded with ``bytes = 0``:
the executor posted nothing for it, but it is still part of the schedule.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..schedules import Op, RankStep, Schedule, Step, Transfer
from .observer import ExecutionObserver

FORMAT = "ddp_ring_hooks.trace"
VERSION = 1


class TraceError(ValueError):
    """Recordings that cannot be read, or that do not fit together into one schedule."""


@dataclass(frozen=True, slots=True)
class RecordedOp:
    """One send or receive: the peer (a rank of the group), the chunk, its bytes and, for a
    receive, whether it was reduced or copied."""

    kind: str  # "send" or "receive"
    peer: int
    chunk: int
    bytes: int
    op: str | None = None  # "reduce" / "copy" for receives


@dataclass(frozen=True, slots=True)
class RecordedStep:
    """What one rank posted in one step of one all-reduce."""

    index: int
    phase: str
    ops: tuple[RecordedOp, ...]


@dataclass(frozen=True, slots=True)
class RecordedRun:
    """One all-reduce as one rank saw it: the chunk sizes and its steps."""

    chunk_bytes: tuple[int, ...]
    steps: tuple[RecordedStep, ...]


@dataclass(frozen=True, slots=True)
class RankRecording:
    """Every all-reduce one rank ran while recording."""

    rank: int
    world_size: int
    algorithm: str
    options: Mapping[str, object] = field(default_factory=dict)
    runs: tuple[RecordedRun, ...] = ()


class TraceRecorder(ExecutionObserver):
    """Records each step the executor completes on this rank; one :class:`RecordedRun` per call.

    ``rank`` and ``world_size`` default to this process's rank and size in ``group``.
    ``algorithm`` and ``options`` are only labels for whoever replays the recording (which
    layout to draw); the steps themselves are what the executor ran.

    Example::

        >>> recorder = TraceRecorder(algorithm="ring")
        >>> ddp_ring_hooks.all_reduce(tensor, algorithm="ring", observer=recorder)
        >>> save_recordings([recorder.recording()], f"trace.rank{dist.get_rank()}.json")
    """

    def __init__(
        self,
        *,
        algorithm: str,
        options: Mapping[str, object] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        group=None,
    ) -> None:
        if rank is None or world_size is None:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise RuntimeError("TraceRecorder needs rank= and world_size= when torch.distributed is not initialized")
            rank = dist.get_rank(group) if rank is None else rank
            world_size = dist.get_world_size(group) if world_size is None else world_size
        self.rank, self.world_size = rank, world_size
        self.algorithm, self.options = algorithm, dict(options or {})
        self._runs: list[RecordedRun] = []
        self._steps: list[RecordedStep] = []
        self._chunk_bytes: tuple[int, ...] = ()

    def on_step(self, index: int, step: RankStep, chunk_bytes: Sequence[int]) -> None:
        """Write down this step's sends and receives with the bytes of their chunks."""
        self._chunk_bytes = tuple(chunk_bytes)
        ops = [RecordedOp("send", s.peer, s.chunk, chunk_bytes[s.chunk]) for s in step.sends]
        ops += [RecordedOp("receive", r.peer, r.chunk, chunk_bytes[r.chunk], r.op.value) for r in step.receives]
        self._steps.append(RecordedStep(index, step.phase, tuple(ops)))

    def on_finish(self) -> None:
        """Close this all-reduce's run (a run without steps: world size 1 or an empty buffer)."""
        self._runs.append(RecordedRun(self._chunk_bytes, tuple(self._steps)))
        self._steps, self._chunk_bytes = [], ()

    def recording(self) -> RankRecording:
        """Everything recorded so far, as plain frozen data."""
        return RankRecording(self.rank, self.world_size, self.algorithm, dict(self.options), tuple(self._runs))


def save_recordings(recordings: Iterable[RankRecording], path: str | Path) -> Path:
    """Write recordings (one rank's, or several merged) to a JSON trace file."""
    path = Path(path)
    document = {"format": FORMAT, "version": VERSION, "recordings": [asdict(r) for r in recordings]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1))
    return path


def load_recordings(paths: Iterable[str | Path]) -> tuple[RankRecording, ...]:
    """Read every recording from the given trace files, sorted by rank."""
    recordings: list[RankRecording] = []
    for path in paths:
        try:
            document = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise TraceError(f"cannot read trace {path}: {error}") from None
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            raise TraceError(f"{path} is not a ddp_ring_hooks trace (no \"format\": {FORMAT!r}); record one with TraceRecorder")
        if document.get("version") != VERSION:
            raise TraceError(f"{path} is trace version {document.get('version')}; this version reads {VERSION}")
        recordings += [_recording_from_dict(item, path) for item in document["recordings"]]
    return tuple(sorted(recordings, key=lambda r: r.rank))


def schedule_from_recordings(recordings: Sequence[RankRecording], *, run: int = 0) -> Schedule:
    """Rebuild the schedule of all-reduce number ``run`` from every rank's recording.

    Every receive must match a send of its peer in the same step, with the same chunk and
    bytes; otherwise the recordings are not from one run and :class:`TraceError` says where.
    """
    if not recordings:
        raise TraceError("no recordings given; pass the trace file of every rank")
    first = recordings[0]
    p = first.world_size
    ranks = sorted(r.rank for r in recordings)
    if ranks != list(range(p)):
        raise TraceError(f"recordings are from ranks {ranks}, but a {p}-rank run needs one from each of 0..{p - 1}")
    for recording in recordings:
        if (recording.world_size, recording.algorithm) != (p, first.algorithm):
            raise TraceError(f"rank {recording.rank} recorded a different run ({recording.algorithm} on {recording.world_size} ranks)")
        if not 0 <= run < len(recording.runs):
            raise TraceError(f"rank {recording.rank} recorded {len(recording.runs)} all-reduce(s); run {run} is not one of them")
    runs = [recording.runs[run] for recording in sorted(recordings, key=lambda r: r.rank)]
    lengths = {len(r.steps) for r in runs}
    if len(lengths) != 1:
        raise TraceError(f"ranks recorded different step counts for run {run}: {[len(r.steps) for r in runs]}")
    num_chunks = max((len(r.chunk_bytes) for r in runs), default=0) or 1
    steps = [_rebuild_step(runs, index) for index in range(lengths.pop())]
    return Schedule(first.algorithm, p, num_chunks, tuple(steps), options=tuple(sorted(first.options.items())))


def _rebuild_step(runs: Sequence[RecordedRun], index: int) -> Step:
    sends = {
        (rank, op.peer, op.chunk): op.bytes
        for rank, run in enumerate(runs)
        for op in run.steps[index].ops
        if op.kind == "send"
    }
    transfers = []
    for rank, run in enumerate(runs):
        for op in run.steps[index].ops:
            if op.kind != "receive":
                continue
            sent = sends.pop((op.peer, rank, op.chunk), None)
            if sent != op.bytes:
                raise TraceError(
                    f"step {index}: rank {rank} received chunk {op.chunk} ({op.bytes} B) from rank {op.peer}, "
                    f"which recorded {'no such send' if sent is None else f'sending {sent} B'}"
                )
            transfers.append(Transfer(op.peer, rank, op.chunk, Op(op.op)))
    if sends:
        (src, dst, chunk), _ = next(iter(sends.items()))
        raise TraceError(f"step {index}: rank {src} sent chunk {chunk} to rank {dst}, which recorded no such receive")
    phases = {run.steps[index].phase for run in runs}
    if len(phases) != 1:
        raise TraceError(f"step {index}: ranks disagree on the phase: {sorted(phases)}")
    # The schedule lists transfers by sender, as the builders do, so replays read the same.
    return Step(phases.pop(), tuple(sorted(transfers, key=lambda t: (t.src, t.dst, t.chunk))))


def _recording_from_dict(item: Mapping, path) -> RankRecording:
    try:
        runs = tuple(
            RecordedRun(
                tuple(run["chunk_bytes"]),
                tuple(
                    RecordedStep(step["index"], step["phase"], tuple(RecordedOp(**op) for op in step["ops"]))
                    for step in run["steps"]
                ),
            )
            for run in item["runs"]
        )
        return RankRecording(item["rank"], item["world_size"], item["algorithm"], dict(item.get("options", {})), runs)
    except (KeyError, TypeError) as error:
        raise TraceError(f"{path}: a recording is missing a field or has a wrong one ({error})") from None
