"""The schedule IR: an all-reduce algorithm written down as plain, immutable data.

A :class:`Schedule` splits the buffer into ``num_chunks`` chunks (like ``torch.tensor_split``)
and lists :class:`Step` s. In one step every :class:`Transfer` happens at once: ``src`` sends
the value its chunk ``chunk`` had *at the start of the step* to ``dst``, which then either adds
it to its own copy of that chunk (``Op.REDUCE``) or overwrites its copy (``Op.COPY``)::

    step 0  reduce-scatter   0 -c3-> 1   1 -c0-> 2   2 -c1-> 3   3 -c2-> 0   (all REDUCE)

Nothing here imports torch: schedules can be built, checked, printed, costed and animated on
any laptop. The runtime turns a rank's view of a schedule (:meth:`Schedule.plan_for`) into
point-to-point operations.
"""

from __future__ import annotations

import enum
import zlib
from dataclasses import dataclass, field


class Op(str, enum.Enum):
    """What the receiver does with a chunk it receives."""

    REDUCE = "reduce"
    COPY = "copy"


@dataclass(frozen=True, slots=True)
class Transfer:
    """``src`` sends chunk ``chunk`` to ``dst``, which reduces or copies it."""

    src: int
    dst: int
    chunk: int
    op: Op

    def __str__(self) -> str:
        arrow = "+>" if self.op is Op.REDUCE else "=>"
        return f"{self.src} {arrow} {self.dst} c{self.chunk}"


@dataclass(frozen=True, slots=True)
class Step:
    """Transfers that all happen concurrently; ``phase`` names the part of the algorithm."""

    phase: str
    transfers: tuple[Transfer, ...]


@dataclass(frozen=True, slots=True)
class Send:
    """One rank's view of a transfer it sends."""

    peer: int
    chunk: int


@dataclass(frozen=True, slots=True)
class Receive:
    """One rank's view of a transfer it receives."""

    peer: int
    chunk: int
    op: Op


@dataclass(frozen=True, slots=True)
class RankStep:
    """What one rank does in one step: the sends and receives it posts together."""

    phase: str
    sends: tuple[Send, ...]
    receives: tuple[Receive, ...]


@dataclass(frozen=True, slots=True)
class Schedule:
    """An all-reduce over ``world_size`` ranks as a sequence of steps on ``num_chunks`` chunks."""

    algorithm: str
    world_size: int
    num_chunks: int
    steps: tuple[Step, ...]
    #: The options it was built with, resolved (defaults and environment filled in), as sorted
    #: ``(name, value)`` pairs: consumers (cost model, drawings, checks) read them from here.
    options: tuple[tuple[str, object], ...] = ()
    # A cache of plan_for, not part of the value: not compared, hashed, shown or copied.
    _plans: dict[int, tuple[RankStep, ...]] = field(
        default_factory=dict, init=False, compare=False, hash=False, repr=False
    )
    # A cache of digest, likewise.
    _digests: list[int] = field(default_factory=list, init=False, compare=False, hash=False, repr=False)
    # A cache of links, likewise.
    _links: list[frozenset[tuple[int, int]]] = field(
        default_factory=list, init=False, compare=False, hash=False, repr=False
    )

    @property
    def phases(self) -> tuple[tuple[str, int, int], ...]:
        """Consecutive runs of steps with the same phase, as ``(name, first, stop)``."""
        runs: list[tuple[str, int, int]] = []
        for index, step in enumerate(self.steps):
            if runs and runs[-1][0] == step.phase:
                runs[-1] = (step.phase, runs[-1][1], index + 1)
            else:
                runs.append((step.phase, index, index + 1))
        return tuple(runs)

    def plan_for(self, rank: int) -> tuple[RankStep, ...]:
        """The steps as seen by ``rank``: per step, what it sends and what it receives.

        Computed once per rank and kept on the schedule: the executor asks for it on every
        bucket, and hashing a schedule of thousands of transfers per call would cost a
        millisecond at 64 ranks.
        """
        plan = self._plans.get(rank)
        if plan is None:
            plan = self._plans.setdefault(rank, _plan_for(self, rank))
        return plan


    def links(self) -> frozenset[tuple[int, int]]:
        """Every directed link ``(src, dst)`` the schedule sends on, in any step."""
        if not self._links:
            self._links.append(frozenset((t.src, t.dst) for step in self.steps for t in step.transfers))
        return self._links[0]

    def digest(self) -> int:
        """A 32-bit checksum of the whole schedule, the same in every process (``hash`` is
        salted per process for strings), for ranks to check they will run the same steps.
        Computed once: 10 ms for a ring of 64 ranks."""
        if not self._digests:
            self._digests.append(zlib.crc32(repr((self.algorithm, self.world_size, self.num_chunks, self.steps)).encode()))
        return self._digests[0]


def _plan_for(schedule: Schedule, rank: int) -> tuple[RankStep, ...]:
    if not 0 <= rank < schedule.world_size:
        raise ValueError(f"rank {rank} is outside the schedule's world of {schedule.world_size} ranks")
    return tuple(
        RankStep(
            phase=step.phase,
            sends=tuple(Send(t.dst, t.chunk) for t in step.transfers if t.src == rank),
            receives=tuple(Receive(t.src, t.chunk, t.op) for t in step.transfers if t.dst == rank),
        )
        for step in schedule.steps
    )
