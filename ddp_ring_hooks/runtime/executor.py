"""Run a schedule on a flat tensor with ``torch.distributed`` point-to-point operations.

Everything that depends only on the schedule, the rank and the buffer's size (which chunk
goes where, which receive lands in scratch, where a division is fused) is compiled once into
a :class:`~ddp_ring_hooks.runtime.program.Program` and cached; a call walks its events.

For each step of its plan, a rank posts all its receives, then all its sends (on NCCL as one
``batch_isend_irecv`` batch, so their order cannot deadlock), waits for them, then applies
the receives: ``chunk += received`` for a reduce, ``chunk = received`` for a copy. Sends read
the chunk as it was before the step, exactly as the schedule's in-memory replay assumes.

Receives first, because of how gloo moves a message (``gloo/transport/tcp/pair.cc``). A
send only announces itself; its bytes leave once the receiver has answered that its receive is
posted. Everything a rank writes to one peer, those answers and the payloads alike, goes
through one first-in first-out queue on one TCP socket per pair of ranks. When a step
exchanges chunks with one peer (the ring at 2 ranks, every step of halving-doubling,
hierarchical's leaders) and a rank posts its send first to a peer whose receive is already
announced, the payload starts at once and the rank's own answer ("my receive is posted") waits
in the queue behind all of it: the peer's half starts only after this half has crossed the
link, and the exchange takes up to twice as long on a network. Posted first, the receive's
answer leaves before any payload and both halves travel at once, as in gloo's own ring
(``gloo/allreduce.cc`` posts each segment's receive before its send). On CPU the two
directions of a two-way pair also travel on two gloo transports, the group and the pair's
own (:mod:`~ddp_ring_hooks.runtime.directions`, made by the group's context): on one, both
payloads of an exchange would take turns at one lock, which costs where copies rather than the
wire set the pace (loopback).

- Chunks are cut like ``flat.tensor_split(num_chunks)``: any element count works, uneven
  tails are allowed, and empty chunks send nothing (both ends know the sizes, so they agree).
- A copy lands directly in the chunk; a reduce lands in a scratch buffer first.
- Reductions happen in the buffer's own dtype, as NCCL does.
- Per-link timing (an observer with a ``transfer_clock``, see :mod:`.observer`): each unit is
  marked as it is posted and each receive as it lands, receives waited for before sends, and
  the observer hears of the unit's transfers. Without such an observer none of it runs.
- ``divisor`` averages instead of summing: each rank's contribution is divided by it *before*
  it is summed (so fp16 sums cannot overflow, as in PyTorch's ``allreduce_hook``), fused into
  the first pass over each chunk: a chunk about to be sent first is divided in place; a chunk
  whose first touch is a reduce becomes ``received + chunk / divisor`` in one kernel
  (``addcdiv``). DDP's own reducer fuses its division the same way, into the copy of the
  gradients into the bucket: a separate pass over the whole bucket costs ~5% of a step.
- On CUDA with NCCL, ``wait()`` only makes the current stream wait for the NCCL stream and the
  additions are enqueued on the current stream: the host is never blocked. In the hook the
  current stream is the communication side stream of a worker thread
  (:mod:`~ddp_ring_hooks.runtime.cuda_lane`), so backward's compute stream never waits.
- The schedule's ranks are ranks *of the group*, which is what the group's own
  ``send``/``recv`` (and ``P2POp(group_peer=...)`` on NCCL) take, so subgroups from
  ``dist.new_group`` work.

Pipelining on CPU (gloo). Done one step at a time, a rank idles on the network while it adds,
and adds nothing while bytes move. So on CPU every chunk bigger than :data:`SLICE_BYTES` is
cut into pieces (``chunk.tensor_split(slices)``), and piece ``j`` of every chunk forms
*slice* ``j``: a full copy of the schedule on a slice of the buffer, independent of the other
slices. The slices' steps are posted step by step, slice by slice, keeping
:data:`SLICES_IN_FLIGHT` of them posted (gloo's own ring keeps two segments in flight), so
one slice's addition overlaps the next slice's transfer::

    posted    s0 x0 | s0 x1 | s0 x2 | s1 x0 | s1 x1 | ...      (s = step, x = slice)
    adding          | s0 x0 | s0 x1 | s0 x2 | s1 x0 | ...

Each slice still runs its steps in order (with two or more slices, ``(step s, slice j)`` is
completed before ``(step s+1, slice j)`` is posted), every rank posts in the same order (so
gloo's first-in first-out matching pairs the right messages), and each element is summed
along the same chain as without slices: results stay bit-identical. The window drains at
each phase boundary, so observers see a phase's steps before the next phase starts. Scratch
space (one slot per transfer in flight) is kept per thread and reused: a fresh buffer of
tens of MB costs a page fault per 4 KB on every call. CUDA keeps one slice: NCCL pipelines
its transfers itself. On CUDA the scratch is kept per thread, device, dtype *and stream*:
reusing it is safe only because every use is ordered on that one stream (a receive into it is
launched by NCCL after the stream's earlier additions, which ProcessGroupNCCL orders by making
its stream wait for the current one).

On a narrower wire (the schedule's ``wire_dtype``: bf16 or fp16, ``schedules/wire.py``) the
same program runs with casts around the transfers (compiled in :mod:`.program`): sends read a
*wire image* of the bucket (the bucket cast to the wire dtype, piece by piece, when a piece is
first sent or changed), receives land in the image, a received partial sum is widened into a
scratch piece of the bucket's dtype and added there, and the pieces that end holding a value
of their own are rounded to the wire dtype, so every rank holds the same bits. Measured on
this machine's CPU (4M elements), a mixed-dtype ``fp32.add_(bf16)`` takes 9x an fp32
addition while widening first and adding takes 2x, and ``torch.div(x, p, out=bf16)`` takes
2.5x dividing in place and then casting: so each cast is a plain ``copy_`` of its own, next to
the division or the addition, never a mixed-dtype kernel. The image, the staged receives and
the widening piece are reused per thread, as scratch is. With ``residuals`` (error feedback)
the executor writes, per piece, what its roundings lost (the value before the cast minus the
value after), and zero where this rank rounded nothing.
"""

from __future__ import annotations

import math
import threading
from collections import deque

import torch
import torch.distributed as dist

from ..schedules import Op, Schedule
from .compat import batched_p2p
from .errors import StepFailedError
from .group_context import GroupContext, Needs, context_of, needs_for
from .observer import NULL_OBSERVER, ExecutionObserver
from .program import Cast, Complete, Message, Post, Program, Unit, chunk_sizes, program_for
from .wire import wire_dtype_for

#: On CPU, chunks larger than this are cut into pieces of at most this size, one per slice,
#: and the slices are pipelined (see above).
#: Big enough that the cost per message (a wake-up of two threads) stays small on a busy host.
SLICE_BYTES = 4 << 20
#: How many slices' transfers a rank keeps posted on CPU while it adds the earlier ones.
SLICES_IN_FLIGHT = 2
#: On a narrower wire, slices of at most this many wire bytes: each element then costs three
#: passes of CPU (widen, add, cast) for half the bytes on the wire, so a slice of the same
#: bytes would leave the casts of a whole chunk outside the pipeline (measured on the lab:
#: the ring at 16 MiB, p = 2 and 4, with docs/compression.md's commands).
WIRE_SLICE_BYTES = 1 << 20


def run_schedule(
    schedule: Schedule,
    flat: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    observer: ExecutionObserver = NULL_OBSERVER,
    slice_bytes: int | None = None,
    divisor: int = 1,
    tag: int = 0,
    residual: torch.Tensor | None = None,
    context: GroupContext | None = None,
    carrier: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """All-reduce (sum) the 1-D contiguous tensor ``flat`` in place following ``schedule``.

    With ``divisor`` > 1 every contribution is divided by it first: the result is the sum of
    ``x_r / divisor`` (the average when ``divisor`` is the group size).
    ``tag`` marks every gloo message of this call: calls with different tags may run at the
    same time on the same group (from different threads) without taking each other's
    messages; calls with the same tag must run one after the other, in the same order on
    every rank. NCCL has no tags (one stream orders its work).
    ``slice_bytes`` overrides :data:`SLICE_BYTES` on CPU (tests use it to get many
    slices from small tensors); CUDA tensors always run in one slice.
    The transfers carry the schedule's wire dtype (a narrower one: see the module docstring;
    one not narrower than ``flat`` is a ``TypeError`` naming the fix). ``residual``: a tensor
    like ``flat`` that receives what this rank's roundings to the wire dtype lost (zero where
    it rounded nothing, and everywhere when nothing is rounded), for error feedback.
    ``context``: the group's context, prepared by the caller for this schedule (the hook state,
    when it is built); without one, the group's context prepares the schedule's pair transports
    (:func:`~.group_context.needs_for`: on CPU one per pair the schedule sends on both ways),
    collective the first time, as this call is. ``carrier``: on CUDA, the group the batches go on (the hook's
    lane passes its dedicated group, :mod:`~ddp_ring_hooks.runtime.cuda_lane`); default ``group``.
    """
    group_size = dist.get_world_size(group)
    if schedule.world_size != group_size:
        raise ValueError(
            f"the {schedule.algorithm} schedule is for {schedule.world_size} ranks but the "
            f"process group has {group_size}; build the schedule for the group's size"
        )
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError("run_schedule needs a 1-D contiguous tensor; pass tensor.view(-1)")
    if slice_bytes is not None and slice_bytes < 1:
        raise ValueError(f"slice_bytes must be positive, got {slice_bytes}")
    if residual is not None and (residual.shape != flat.shape or residual.dtype != flat.dtype):
        raise ValueError(f"residual must be a tensor like flat ({flat.dtype}, {tuple(flat.shape)}), got "
                         f"{residual.dtype}, {tuple(residual.shape)}")
    wire = wire_dtype_for(flat.dtype, schedule.options)
    if group_size == 1 or flat.numel() == 0 or wire is None:
        if residual is not None:
            residual.zero_()  # nothing is rounded: nothing to feed back
    if group_size == 1 or flat.numel() == 0:
        if divisor != 1:
            flat.div_(divisor)
        observer.on_finish()
        return flat
    on_cpu = flat.device.type == "cpu"
    wire_size = wire.itemsize if wire is not None else flat.element_size()
    slices = _slice_count(schedule, flat, slice_bytes, wire_size) if on_cpu else 1
    rank = dist.get_rank(group)
    program = program_for(
        schedule, rank, numel=flat.numel(), element_size=wire_size, slices=slices,
        window=min(SLICES_IN_FLIGHT, slices), divide=divisor != 1, wire=wire is not None,
    )
    group = group if group is not None else dist.group.WORLD
    if context is None:  # a call of its own: its pairs (the CUDA lanes' side groups are the hook's)
        context = context_of(group)
        context.prepare(Needs(pairs=needs_for((schedule,), group, device=flat.device).pairs))
    upward = context.upward() if on_cpu else {}
    execution = _Execution(schedule, program, flat, group, rank, observer, divisor, on_cpu, tag, upward,
                           carrier or group)
    if wire is not None:
        execution.on_the_wire(flat, wire, residual)
    execution.run()
    observer.on_finish()
    return flat


def _slice_count(schedule: Schedule, flat: torch.Tensor, slice_bytes: int | None, wire_size: int) -> int:
    """Slices so that no message is larger than :data:`SLICE_BYTES` on the wire
    (:data:`WIRE_SLICE_BYTES` on a narrower one)."""
    largest_chunk = chunk_sizes(flat.numel(), schedule.num_chunks)[0] * wire_size
    limit = slice_bytes or (WIRE_SLICE_BYTES if wire_size < flat.element_size() else SLICE_BYTES)
    return max(1, math.ceil(largest_chunk / limit))


class _Execution:
    """One run of a compiled program on one buffer."""

    def __init__(
        self, schedule: Schedule, program: Program, flat: torch.Tensor, group: dist.ProcessGroup,
        rank: int, observer: ExecutionObserver, divisor: int, on_cpu: bool, tag: int, upward, carrier,
    ) -> None:
        self.schedule = schedule
        self.program = program
        self.group = group
        self.rank = rank
        self.tag = tag
        self.observer = observer
        self.pieces = flat.split(program.piece_sizes)
        # What sends read and receives land in: the pieces themselves, or on a narrower wire
        # their images (on_the_wire).
        self.wire_pieces = self.pieces
        self.element_size = flat.element_size()
        # Scratch is reused (see the module docstring): a fresh buffer of tens of MB costs a
        # page fault per 4 KB on every call on CPU, an allocator round trip per bucket on CUDA.
        numel = program.scratch_numel
        self.scratch = _reused_buffer(flat, numel)
        # A 0-dim tensor divisor: on CPU it takes the vectorized kernel (2.6x faster than a
        # Python number, measured); on both it lets addcdiv fuse divide-and-add into one
        # kernel. On CUDA it lives on the device (made by a fill kernel, not a host copy, and
        # cached), so no kernel reads host memory and nothing syncs.
        self.divisor = _divisor_tensor(flat, divisor) if divisor != 1 else divisor
        self.start = _start_on_cpu if on_cpu else _start_batched
        # peer -> the transport of our two-way pair: messages from the lower to the higher
        # rank of the pair go on it (see runtime/directions.py); every other message on the group.
        self.upward = upward
        self.carrier = carrier  # CUDA: the group the batches go on
        self.residuals: tuple[torch.Tensor, ...] | None = None

    def on_the_wire(self, flat: torch.Tensor, wire: torch.dtype, residual: torch.Tensor | None) -> None:
        """Send and receive ``wire`` values (see the module docstring): the wire image, staged
        receives and the widening piece, all reused per thread; ``residual``: where the
        roundings' losses go."""
        program = self.program
        self.wire_pieces = _reused_buffer(flat, flat.numel(), dtype=wire, purpose="image").split(program.piece_sizes)
        self.scratch = _reused_buffer(flat, program.scratch_numel, dtype=wire)
        self.wide = _reused_buffer(flat, max(program.piece_sizes), purpose="wide")
        self.element_size = wire.itemsize
        if residual is not None:
            self.residuals = residual.split(program.piece_sizes)

    def run(self) -> None:
        in_flight: deque[list[dist.Work]] = deque()
        # Completed units' works stay referenced until the next unit is posted: dropping a
        # gloo work object can block on the transport, and the peers should not wait for
        # that (measured: 4 ranks x 64 KB took 30 ms per call instead of 10 ms).
        retired: list[list[dist.Work]] = []
        pieces, divisor = self.pieces, self.divisor
        clock = self.observer.transfer_clock  # None unless a watcher times each link
        posted: deque = deque()  # with a clock: each unit in flight's mark as it was posted
        for event in self.program.events:
            if type(event) is Post:
                for piece in event.unit.divide:
                    pieces[piece].div_(divisor)
                for cast in event.unit.casts:
                    self._cast(cast)
                if clock is not None:
                    posted.append(clock())
                in_flight.append(self.start(self, event.unit))
                retired.clear()
            elif type(event) is Complete:
                works = in_flight.popleft()
                if clock is None:
                    self._wait(event.unit, works)
                else:
                    self._wait_timed(event.unit, works, posted.popleft(), clock)
                self._land(event)
                retired.append(works)
            else:
                self.observer.on_phase(event.name)
        for piece in self.program.undivided:
            pieces[piece].div_(divisor)
        for cast in self.program.unrounded:
            self._cast(cast)
        if self.residuals is not None:
            for piece in self.program.unresidual:
                self.residuals[piece].zero_()

    def _cast(self, cast: Cast) -> None:
        """Narrow a piece into its wire image (the rounding); keep what it lost in the residual;
        round the piece itself when its value is final (see :mod:`.program`)."""
        piece, image = self.pieces[cast.piece], self.wire_pieces[cast.piece]
        image.copy_(piece)
        if self.residuals is None:
            if cast.round_back:
                piece.copy_(image)
            return
        wide = self.wide[: piece.numel()].copy_(image)
        residual = self.residuals[cast.piece]
        if cast.first:
            torch.sub(piece, wide, out=residual)
        else:
            residual.add_(piece).sub_(wide)
        if cast.round_back:
            piece.copy_(wide)

    def buffer(self, message: Message) -> torch.Tensor:
        """Where a message is read from or lands: its piece (its wire image on a narrower wire),
        or its place in scratch."""
        piece = self.wire_pieces[message.piece]
        if message.scratch is None:
            return piece
        return self.scratch[message.scratch : message.scratch + piece.numel()]

    def _wait(self, unit: Unit, works: list[dist.Work]) -> None:
        position = 0
        num_steps = len(self.schedule.steps)
        try:
            for position, work in enumerate(works):
                # Whom this thread now blocks on: a stall watchdog names the peer if it lasts.
                self.observer.on_wait(unit.step, num_steps, _message_at(unit, position)[1].peer)
                work.wait()
        except RuntimeError as error:  # name the step and the peer, not just a socket
            # When the backend coalesced the batch into fewer works than messages (NCCL may),
            # the failed transfer is unknown and the unit's first message stands for it.
            coalesced = len(works) != len(unit.sends) + len(unit.receives)
            raise self._failure(error, unit, 0 if coalesced else position) from error

    def _wait_timed(self, unit: Unit, works: list[dist.Work], posted, clock) -> None:
        """:meth:`_wait` for per-link timing: the receives first, each marked with ``clock`` as
        it landed (a receive's time is then not held up by a slow send of the same unit), then
        the sends; the observer hears of the unit's transfers."""
        messages = _posting_order(unit)
        if len(works) != len(messages):  # NCCL coalesced the batch: it completes as one
            self._wait(unit, works)
            received = [clock() for _ in unit.receives]
        else:
            received = []
            receives_first = sorted(range(len(works)), key=lambda i: messages[i][0] is not RECEIVE)
            position = 0
            num_steps = len(self.schedule.steps)
            try:
                for position in receives_first:
                    self.observer.on_wait(unit.step, num_steps, messages[position][1].peer)
                    works[position].wait()
                    if messages[position][0] is RECEIVE:
                        received.append(clock())
            except RuntimeError as error:
                raise self._failure(error, unit, position) from error
        sizes, element_size = self.program.piece_sizes, self.element_size
        self.observer.on_transfers(
            unit.step, posted, [(m.peer, sizes[m.piece] * element_size) for m in unit.sends],
            [(m.peer, sizes[m.piece] * element_size) for m in unit.receives], received,
        )

    def _land(self, event: Complete) -> None:
        if self.program.wire:
            self._land_from_the_wire(event)
            return
        pieces, divisor = self.pieces, self.divisor
        for landing in event.landings:
            if landing.message.scratch is None:  # a copy that landed in place
                continue
            piece, received = pieces[landing.message.piece], self.buffer(landing.message)
            if landing.op is Op.COPY:
                piece.copy_(received)
            elif not landing.divide:
                piece.add_(received)
            else:
                torch.addcdiv(received, piece, divisor, out=piece)
        if event.ends_step:
            step = event.unit.step
            self.observer.on_step(step, self.schedule.plan_for(self.rank)[step], self.program.chunk_bytes)

    def _land_from_the_wire(self, event: Complete) -> None:
        """:meth:`_land` on a narrower wire: a copy is widened into the piece (and kept in the
        image, to be forwarded, when it was staged); a sum is widened, then added in the
        bucket's dtype (fused with the division on the piece's first use)."""
        pieces, images, divisor = self.pieces, self.wire_pieces, self.divisor
        for landing in event.landings:
            message = landing.message
            piece, received = pieces[message.piece], self.buffer(message)
            if landing.op is Op.COPY:
                piece.copy_(received)
                if message.scratch is not None:
                    images[message.piece].copy_(received)
                continue
            wide = self.wide[: piece.numel()].copy_(received)
            if landing.divide:
                torch.addcdiv(wide, piece, divisor, out=piece)
            else:
                piece.add_(wide)
        if event.ends_step:
            step = event.unit.step
            self.observer.on_step(step, self.schedule.plan_for(self.rank)[step], self.program.chunk_bytes)

    def _failure(self, error: RuntimeError, unit: Unit, position: int) -> StepFailedError:
        """The error naming the step and the peer of the unit's ``position``-th message in
        :func:`_posting_order` (the order they are posted and waited for)."""
        direction, message = _message_at(unit, position)
        return StepFailedError(
            algorithm=self.schedule.algorithm,
            rank=self.rank,
            step_index=unit.step,
            num_steps=len(self.schedule.steps),
            phase=self.schedule.steps[unit.step].phase,
            direction=direction,
            peer=message.peer,
            global_peer=dist.get_global_rank(self.group, message.peer),
            cause=str(error).strip(),
        )


RECEIVE, SEND = "receive from", "send to"  # a message's direction, as errors name it


def _posting_order(unit: Unit) -> list[tuple[str, Message]]:
    """A unit's messages as they are posted, each with its direction: receives first (see the
    module docstring), then sends."""
    return [(RECEIVE, m) for m in unit.receives] + [(SEND, m) for m in unit.sends]


def _message_at(unit: Unit, position: int) -> tuple[str, Message]:
    """``_posting_order(unit)[position]`` without building the list (it runs before every wait)."""
    receives = unit.receives
    if position < len(receives):
        return RECEIVE, receives[position]
    return SEND, unit.sends[position - len(receives)]


def _start_on_cpu(execution: _Execution, unit: Unit) -> list[dist.Work]:
    """Start a unit's receives, then its sends, on gloo, one by one, in the same order on every rank.

    gloo starts each operation asynchronously on its own, and the batching machinery around
    them costs as much as the messages themselves (measured with 2 ranks: 216 µs instead of
    121 µs per exchange of one element), so they go straight to the process group's
    ``send``/``recv`` (what ``dist.isend``/``dist.irecv`` call after their checks, which
    ``run_schedule`` did once). Peers are ranks of the group, as the group's methods take them.
    A message from the lower to the higher rank of a two-way pair goes on the pair's own
    transport (rank 0 of it sends, rank 1 receives), the others on the group
    (:mod:`~ddp_ring_hooks.runtime.directions`): both ends of a message pick the same one.
    """
    group, upward, tag, rank = execution.group, execution.upward, execution.tag, execution.rank
    works: list[dist.Work] = []
    try:
        for direction, m in _posting_order(unit):
            if direction is RECEIVE:
                pair = upward.get(m.peer) if m.peer < rank else None
                works.append(pair.recv([execution.buffer(m)], 0, tag) if pair is not None
                             else group.recv([execution.buffer(m)], m.peer, tag))
            else:
                pair = upward.get(m.peer) if rank < m.peer else None
                works.append(pair.send([execution.wire_pieces[m.piece]], 1, tag) if pair is not None
                             else group.send([execution.wire_pieces[m.piece]], m.peer, tag))
    except RuntimeError as error:
        # A peer that died before this step fails the post itself, not the wait; the message
        # being posted names the peer (gloo's own text has only a socket address).
        raise execution._failure(error, unit, len(works)) from error
    return works


def _start_batched(execution: _Execution, unit: Unit) -> list[dist.Work]:
    """Start a unit as one coalesced batch on the carrier (the group, or the hook lane's
    dedicated group): NCCL needs that, or a send posted before its peer's receive could
    deadlock. The carrier has the group's ranks, so peers stay as they are."""
    posts = [
        (direction is RECEIVE, execution.buffer(m) if direction is RECEIVE else execution.wire_pieces[m.piece], m.peer)
        for direction, m in _posting_order(unit)
    ]
    try:
        return batched_p2p(execution.carrier, execution.pieces[0].device, posts) if posts else []
    except RuntimeError as error:  # one batch: the failed message is unknown; the first stands for it
        raise execution._failure(error, unit, 0) from error


_reusable = threading.local()


def _cache_key(flat: torch.Tensor, dtype: torch.dtype | None = None) -> tuple:
    """Per dtype (``flat``'s, or ``dtype``) on CPU; per device, dtype and current stream on
    CUDA (see the docstring)."""
    dtype = flat.dtype if dtype is None else dtype
    if flat.device.type == "cpu":
        return (dtype,)
    return (dtype, flat.device, torch.cuda.current_stream(flat.device).cuda_stream)


def _cache() -> dict:
    cache = getattr(_reusable, "buffers", None)
    if cache is None:
        cache = _reusable.buffers = {}
    return cache


def _reused_buffer(flat: torch.Tensor, numel: int, *, dtype: torch.dtype | None = None,
                   purpose: str = "scratch") -> torch.Tensor:
    """A buffer of ``numel`` elements like ``flat`` (of ``dtype``, default ``flat``'s), one per
    ``purpose``, kept per thread (see :func:`_cache_key`), grown when too small.

    Per thread, because the comm workers and the main thread may run schedules at the same
    time. Scratch is bounded by ``SLICES_IN_FLIGHT`` pieces of staged receives; a narrower
    wire adds its image (the bucket in the wire dtype) and one widening piece.
    """
    cache, key = _cache(), (purpose, *_cache_key(flat, dtype))
    buffer = cache.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = cache[key] = flat.new_empty(numel, dtype=dtype)
    return buffer[:numel]


def _divisor_tensor(flat: torch.Tensor, divisor: int) -> torch.Tensor:
    """``divisor`` as a 0-dim tensor of ``flat``'s dtype and device, made once per thread."""
    cache, key = _cache(), ("divisor", divisor, *_cache_key(flat))
    tensor = cache.get(key)
    if tensor is None:
        tensor = cache[key] = torch.full((), divisor, dtype=flat.dtype, device=flat.device)
    return tensor
