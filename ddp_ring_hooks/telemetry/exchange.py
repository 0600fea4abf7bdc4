"""After a step, across ranks: the watchers' exchange, on a worker of its own, point-to-point.

Some watchers need the other ranks' view of a step (who arrived last; each link's transfer
times). After the last bucket of such a step is handed over, the observation queues
one job on the exchange worker, which talks to the other ranks in three phases::

    hook thread       last bucket launched -> submit(step, watchers)
    exchange worker   wait for the step's buckets -> [clock offsets: first exchange and every
                      RESYNC_EVERY]
      1. share        watcher.share(step, peers) for each, in order: what it must trade with
                      some peers first (per-link timing's post marks, Peers.trade), then this
                      rank's row of numbers for the gather
      2. one gather   every watcher's row side by side, and the cadence's (spread_every="auto"):
                      one ring of messages (Peers.rows) for all of them
      3. shared       watcher.shared(step, peers, rows) for each: every rank's row, its own part
                      -> then watcher.exchange(step, peers), for what talks on its own (the trace
                      gather's bytes to rank 0, after the others recorded theirs)

One gather per step, not one per watcher: at 4 ranks the arrivals and the links together are
7 message steps (the trade, then 6 for the ring of rows) where a gather each made 13
(``tests/test_link_timing.py`` counts them). What the exchange cost this rank (its thread's CPU
time, and the probe's time on the links) is handed to the cadence (:mod:`.cadence`), which with
``spread_every="auto"`` chooses how often steps gather from it.

The exchange is point-to-point with its own tag (the lane :data:`~ddp_ring_hooks.runtime.lanes.EXCHANGE`'s,
from the one table of tags), never a collective:
DDP starts collectives of its own on the training thread while this worker runs
(``find_unused_parameters``' map of used parameters right after the last bucket,
``broadcast_buffers`` in every forward), and gloo pairs collectives in the order each process
calls them, so a collective from here could pair with one of DDP's. Point-to-point messages
pair by peer and tag, in order, and every rank runs these exchanges in step order on one
thread. The worker runs beside training: an exchange never lengthens a step.

The messages are CPU tensors, so the group needs a CPU backend (gloo, or NCCL plus gloo as
``init_process_group()`` sets up by default); on NCCL alone the exchange is skipped with a
warning. After a failed exchange (a peer gone, a bucket of the step failed) the ranks' message
streams may be out of step: this rank exchanges no more (and gathers no more).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from ..runtime.group_context import context_of
from ..runtime.lanes import EXCHANGE
from .cadence import Cadence, CadenceRecord
from .clocks import ClockOffsets, all_gather_rows, estimate_clock_offsets, gather_bytes_to_rank0

#: The exchange's message tag (its lane's: bucket lanes use 0 .. concurrent_buckets - 1).
EXCHANGE_TAG = EXCHANGE.tag
#: Clock offsets across hosts are estimated again every this many exchanges (clocks drift).
RESYNC_EVERY = 100


@dataclasses.dataclass(frozen=True)
class Peers:
    """What a watcher's :meth:`~.watcher.Watcher.share`, :meth:`~.watcher.Watcher.shared` and
    :meth:`~.watcher.Watcher.exchange` talk through: the hook's group (by group rank) on the
    exchange's tag, and every rank's clock offset to rank 0's.

    Every rank must make the same calls in the same order (they pair by peer and tag)."""

    group: dist.ProcessGroup
    rank: int
    world_size: int
    clocks: ClockOffsets
    #: Milliseconds of link time a watcher spent on this exchange besides its CPU (the probe's
    #: transfers): :meth:`charge` adds to it, the cadence counts it.
    charged_ms: list = dataclasses.field(default_factory=list)

    def rows(self, row: Sequence[float]) -> list[list[float]]:
        """Every rank's ``row`` of floats (the same length on every rank), by group rank."""
        return all_gather_rows(row, self.group, tag=EXCHANGE_TAG)

    def bytes_to_rank0(self, payload: bytes) -> list[bytes] | None:
        """Rank 0 gets every rank's ``payload`` (by group rank); the others get ``None``."""
        return gather_bytes_to_rank0(payload, self.group, tag=EXCHANGE_TAG)

    def trade(self, outgoing: Mapping[int, Sequence[float]], incoming: Mapping[int, int]) -> dict[int, list[float]]:
        """Send each peer of ``outgoing`` its floats; receive ``incoming[peer]`` floats from each
        peer there (both ends must agree on every count). Only the peers named talk: every
        message is posted at once, then waited for, so no order between the pairs can deadlock."""
        received = {peer: torch.empty(count, dtype=torch.float64) for peer, count in incoming.items() if count}
        works = [self.group.recv([buffer], peer, EXCHANGE_TAG) for peer, buffer in received.items()]
        works += [self.group.send([torch.tensor(list(values), dtype=torch.float64)], peer, EXCHANGE_TAG)
                  for peer, values in outgoing.items() if len(values)]
        for work in works:
            work.wait()
        return {peer: buffer.tolist() for peer, buffer in received.items()}

    def charge(self, milliseconds: float) -> None:
        """Count ``milliseconds`` of time on the links in this exchange's cost (the probe's)."""
        self.charged_ms.append(milliseconds)


class StepExchange:
    """Runs the watchers' exchanges of one hook state (see the module docstring), with the
    ``cadence`` of its gathered steps; ``record`` takes the cadence's decisions (a
    :class:`~.records.Scalars` record: ``comm/diagnosis/*``)."""

    def __init__(self, cadence: Cadence | None = None, *, record: Callable | None = None) -> None:
        self.cadence = cadence if cadence is not None else Cadence(0)
        self._record = record
        self._clocks: ClockOffsets | None = None
        self._exchanges = 0
        self._warned = False
        self._broken = False
        self._running = 0  # exchanges submitted and not yet finished
        self._finished = threading.Condition()

    def submit(self, step, watchers: Sequence) -> None:
        """On the hook thread, after ``step``'s last bucket was launched (a
        :class:`~.watcher.StepWatch` with its Futures)."""
        with self._finished:
            self._running += 1
        try:
            context_of(step.group).worker(EXCHANGE).submit(lambda: self._run_and_count(step, watchers))
        except BaseException:
            self._one_finished()
            raise

    def settle(self, timeout_s: float) -> int:
        """Wait, at most ``timeout_s`` seconds, until every exchange submitted so far has
        finished (a summary read right after the last step then holds that step's arrivals
        and links); the number still running."""
        with self._finished:
            self._finished.wait_for(lambda: self._running == 0, timeout_s)
            return self._running

    def _run_and_count(self, step, watchers: Sequence) -> None:
        try:
            self._run(step, watchers)
        finally:
            self._one_finished()

    def _one_finished(self) -> None:
        with self._finished:
            self._running -= 1
            self._finished.notify_all()

    def _run(self, step, watchers: Sequence) -> None:
        try:
            torch.futures.wait_all(step.futures)
        except Exception:  # noqa: BLE001 - DDP raises the bucket's failure; the group is unusable
            self._give_up("a bucket of this step failed")
            return
        if self._broken:
            return
        if "gloo" not in str(dist.get_backend(step.group)):
            self._give_up("it sends CPU tensors and needs gloo on the group (init_process_group() without "
                          "a backend gives NCCL plus gloo)")
            return
        began = time.thread_time()
        try:
            if self._clocks is None or self._exchanges % RESYNC_EVERY == 0:
                self._clocks = estimate_clock_offsets(step.group, tag=EXCHANGE_TAG)
            self._exchanges += 1
            peers = Peers(group=step.group, rank=step.rank, world_size=step.world_size, clocks=self._clocks)
            self._gather(step, watchers, peers)
            for watcher in watchers:
                watcher.exchange(step, peers)
        except RuntimeError as error:  # a peer gone or timed out
            self._give_up(f"an exchange failed: {error}")
            return
        self.cadence.spent((time.thread_time() - began) * 1e3 + sum(peers.charged_ms))

    def _gather(self, step, watchers: Sequence, peers: Peers) -> None:
        """Phases 1-3 of the module docstring: every watcher's row, one gather, every rank's rows back."""
        cadenced = self.cadence.gathers(step.step)
        own = tuple(self.cadence.row()) if cadenced else ()
        shares = [(watcher, tuple(watcher.share(step, peers))) for watcher in watchers]  # 1.
        row = [*own, *(value for _, part in shares for value in part)]
        if not row:
            return
        table = peers.rows(row)  # 2.
        if own:
            gap, cost_ms, step_ms = self.cadence.decide([r[:len(own)] for r in table])
            if self._record is not None:
                self._record(CadenceRecord.of(step.step, gap, cost_ms, step_ms, rank=step.rank), group=step.group)
        start = len(own)
        for watcher, part in shares:  # 3.
            if part:
                watcher.shared(step, peers, [r[start:start + len(part)] for r in table])
                start += len(part)

    def _give_up(self, why: str) -> None:
        self._broken = True
        self.cadence.stop()
        if not self._warned:
            self._warned = True
            warnings.warn(f"no more exchanges across ranks after a step (spread_every) on this rank: {why}",
                          stacklevel=1)
