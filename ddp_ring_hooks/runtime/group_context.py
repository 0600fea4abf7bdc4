"""``GroupContext``: what a process group needs besides itself, made, aborted and closed in one place.

gloo keeps one context per communicator: its pairs of ranks, its buffers, one place to close
them. A hook on a process group needs more than the group: a transport per two-way pair, on
CUDA a communicator and a stream of its own, worker threads by lane, the ranks' nodes and a
measured ring order, ``auto``'s selectors. All of it lives in one object per group::

    context_of(group)               the group's context: one weak-keyed map, one lock; local, free
    1. prepare(needs)               the one collective setup, the same on every rank of the group
    2. use                          transports, worker(lane), cuda_lane(device), stream(device, owner),
                                    control_group(); the facts the group settled (nodes, ring order,
                                    selectors)
    3. abort(peer=...)              every transport it made and the group, per device
    4. hold() ... release()         the last holder's release closes it: workers stopped, what it
                                    made shut, sockets and threads back to where they were

1. **What is needed** (:class:`Needs`, from :func:`needs_for`) follows from the schedules the
   algorithm runs and the group's backend only, so every rank of the group computes the same:
   the pairs that carry messages both ways (:func:`two_way_pairs`) on gloo, a transport each
   (:mod:`.directions`); scheduled CUDA buckets, a dedicated NCCL group
   (:mod:`.cuda_lane`); an NCCL-only group, a gloo control group for host-side agreement.
   ``native`` needs none of them, nor does a ring at more than 2 ranks on CPU (it sends one
   way round). :meth:`prepare`
   makes what is missing in one order on every rank (the pairs sorted, then the side groups),
   so every rendezvous finds its other ranks: the smallest pair not yet made always has both
   its ranks waiting at it.
2. **One rule for side groups** (:func:`side_group`): a backend of our own on the group's store
   (whose prefix is the group's name, the same on every member) under a key prefix of its own,
   never ``dist.new_group``. ``new_group`` over some ranks needs ``use_local_synchronization``,
   whose name hashes the ranks with the number of groups *this process* knows; a group made on
   some ranks only (a hook on ranks 1..3 of 4) would give every later such group, ours or the
   user's, another name on those ranks than on the others, and the next one would hang. Side
   groups take no name from c10d: only their members meet, and nothing else changes.
3. **Local things are made on first use**: a worker thread at its first job, a CUDA stream.
   Nothing collective is made lazily on the training path: a message between two ranks that
   share no pair transport goes on the group, on both ends (both made the same pairs).
4. **Abort is complete by construction**: it reaches what the context made because the context
   made it: the group itself (gloo: the probe that closes its contexts; NCCL: its abort; a
   mixed ``"cpu:gloo,cuda:nccl"`` group: both, one per device), every pair, the dedicated,
   control and probe groups. After it the group is dead for good (``docs/reliability.md``).
5. **Close** joins the workers (after their queued jobs), then drops the pairs and side groups,
   whose sockets close with them; facts stay (every rank keeps them alike, and they are data).
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..schedules import Schedule
from .abort import abort_nccl, close_gloo_contexts
from .collectives import backend_for, device_of
from .compat import group_store, unregistered_group
from .cuda_lane import CudaLane, on_lane_thread
from .directions import make_pair
from .lanes import Lane, cuda_lane
from .worker import CommWorker

_CONTEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> its context; weak: the
_LOCK = threading.Lock()  # group dies with destroy_process_group, and its context with it


def context_of(group: dist.ProcessGroup | None = None) -> GroupContext:
    """The context of ``group`` (default: the default group), made on first use (no collective)."""
    group = group if group is not None else dist.group.WORLD
    with _LOCK:
        context = _CONTEXTS.get(group)
        if context is None:
            context = _CONTEXTS[group] = GroupContext(group)
        return context


@dataclass(frozen=True)
class Needs:
    """What an algorithm uses of a group's side resources (see the module docstring, 1.).

    ``pairs``: the two-way pairs ``(low, high)`` (group ranks), a gloo transport each;
    ``cuda``: scheduled CUDA buckets (the dedicated NCCL group); ``control``: host-side
    agreement on a group without gloo (a gloo control group)."""

    pairs: frozenset[tuple[int, int]] = frozenset()
    cuda: bool = False
    control: bool = False

    def __or__(self, other: Needs) -> Needs:
        return Needs(self.pairs | other.pairs, self.cuda or other.cuda, self.control or other.control)


def needs_for(
    schedules: Iterable[Schedule], group: dist.ProcessGroup | None = None, *, device: torch.device | str | None = None,
) -> Needs:
    """What running ``schedules`` on ``group`` with tensors on ``device`` needs (default device:
    the group's, :func:`~.collectives.device_of`); no schedule (``native``) needs nothing but a
    control group where the group has no gloo. The same on every rank that runs the same
    schedules on the same group."""
    group = group if group is not None else dist.group.WORLD
    backend = str(dist.get_backend(group))
    on = device_of(group, device).type
    schedules = tuple(schedules)
    pairs: frozenset[tuple[int, int]] = frozenset()
    if on == "cpu" and backend_for(backend, "cpu") == "gloo" and group.size() > 1:
        pairs = two_way_pairs(schedules)
    return Needs(
        pairs=pairs,
        cuda=on == "cuda" and bool(schedules) and backend_for(backend, "cuda") == "nccl",
        control=backend_for(backend, "cpu") is None,
    )


def two_way_pairs(schedules: Iterable[Schedule]) -> frozenset[tuple[int, int]]:
    """Every pair ``(low, high)`` that some step of ``schedules`` sends on in one direction and
    some step (the same or another, of the same schedule or another) in the other. Not only an
    exchange within one step: lanes run buckets at once, so bucket 0's broadcast (parent to
    child) can cross bucket 1's reduce (child to parent) on the same pair, and two payloads
    the two ways of one gloo socket can block each other for good (:mod:`.directions`)."""
    links = frozenset().union(*(schedule.links() for schedule in schedules))
    return frozenset((src, dst) for src, dst in links if src < dst and (dst, src) in links)


def side_group(group: dist.ProcessGroup, *, backend: str, purpose: str, generation: int = 0) -> dist.ProcessGroup:
    """A group with ``group``'s ranks on ``backend``, for ``purpose`` (a word: its store keys),
    by the one rule (see the module docstring, 2.): collective over ``group``'s members only, on
    the group's store, with the group's timeout; c10d never hears of it. ``generation``: how many
    times this context made it before (the same on every rank), so a group made again after a
    close never meets the old one's keys."""
    store = dist.PrefixStore(f"ddp_ring_hooks.{purpose}/{generation}/", group_store(group))
    return unregistered_group(store, group.rank(), group.size(), backend=backend, like=group)


class GroupContext:
    """Everything one process group needs besides itself (see the module docstring).

    Thread-safe: the hook thread, the workers and the stall watchdog's thread all reach it.
    Holds the group weakly (a context kept alive must not keep its group alive)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = weakref.ref(group)
        self._lock = threading.Lock()  # the maps below, and the facts
        self._making = threading.Lock()  # one collective setup at a time (two states, two lanes)
        self._pairs: dict[tuple[int, int], dist.ProcessGroupGloo] = {}
        self._upward: Mapping[int, dist.ProcessGroupGloo] = {}  # peer -> the pair's transport (replaced whole)
        self._dedicated: dist.ProcessGroup | None = None  # CUDA: the lanes' NCCL group
        self._control: dist.ProcessGroup | None = None  # NCCL-only group: the gloo control group
        self._probe: dist.ProcessGroup | None = None  # the link probe's gloo group (telemetry/native_probe.py)
        self._made: Counter = Counter()  # times each side resource was made: its store keys' generation
        self._workers: dict[Lane, CommWorker] = {}
        self._streams: dict[tuple[str, torch.device], torch.cuda.Stream] = {}
        self._holders = 0
        #: Whether :meth:`abort` ran: the group is dead for good.
        self.aborted = False
        #: Facts the group settled, kept until the group goes (every rank keeps them alike): the
        #: ranks' nodes once met (:mod:`.ring_orders`), the measured ring order, ``auto``'s
        #: selectors by options (:mod:`.selection`). Read and written under :attr:`lock`.
        self.met = False
        self.nodes: tuple[int, ...] | None = None
        self.measured: tuple[int, ...] | None = None
        self.selectors: dict[tuple, object] = {}

    @property
    def lock(self) -> threading.Lock:
        """The lock of the facts (:attr:`nodes`, :attr:`measured`, :attr:`selectors`)."""
        return self._lock

    @property
    def group(self) -> dist.ProcessGroup:
        group = self._group()
        if group is None:
            raise RuntimeError("this process group was destroyed; its context is gone with it")
        return group

    # -- 1. the one collective setup ---------------------------------------------------------

    def prepare(self, needs: Needs) -> None:
        """Make what ``needs`` asks for and is not made yet (collective over the group's members
        when something is missing: every rank must prepare the same needs, in the same order of
        calls; free when everything is made)."""
        if not needs.pairs and not needs.cuda and not needs.control:
            return
        group = self.group
        with self._making:
            me = group.rank()
            for pair in sorted(needs.pairs):
                if me in pair and pair not in self._pairs:
                    made = make_pair(group, pair, generation=self._generation(pair))
                    with self._lock:
                        self._pairs[pair] = made
                        self._upward = {(high if low == me else low): t for (low, high), t in self._pairs.items()}
            if needs.cuda and self._dedicated is None:
                self._dedicated = side_group(group, backend="nccl", purpose="cuda", generation=self._generation("cuda"))
            no_gloo = backend_for(str(dist.get_backend(group)), "cpu") is None
            if needs.control and no_gloo and self._control is None:
                self._control = side_group(group, backend="gloo", purpose="control", generation=self._generation("control"))

    def _generation(self, what) -> int:
        generation = self._made[what]
        self._made[what] += 1
        return generation

    # -- 2. using what was made ----------------------------------------------------------------

    def upward(self) -> Mapping[int, dist.ProcessGroupGloo]:
        """``peer -> transport`` for each two-way pair this rank is in: a message from the
        lower to the higher rank of the pair goes on it (rank 0 of it sends, rank 1 receives),
        the other way on the group (:mod:`.directions`). Empty when none was prepared."""
        return self._upward

    def worker(self, lane: Lane, *, on_start: Callable[[], None] | None = None) -> CommWorker:
        """The worker of ``lane`` (made on first use; its thread starts with its first job)."""
        with self._lock:
            worker = self._workers.get(lane)
            if worker is None:
                worker = self._workers[lane] = CommWorker(lane.thread_name, on_start=on_start)
            return worker

    def workers(self) -> list[CommWorker]:
        """Every worker made so far, all lanes."""
        with self._lock:
            return list(self._workers.values())

    def stream(self, device: torch.device, owner: str) -> torch.cuda.Stream:
        """The CUDA stream of ``owner`` on ``device``: ``"native"`` for the group's own all-reduce
        issued from the hook thread, ``"lanes"`` for the workers' schedules (one per communicator,
        see :mod:`.cuda_lane`); made once."""
        device = torch.device(device)
        with self._lock:
            stream = self._streams.get((owner, device))
            if stream is None:
                stream = self._streams[(owner, device)] = torch.cuda.Stream(device=device)
            return stream

    def cuda_lane(self, device: torch.device) -> CudaLane:
        """What the group's CUDA buckets on ``device`` run on: the lanes' stream, the dedicated
        group (made here if the state was built before the process group: collective, on every
        rank's first CUDA bucket), the device's worker."""
        device = torch.device(device)
        if self._dedicated is None:
            self.prepare(Needs(cuda=True))
        stream = self.stream(device, "lanes")
        worker = self.worker(cuda_lane(device.index), on_start=on_lane_thread(device, stream))
        return CudaLane(device=device, stream=stream, group=self._dedicated, worker=worker)

    def control_group(self) -> dist.ProcessGroup:
        """A group that moves CPU tensors with the group's ranks: the group itself when it has
        gloo for the CPU, else the gloo control group (made here if missing: collective). Not
        registered with c10d when it is a side group: give ``device="cpu"`` to helpers that
        would ask c10d for its backend."""
        group = self.group
        if backend_for(str(dist.get_backend(group)), "cpu") is not None:
            return group
        if self._control is None:
            self.prepare(Needs(control=True))
        return self._control

    def probe_group(self) -> dist.ProcessGroup:
        """The gloo side group the link probe under ``native`` sends on (its own sockets: a probe
        never queues behind the group's all-reduce); made on first use, collective over the
        group's members (every rank's exchange worker asks at the same gathered step)."""
        with self._making:
            if self._probe is None:
                self._probe = side_group(self.group, backend="gloo", purpose="probe",
                                         generation=self._generation("probe"))
            return self._probe

    # -- 3. abort ------------------------------------------------------------------------------

    def abort(self, *, peer: int | None = None) -> None:
        """Fail every transfer in flight on this rank on the group and on everything its context
        made, now, so that no thread stays blocked in a wait: NCCL's abort where CUDA tensors
        travel (the dedicated group first: scheduled buckets wait there), gloo's timeout path
        where CPU tensors do (the group's CPU side, every pair, the control group). ``peer``: the
        rank of the group a transfer is stuck on (its connection is tried first). The group is
        dead afterwards; the peers' transfers with this rank fail at once."""
        group = self._group()
        if group is None or group.size() == 1:
            return
        self.aborted = True
        backend = str(dist.get_backend(group))
        with self._lock:
            pairs, dedicated, control, probe = dict(self._pairs), self._dedicated, self._control, self._probe
        if dedicated is not None:
            abort_nccl(dedicated)
        if backend_for(backend, "cuda") == "nccl":
            abort_nccl(group)  # on a mixed group this reaches its NCCL side only: gloo's follows
        if backend_for(backend, "cpu") == "gloo":
            close_gloo_contexts(group, peer=peer)
        me = group.rank()
        for (low, high), transport in sorted(pairs.items()):
            close_gloo_contexts(transport, peer=1 if me == low else 0)
        for side in (control, probe):
            if side is not None:
                close_gloo_contexts(side, peer=peer)

    # -- 4. holding and closing ----------------------------------------------------------------

    def hold(self) -> None:
        """A hook state uses this context until it calls :meth:`release`."""
        with self._lock:
            self._holders += 1

    def release(self) -> None:
        """A holder is done: the workers stop after their queued jobs (every holder's: they
        share the lanes; a later job starts them again), and the last holder's release closes
        the context (:meth:`close`)."""
        with self._lock:
            self._holders = max(0, self._holders - 1)
            last = self._holders == 0
        if last:
            self.close()
        else:
            self.stop_workers()

    def stop_workers(self) -> None:
        """Stop every worker after its queued jobs (waits for them: a thread still running
        after this could reorder its lane's messages with a new one)."""
        with self._lock:
            workers, self._workers = list(self._workers.values()), {}
        for worker in workers:
            worker.close()

    def close(self) -> None:
        """Stop the workers (:meth:`stop_workers`), then shut what the context made: the pairs'
        and side groups' sockets close, their threads end. The next use makes them anew
        (:meth:`prepare` on every rank). Safe to call twice."""
        self.stop_workers()
        with self._lock:
            made = [*self._pairs.values(), self._dedicated, self._control, self._probe]
            self._pairs, self._upward, self._dedicated, self._control, self._probe = {}, {}, None, None, None
            self._streams.clear()
        for transport in made:
            if transport is not None:
                _shut(transport)


def _shut(transport) -> None:
    """Release a transport now rather than whenever the last reference goes (NCCL frees its
    communicator in ``shutdown``); gloo's sockets close as its object goes."""
    shutdown = getattr(transport, "shutdown", None)
    if shutdown is not None and not isinstance(transport, dist.ProcessGroupGloo):
        try:
            shutdown()
        except RuntimeError:  # a backend without a shutdown of its own: dropping it is enough
            pass
