"""Who waits for whom: the ranks' published states, and what the rank at the end of the chain is doing.

Pure (no torch): the stall watchdog (:mod:`.stall`) publishes one :class:`RankRecord` per rank
through the process group's store and, while a bucket of its own waits long, reads everyone's,
places them on its own clock (:class:`Sightings`) and calls :func:`diagnose`. Following "who
waits for whom" from the waiting rank ends at the rank that decides the verdict::

    rank 0 --waits for--> rank 2          rank 1 --waits for--> rank 0 --> rank 2
                          rank 2: record unchanged for 12 of my seconds      => stalled
                          rank 2: reports, "after the all-reduce" for 65 s   => busy

1. **Alive is reporting.** Every record carries a sequence number that its rank's watchdog
   bumps at every publish (at least every few polls). A rank whose number has not changed for
   longer than it promised (``silent_after``), measured in the *reader's* seconds, stopped
   reporting: frozen, cut off or dead. No other host's clock is read: every time in a record
   is placed on the reader's monotonic clock when the reader first sees that number.
2. **Silent is checked with the kernel, where it can be.** A rank's Python thread cannot
   report while another thread holds the GIL (pickling a large checkpoint). For a rank on the
   reader's own host (same boot, PID and network namespaces) the watchdog asks ``/proc``
   (:mod:`.liveness`) and fills in ``process``: ``stopped`` (SIGSTOP, job control),
   ``traced`` (a debugger), ``dead``, ``idle`` (asleep: hung) are stalled; ``running`` (on a
   CPU) is busy.
3. **The end of the chain** is a rank that waits for nobody:

   - **stalled**: silent (and not found running), or never reported: the only verdict that
     lets ``stall_timeout`` abort the job;
   - **busy**: alive and outside the all-reduce (a checkpoint, an evaluation, a cold
     ``torch.compile``): ``rank 0 is busy outside the all-reduce (iteration 99, 65 s)``;
   - **paused**: it said so (``HookState.paused``): planned, no verdict at all.

   Where a wait names no peer (``native``: the backend's own all-reduce, which shows no
   progress), every rank not in it is judged; when every rank is in it and reports, the data
   is moving (or the network is stuck): not a stall. A chain that comes back to itself is a
   transfer between reporting ranks, not a stalled rank. A store that did not answer leaves
   only this rank's own view (and counts as a stall: nobody vouched for anyone).
4. **Bounded text.** Up to :data:`LIST_EVERY_RANK_UP_TO` ranks every rank gets a clause; above,
   the chain (its two ends), the ranks named, and counts of the rest: under 1 KB at p = 64.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

#: What a rank is doing when a bucket of it is being reduced.
ALL_REDUCE = "all-reduce"
#: The verdicts of a finding (:attr:`Finding.kind`).
STALLED, BUSY, PAUSED, IN_FLIGHT, CYCLE, NO_ANSWER = "stalled", "busy", "paused", "in flight", "cycle", "no answer"
#: What ``/proc`` shows of a silent rank on the reader's host, and whether it is stalled.
PROCESS_STALLED = {"stopped": "its process is stopped (SIGSTOP, job control)", "traced": "its process is stopped by a debugger",
                   "dead": "its process is gone", "idle": "its process sleeps and reports nothing: hung"}
#: Worlds up to this size get a clause per rank; larger ones the chain's ends and counts.
LIST_EVERY_RANK_UP_TO = 8
#: The most ranks one finding names one by one (the rest are counted).
MOST_NAMED = 6


@dataclasses.dataclass(frozen=True)
class RankRecord:
    """What one rank does, as it publishes it.

    Times are monotonic seconds on *one* clock: the publisher's own in the store, the reader's
    after :meth:`Sightings.place` (``reported``: when the reader first saw this ``seq``;
    ``since`` moved by as much). ``doing``: :data:`ALL_REDUCE` while a bucket of it is being
    reduced, else what its training thread last did (``"forward"``, ``"backward"``, ``"after
    the all-reduce"``); ``since``: when that began (the last progress of the bucket);
    ``silent_after``: how long its ``seq`` may stay unchanged while it is alive (it promises to
    publish more often); ``attempt``: torchrun's restart count (a report of an earlier attempt
    is no report); ``seq``: its publishes so far; ``paused``: why it said it is away on
    purpose (``HookState.paused``), else ``None``. While reducing: ``bucket``, ``algorithm``,
    ``phase``, the schedule step ``step_index`` of ``num_steps`` and the ``peer`` (a rank of
    the group) it waits for (``None``: unknown, a collective of the backend's own). Who it is
    on its host: ``pid``, ``host`` (its kernel and namespaces, :func:`.liveness.host_identity`)
    and ``started`` (the process's start, in clock ticks since boot), so a reader on the same
    host can ask the kernel; ``process``: what the reader found there (never published).
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
    seq: int = 0
    paused: str | None = None
    pid: int | None = None
    host: int | None = None
    started: int | None = None
    process: str | None = None

    @property
    def reducing(self) -> bool:
        return self.doing == ALL_REDUCE

    def silent(self, now: float) -> bool:
        """No new report for longer than the rank promised: frozen, cut off, dead (or, on
        another host, holding the GIL: see :attr:`process`)."""
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
        published = dataclasses.asdict(self)
        del published["process"]  # the reader's finding, not the rank's
        return json.dumps(published, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> RankRecord:
        fields = {field.name for field in dataclasses.fields(cls)} - {"process"}
        return cls(**{name: value for name, value in json.loads(text).items() if name in fields})


class Sightings:
    """Every other rank's record on *this* rank's monotonic clock.

    A record's ``reported`` becomes the moment this rank first saw its ``(attempt, seq)``, and
    its ``since`` keeps its distance to it (a duration on the publisher's clock: clocks of two
    hosts differ by an offset, their seconds hardly). So "silent" means "its number has not
    changed for N of my seconds", whatever the other host's clock says."""

    def __init__(self) -> None:
        self._first: dict[int, tuple[tuple[int, int], float]] = {}

    def place(self, records: dict[int, RankRecord], *, seen_at: float) -> dict[int, RankRecord]:
        """``records`` (as read from the store at ``seen_at``, this rank's monotonic time) with
        their times on this rank's clock."""
        placed = {}
        for rank, record in records.items():
            number = (record.attempt, record.seq)
            known = self._first.get(rank)
            if known is None or known[0] != number:
                known = self._first[rank] = (number, seen_at)
            first = known[1]
            placed[rank] = dataclasses.replace(record, reported=first, since=first - (record.reported - record.since))
        return placed


@dataclasses.dataclass(frozen=True)
class Finding:
    """What :func:`diagnose` concluded: ``text`` (one line, bounded), its ``kind`` (one of
    :data:`STALLED`, :data:`BUSY`, :data:`PAUSED`, :data:`IN_FLIGHT`, :data:`CYCLE`,
    :data:`NO_ANSWER`), the ranks it names as ``stalled``, ``busy`` and ``paused``, the
    ``chain`` of waits it followed from the waiting rank, and whether the store ``answered``."""

    text: str
    stalled: tuple[int, ...]
    chain: tuple[int, ...]
    answered: bool
    kind: str = STALLED
    busy: tuple[int, ...] = ()
    paused: tuple[int, ...] = ()

    @property
    def aborts(self) -> bool:
        """Whether ``stall_timeout`` may fail the job on it: a rank stopped reporting, or nobody
        could be asked. A busy or paused rank, moving data, a cycle of reporting ranks: the
        group's own timeout decides."""
        return self.kind in (STALLED, NO_ANSWER)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "aborts": self.aborts}


def diagnose(me: RankRecord, others: dict[int, RankRecord] | None, *, world_size: int, now: float) -> Finding:
    """Follow who waits for whom from ``me`` (this rank, reducing a bucket) through ``others``
    (every other rank's latest record, by rank, on this rank's clock; a rank without one has
    not reported in this attempt; ``None``: the store did not answer) and judge the rank at
    the end of the chain (see the module docstring). ``now``: this rank's monotonic time."""
    opening = f"rank {me.rank}: {me.describe(now)}"
    if others is None:
        blame = f"rank {me.peer}, or this rank's own network" if me.peer is not None else "a peer, or this rank's own network"
        return Finding(f"{opening}; the store did not answer, so the other ranks' states are unknown: {blame}",
                       (), (me.rank,), answered=False, kind=NO_ANSWER)
    records = {rank: record for rank, record in others.items() if record.attempt == me.attempt and rank != me.rank}
    records[me.rank] = me
    judged = _Judge(records, now)
    chain, kind, named, verdict = _follow(me, judged, world_size)
    clauses = _clauses(me, chain, named, judged, world_size)
    by_kind = {k: tuple(rank for rank in named if judged.kind(rank) == k) for k in (STALLED, BUSY, PAUSED)}
    return Finding("; ".join([opening, *clauses]) + f": {verdict}", by_kind[STALLED], chain, answered=True, kind=kind,
                   busy=by_kind[BUSY], paused=by_kind[PAUSED])


class _Judge:
    """Each rank's standing, from its record (on the reader's clock) at ``now``."""

    def __init__(self, records: dict[int, RankRecord], now: float) -> None:
        self.records = records
        self.now = now

    def kind(self, rank: int) -> str | None:
        """:data:`STALLED`, :data:`BUSY`, :data:`PAUSED`, or ``None``: reporting from inside
        the all-reduce."""
        record = self.records.get(rank)
        if record is None or record.process in PROCESS_STALLED:
            return STALLED
        if record.silent(self.now) and record.process != "running":
            return PAUSED if record.paused is not None else STALLED
        if record.paused is not None:
            return PAUSED
        if record.silent(self.now) or not record.reducing:
            return BUSY  # reporting, elsewhere; or silent while the kernel sees it on a CPU
        return None

    def verdict(self, rank: int) -> str:
        record = self.records.get(rank)
        kind = self.kind(rank)
        if kind == STALLED:
            return f"rank {rank} is stalled"
        where = f"iteration {record.iteration}, {seconds(self.now - record.since)}"
        if kind == PAUSED:
            return f"rank {rank} is paused ({record.paused}) outside the all-reduce ({where})"
        if record.silent(self.now):
            where += "; not reporting, but its process runs on this host: holding Python's GIL?"
        outside = "" if record.reducing else " outside the all-reduce"
        return f"rank {rank} is busy{outside} ({where})"

    def clause(self, rank: int) -> str:
        record, now = self.records.get(rank), self.now
        if record is None:
            return f"rank {rank} has not reported"
        found = f" ({PROCESS_STALLED[record.process]})" if record.process in PROCESS_STALLED else ""
        if record.silent(now):
            return (f"rank {rank} has not reported for {seconds(now - record.reported)}, since iteration "
                    f"{record.iteration} ({_last(record)}){found}")
        if record.reducing:
            waits = f"rank {rank} waits for rank {record.peer}" if record.peer is not None else f"rank {rank} waits in the all-reduce"
            return waits + found
        return f"rank {rank} {record.describe(now)}{found}"


def _last(record: RankRecord) -> str:
    """What a silent rank last reported doing, briefly."""
    if not record.reducing:
        return record.doing
    return f"bucket {record.bucket}" + (f", waiting for rank {record.peer}" if record.peer is not None else "")


def _follow(me: RankRecord, judged: _Judge, world_size: int) -> tuple[tuple[int, ...], str, tuple[int, ...], str]:
    """The chain of waits from ``me``, the finding's kind, the ranks it names, the verdict in words."""
    chain = [me.rank]
    record = me
    while record.reducing and record.peer is not None:
        peer = record.peer
        if peer in chain:
            names = ", ".join(map(str, chain[chain.index(peer):]))
            return (tuple(chain), CYCLE, (),
                    f"ranks {names} wait for each other in a cycle, each reporting: a transfer in flight between them "
                    "(a slow link?) or a deadlock, not a stalled rank")
        chain.append(peer)
        kind = judged.kind(peer)
        if kind is not None:
            return tuple(chain), kind, (peer,), judged.verdict(peer)
        record = judged.records[peer]
    # A wait without a peer (the backend's own collective): judge whoever is not in it.
    suspects = [rank for rank in range(world_size) if judged.kind(rank) is not None]
    if not suspects:
        return (tuple(chain), IN_FLIGHT, (),
                "every rank waits in the all-reduce and reports: the transfers themselves are stuck or slow "
                "(the network?), not a stalled rank")
    kinds = {rank: judged.kind(rank) for rank in suspects}
    kind = next(k for k in (STALLED, BUSY, PAUSED) if k in kinds.values())
    named = tuple(rank for rank in suspects if kinds[rank] == kind)
    shown = [judged.verdict(rank) for rank in named[:MOST_NAMED]]
    if kind == STALLED:
        ranks = ", ".join(f"rank {rank}" for rank in named[:MOST_NAMED])
        verdict = f"{ranks} {'is' if len(named) == 1 else 'are'} stalled"
    else:
        verdict = "; ".join(shown)
    if len(named) > MOST_NAMED:
        verdict += f" (and {len(named) - MOST_NAMED} more ranks)"
    return tuple(chain), kind, named, verdict


def _clauses(me: RankRecord, chain: tuple[int, ...], named: tuple[int, ...], judged: _Judge, world_size: int) -> list[str]:
    """The other ranks in words: every one in a small world; in a large one the chain's two
    ends, the ranks named and a count of the rest (the message stays bounded)."""
    if world_size <= LIST_EVERY_RANK_UP_TO:
        return [judged.clause(rank) for rank in range(world_size) if rank != me.rank]
    waits = list(chain[1:])
    if len(waits) > 4:  # the chain's two ends: where the wait starts, and whom it ends at
        waits = [*waits[:2], None, *waits[-2:]]
    clauses = [judged.clause(rank) if rank is not None else f"... ({len(chain) - 5} more waits) ..." for rank in waits]
    told = {me.rank, *chain}
    for rank in named[:MOST_NAMED]:
        if rank not in told:
            clauses.append(judged.clause(rank))
            told.add(rank)
    rest = Counter(_standing(judged, rank) for rank in range(world_size) if rank not in told)
    if rest:
        counts = ", ".join(f"{count} {what}" for what, count in rest.most_common())
        clauses.append(f"of the other {sum(rest.values())} ranks, {counts}")
    return clauses


def _standing(judged: _Judge, rank: int) -> str:
    """A rank's standing in one word or two, for the counts of a large world."""
    kind = judged.kind(rank)
    if kind is None:
        return "in the all-reduce"
    record = judged.records.get(rank)
    if record is None:
        return "not reported"
    return "silent" if kind == STALLED else kind


def seconds(value: float) -> str:
    """A duration as the reports print it: ``2.4 s``, ``12 s``."""
    return f"{value:.1f} s" if value < 10 else f"{value:.0f} s"
