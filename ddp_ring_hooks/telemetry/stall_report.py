"""Who waits for whom: the ranks' published states, and the rank at the end of the chain.

Pure (no torch): the stall watchdog (:mod:`.stall`) publishes one :class:`RankRecord` per rank
through the process group's store and, when a bucket of its own has waited too long, reads
everyone's and calls :func:`diagnose`. Following "who waits for whom" from the waiting rank
ends at the rank to blame::

    rank 0 --waits for--> rank 2          rank 1 --waits for--> rank 0 --> rank 2
                          rank 2: last report 12 s ago, iteration 20 (forward)  => stalled

The end of the chain is a rank that waits for nobody: **silent** (no report for longer than it
promised: frozen, cut off, dead), or **alive but not in the all-reduce** (stuck in its forward,
in I/O, in a deadlock of its own). Where a wait names no peer (``native``: gloo's own
all-reduce; NCCL), every rank that is silent or not in the all-reduce is named. A chain that
comes back to itself is a deadlock, not a stall; a store that did not answer leaves only this
rank's own view.
"""

from __future__ import annotations

import dataclasses
import json

#: What a rank is doing when a bucket of it is being reduced.
ALL_REDUCE = "all-reduce"


@dataclasses.dataclass(frozen=True)
class RankRecord:
    """What one rank does, as it publishes it (times are wall-clock seconds, ``time.time()``).

    ``doing``: :data:`ALL_REDUCE` while a bucket of it is being reduced, else what its training
    thread last did (``"forward"``, ``"backward"``, ``"after the all-reduce"``); ``since``: when
    that began (the last progress of the bucket); ``reported``: when it was published;
    ``silent_after``: how stale its report may get while it is alive (it promises to publish
    more often); ``attempt``: torchrun's restart count (a report of an earlier attempt is no
    report). While reducing: ``bucket``, ``algorithm``, ``phase``, the schedule step
    ``step_index`` of ``num_steps`` and the ``peer`` (a rank of the group) it waits for
    (``None``: unknown, a collective of the backend's own).
    """

    rank: int
    iteration: int
    doing: str
    since: float
    reported: float
    silent_after: float
    attempt: int = 0
    bucket: int | None = None
    algorithm: str | None = None
    phase: str | None = None
    step_index: int | None = None
    num_steps: int | None = None
    peer: int | None = None

    @property
    def reducing(self) -> bool:
        return self.doing == ALL_REDUCE

    def silent(self, now: float) -> bool:
        """No report for longer than the rank promised: it is frozen, cut off or dead."""
        return now - self.reported > self.silent_after

    def describe(self, now: float) -> str:
        """This rank's state in words, e.g. ``bucket 3 of iteration 20 (reduce-scatter step 1/4)
        has waited 12 s for rank 2``."""
        waited = seconds(now - self.since)
        if not self.reducing:
            return f"has been in iteration {self.iteration} ({self.doing}) for {waited}"
        where = f"bucket {self.bucket} of iteration {self.iteration}"
        if self.step_index is not None:
            where += f" ({self.phase} step {self.step_index + 1}/{self.num_steps})"
        elif self.phase is not None:
            where += f" ({self.algorithm} {self.phase})"
        return f"{where} has waited {waited} " + (f"for rank {self.peer}" if self.peer is not None else "in it")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> RankRecord:
        fields = {field.name for field in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in json.loads(text).items() if name in fields})


@dataclasses.dataclass(frozen=True)
class Finding:
    """What :func:`diagnose` concluded: ``text`` (one line), the ranks it names as ``stalled``
    (none when it cannot tell), the ``chain`` of waits it followed from the waiting rank, and
    whether the store ``answered``."""

    text: str
    stalled: tuple[int, ...]
    chain: tuple[int, ...]
    answered: bool

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def diagnose(me: RankRecord, others: dict[int, RankRecord] | None, *, world_size: int, now: float) -> Finding:
    """Follow who waits for whom from ``me`` (this rank, reducing a bucket) through ``others``
    (every other rank's latest record, by rank; a rank without one has not reported in this
    attempt; ``None``: the store did not answer) and name the rank at the end of the chain."""
    opening = f"rank {me.rank}: {me.describe(now)}"
    if others is None:
        blame = f"rank {me.peer}, or this rank's own network" if me.peer is not None else "a peer, or this rank's own network"
        return Finding(f"{opening}; the store did not answer, so the other ranks' states are unknown: {blame}",
                       (), (me.rank,), answered=False)
    records = {rank: record for rank, record in others.items() if record.attempt == me.attempt and rank != me.rank}
    records[me.rank] = me
    clauses = [opening] + [_clause(rank, records.get(rank), now) for rank in range(world_size) if rank != me.rank]
    chain, verdict, stalled = _follow(me, records, world_size, now)
    return Finding("; ".join(clauses) + f": {verdict}", stalled, chain, answered=True)


def _clause(rank: int, record: RankRecord | None, now: float) -> str:
    if record is None:
        return f"rank {rank} has not reported"
    if record.silent(now):
        return f"rank {rank} has not reported for {seconds(now - record.reported)}, since iteration {record.iteration} ({_last(record)})"
    if record.reducing:
        return f"rank {rank} waits for rank {record.peer}" if record.peer is not None else f"rank {rank} waits in the all-reduce"
    return f"rank {rank} {record.describe(now)}"


def _last(record: RankRecord) -> str:
    """What a silent rank last reported doing, briefly."""
    if not record.reducing:
        return record.doing
    return f"bucket {record.bucket}" + (f", waiting for rank {record.peer}" if record.peer is not None else "")


def _follow(me: RankRecord, records: dict[int, RankRecord], world_size: int, now: float):
    """The chain of waits from ``me``, the verdict in words and the ranks it names."""
    chain = [me.rank]
    record = me
    while record.reducing and record.peer is not None:
        peer = record.peer
        if peer in chain:
            cycle = chain[chain.index(peer):]
            names = ", ".join(map(str, cycle))
            return tuple(chain), f"ranks {names} wait for each other in a cycle: a deadlock, not a stalled rank", ()
        chain.append(peer)
        record = records.get(peer)
        if record is None or record.silent(now) or not record.reducing:
            return tuple(chain), f"rank {peer} is stalled", (peer,)
    # A wait without a peer (the backend's own collective): blame whoever is not in it.
    suspects = tuple(
        rank for rank in range(world_size)
        if records.get(rank) is None or records[rank].silent(now) or not records[rank].reducing
    )
    if not suspects:
        return tuple(chain), "every rank waits in the all-reduce and reports: the transfers themselves are stuck (the network?)", ()
    names = ", ".join(f"rank {rank}" for rank in suspects)
    return tuple(chain), f"{names} {'is' if len(suspects) == 1 else 'are'} stalled", suspects


def seconds(value: float) -> str:
    """A duration as the reports print it: ``2.4 s``, ``12 s``."""
    return f"{value:.1f} s" if value < 10 else f"{value:.0f} s"
