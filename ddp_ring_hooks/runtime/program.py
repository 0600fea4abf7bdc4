"""A schedule compiled for one rank and one buffer size: what to post, wait for and apply, in order.

The executor runs a schedule on every gradient bucket, thousands of times with the same few
sizes. Everything that depends only on the schedule, the rank and the sizes is worked out
once here, in plain Python without torch, and cached; what is left per call is a flat loop of
sends, receives, waits and additions (what that saved is in ``docs/design-history.md``).

A :class:`Program` is a list of events, in the order the executor meets them:

- ``Phase(name)``: a new phase starts (observers hear of it);
- ``Post(unit)``: divide what must be divided before it is sent, then start the unit's sends
  and receives;
- ``Complete(unit, landings)``: wait for the oldest unit in flight, then apply its receives.

A *unit* is one slice's share of one step (see :mod:`~ddp_ring_hooks.runtime.executor` for
slices). Buffers are *pieces*: ``flat.split(program.piece_sizes)`` cuts the buffer into
``num_chunks x slices`` views, piece ``chunk * slices + slice`` being piece ``slice`` of
``chunk`` (the order they lie in memory). Chunks follow ``torch.tensor_split``, and so do a
chunk's pieces, so every rank cuts the same way and empty pieces send nothing.

Averaging (``divide=True``) divides each piece exactly once, at its first use: a piece
first sent is divided in place just before (:attr:`Unit.divide`); a piece first reduced
becomes ``received + piece / divisor`` in one pass (:attr:`Landing.divide`); a piece first
overwritten by a copy needs nothing; a piece no step touches is divided at the end
(:attr:`Program.undivided`).

On a narrower wire (``wire=True``: the transfers carry bf16 or fp16, see
``schedules/wire.py``) the bucket keeps its own dtype and a *wire image* of it, the buffer in
the wire dtype cut into the same pieces. Every send reads the image and every receive lands in
it (in scratch only when the step also sends that piece), and the program says what to cast:

1. a piece about to be sent whose image is not current is divided (first use), then *cast*
   into its image (:attr:`Unit.casts`): the one rounding of that partial sum. When no later
   step lands anything in the piece, its value is final and the cast also *rounds it back*
   (the piece takes the image's value), so it equals what the other ranks will copy;
2. a piece whose image is current (it was copied in, or rounded back) is sent without a cast:
   the all-gather forwards what it received;
3. a copy lands in the image and is widened into the piece; a reduce is widened into a scratch
   piece of the bucket's dtype and added there (fused with the division on first use): the
   additions are in fp32;
4. a piece that ends neither copied nor rounded back is rounded at the end
   (:attr:`Program.unrounded`), so every rank holds values the wire can carry, the same bits.

With ``residuals`` the executor also keeps what each rounding lost (error feedback): the first
rounding of a piece writes its residual (:attr:`Cast.first`), a later one adds to it, and the
pieces this rank never rounds get a zero residual (:attr:`Program.unresidual`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from ..schedules import Op, RankStep, Schedule


@dataclass(frozen=True, slots=True)
class Message:
    """One send or receive: the piece it reads or fills, and the peer (a rank of the group)."""

    piece: int
    peer: int
    #: Receives only: where in scratch the message lands, or ``None`` to land in the piece.
    scratch: int | None = None


@dataclass(frozen=True, slots=True)
class Landing:
    """What to do with a received message once it has arrived."""

    message: Message
    #: ``Op.REDUCE``: add it to the piece; ``Op.COPY``: it replaces the piece (nothing to
    #: do when it landed in the piece itself).
    op: Op
    #: A reduce that is the piece's first use: divide the piece in the same pass.
    divide: bool = False


@dataclass(frozen=True, slots=True)
class Cast:
    """On a narrower wire: a piece cast into its wire image before it is sent."""

    piece: int
    #: Nothing lands in the piece after this step: it takes the image's (rounded) value now.
    round_back: bool
    #: This rank's first rounding of the piece in the run (its residual is written, not added).
    first: bool


@dataclass(frozen=True, slots=True)
class Unit:
    """One slice's share of one step: what is posted together."""

    step: int  # the step's index in the plan
    divide: tuple[int, ...]  # pieces to divide in place before sending them
    sends: tuple[Message, ...]
    receives: tuple[Message, ...]
    casts: tuple[Cast, ...] = ()  # narrower wire: pieces to cast into their image first


@dataclass(frozen=True, slots=True)
class Phase:
    """A new phase of the schedule starts."""

    name: str


@dataclass(frozen=True, slots=True)
class Post:
    """Divide what the unit sends first, then start its receives and its sends (the executor
    posts receives first: see :mod:`~ddp_ring_hooks.runtime.executor`)."""

    unit: Unit


@dataclass(frozen=True, slots=True)
class Complete:
    """Wait for the oldest unit in flight (always ``unit``), then apply its landings."""

    unit: Unit
    landings: tuple[Landing, ...]
    ends_step: bool  # the step's last slice: observers hear of the step now


@dataclass(frozen=True, slots=True)
class Program:
    """Everything one rank does to all-reduce one buffer size, in order."""

    piece_sizes: tuple[int, ...]  # elements per piece, in memory order
    chunk_bytes: tuple[int, ...]  # per chunk, for observers
    events: tuple[Phase | Post | Complete, ...]
    scratch_numel: int  # staging space for the receives in flight
    undivided: tuple[int, ...]  # pieces no step touches (divide them at the end)
    #: Narrower wire: pieces to round to the wire dtype at the end (after any division), each
    #: with whether it is its first rounding; and the pieces never rounded (a zero residual).
    unrounded: tuple[Cast, ...] = ()
    unresidual: tuple[int, ...] = ()
    wire: bool = False


def chunk_sizes(numel: int, parts: int) -> list[int]:
    """Element counts of ``torch.tensor_split(numel, parts)``: the first ``numel % parts`` get one more."""
    base, extra = divmod(numel, parts)
    return [base + 1 if index < extra else base for index in range(parts)]


def compile_program(
    schedule: Schedule,
    rank: int,
    *,
    numel: int,
    element_size: int,
    slices: int,
    window: int,
    divide: bool,
    wire: bool = False,
) -> Program:
    """Compile ``schedule`` for ``rank`` on a buffer of ``numel`` elements (see the module docstring).

    ``window`` units are kept posted at a time (at most ``slices``, so a slice's steps never
    overlap); the window drains at each phase boundary. ``element_size``: bytes per element as
    the transfers carry them (the wire dtype's), for the observers' counts. ``wire``: the
    transfers carry a narrower dtype than the buffer (see the module docstring).
    """
    if not 1 <= window <= slices:
        raise ValueError(f"window must be between 1 and slices ({slices}), got {window}")
    plan = schedule.plan_for(rank)
    chunks = chunk_sizes(numel, schedule.num_chunks)
    piece_sizes = tuple(size for chunk in chunks for size in chunk_sizes(chunk, slices))
    compiler = (_WireCompiler if wire else _Compiler)(plan, piece_sizes, slices, window, divide)
    events = compiler.run()
    return Program(
        piece_sizes=piece_sizes,
        chunk_bytes=tuple(size * element_size for size in chunks),
        events=events,
        scratch_numel=compiler.slot_numel * window,
        undivided=tuple(sorted(compiler.pending_division)),
        **compiler.ending(),
    )


class _Compiler:
    """Walks the plan in the executor's order, deciding slots, landings and divisions."""

    def __init__(self, plan: tuple[RankStep, ...], piece_sizes: tuple[int, ...], slices: int, window: int, divide: bool):
        self.plan = plan
        self.sizes = piece_sizes
        self.slices = slices
        self.window = window
        self.slot_numel = max((self._staged_numel(step, 0) for step in plan), default=0)  # slice 0 is the largest
        self.pending_division = {s for s, size in enumerate(piece_sizes) if size} if divide else set()

    def _piece(self, chunk: int, slice_index: int) -> int:
        return chunk * self.slices + slice_index

    def _stages(self, receive, sent: set[int]) -> bool:
        """Whether a receive lands in scratch: a sum (it is added to the piece), or a copy over
        a chunk this step still sends."""
        return receive.op is Op.REDUCE or receive.chunk in sent

    def _staged_numel(self, step: RankStep, slice_index: int) -> int:
        sent = {send.chunk for send in step.sends}
        return sum(self.sizes[self._piece(r.chunk, slice_index)] for r in step.receives if self._stages(r, sent))

    def ending(self) -> dict:
        """The program's fields decided at the end of the walk (none for a wire as the buffer)."""
        return {}

    def run(self) -> tuple[Phase | Post | Complete, ...]:
        events: list[Phase | Post | Complete] = []
        in_flight: list[tuple[Unit, RankStep, int, bool]] = []  # (unit, step, slice, ends_step)
        posted = 0
        phase = None
        for index, step in enumerate(self.plan):
            if step.phase != phase:
                events += [self._complete(*pending) for pending in in_flight]
                in_flight.clear()
                phase = step.phase
                events.append(Phase(phase))
            for slice_index in range(self.slices):
                if len(in_flight) == self.window:
                    events.append(self._complete(*in_flight.pop(0)))
                unit = self._unit(index, step, slice_index, slot=posted % self.window)
                events.append(Post(unit))
                in_flight.append((unit, step, slice_index, slice_index == self.slices - 1))
                posted += 1
        events += [self._complete(*pending) for pending in in_flight]
        return tuple(events)

    def _unit(self, index: int, step: RankStep, slice_index: int, *, slot: int) -> Unit:
        sent = {send.chunk for send in step.sends}
        divide, sends, receives = [], [], []
        for send in step.sends:
            piece = self._piece(send.chunk, slice_index)
            if self.sizes[piece]:
                if piece in self.pending_division:
                    self.pending_division.discard(piece)
                    divide.append(piece)
                sends.append(Message(piece, send.peer))
        offset = slot * self.slot_numel
        for receive in step.receives:
            piece = self._piece(receive.chunk, slice_index)
            if not self.sizes[piece]:
                continue
            if not self._stages(receive, sent):
                receives.append(Message(piece, receive.peer))  # lands in place
            else:
                receives.append(Message(piece, receive.peer, scratch=offset))
                offset += self.sizes[piece]
        return Unit(index, tuple(divide), tuple(sends), tuple(receives), self._casts(index, sends))

    def _casts(self, index: int, sends: list[Message]) -> tuple[Cast, ...]:
        return ()

    def _complete(self, unit: Unit, step: RankStep, slice_index: int, ends_step: bool) -> Complete:
        """Landings are decided here, not at posting: whether a reduce is a piece's first
        use depends on what the units completed in between did to it."""
        ops = {self._piece(r.chunk, slice_index): r.op for r in step.receives}
        landings = []
        for message in unit.receives:
            op = ops[message.piece]
            first_use = message.piece in self.pending_division
            self.pending_division.discard(message.piece)  # summed with division, or overwritten
            landings.append(Landing(message, op, divide=op is Op.REDUCE and first_use))
        self._landed(landings)
        return Complete(unit, tuple(landings), ends_step)

    def _landed(self, landings: list[Landing]) -> None:
        """What the landings did to the pieces (the wire compiler keeps track)."""


class _WireCompiler(_Compiler):
    """The walk for a narrower wire (see the module docstring): receives land in the wire image
    unless the step also sends the piece; each send of a piece whose image is stale casts it
    first, and rounds it back when nothing lands in it later; the rest is rounded at the end."""

    def __init__(self, plan: tuple[RankStep, ...], piece_sizes: tuple[int, ...], slices: int, window: int, divide: bool):
        super().__init__(plan, piece_sizes, slices, window, divide)
        # The last step that lands anything in each chunk: a send after it sends a final value.
        self.last_landing: dict[int, int] = {}
        for index, step in enumerate(plan):
            for receive in step.receives:
                self.last_landing[receive.chunk] = index
        self.imaged: set[int] = set()  # pieces whose image holds what they would send
        self.exact: set[int] = set()  # pieces equal to their image (copied in, or rounded back)
        self.rounded: set[int] = set()  # pieces this rank has rounded at least once

    def _stages(self, receive, sent: set[int]) -> bool:
        return receive.chunk in sent  # the image is free unless this step still sends from it

    def _casts(self, index: int, sends: list[Message]) -> tuple[Cast, ...]:
        casts = []
        for message in sends:
            piece = message.piece
            if piece in self.imaged:
                continue  # forwarded as received, or cast earlier in the run and unchanged
            chunk = piece // self.slices
            final = self.last_landing.get(chunk, -1) < index
            casts.append(Cast(piece, round_back=final, first=piece not in self.rounded))
            self.rounded.add(piece)
            self.imaged.add(piece)
            if final:
                self.exact.add(piece)
        return tuple(casts)

    def _landed(self, landings: list[Landing]) -> None:
        for landing in landings:
            piece = landing.message.piece
            if landing.op is Op.COPY:
                self.imaged.add(piece)
                self.exact.add(piece)
            else:
                self.imaged.discard(piece)
                self.exact.discard(piece)

    def ending(self) -> dict:
        live = [piece for piece, size in enumerate(self.sizes) if size]
        unrounded = tuple(Cast(piece, round_back=True, first=piece not in self.rounded)
                          for piece in live if piece not in self.exact)
        rounded = self.rounded | {cast.piece for cast in unrounded}
        return {"unrounded": unrounded, "unresidual": tuple(p for p in live if p not in rounded), "wire": True}


_CACHE_SIZE = 256
_cache: OrderedDict[tuple, tuple[Schedule, Program]] = OrderedDict()
_cache_lock = threading.Lock()


def program_for(schedule: Schedule, rank: int, **options) -> Program:
    """:func:`compile_program`, cached per schedule object and arguments (least recently used out).

    Keyed by the schedule's identity, not its value: hashing a schedule of thousands of
    transfers on every bucket would cost more than compiling. The cache holds the schedule,
    so its identity stays unique while its program is cached.
    """
    key = (id(schedule), rank, *sorted(options.items()))
    with _cache_lock:
        cached = _cache.get(key)
        if cached is not None:
            _cache.move_to_end(key)
            return cached[1]
    program = compile_program(schedule, rank, **options)
    with _cache_lock:
        _cache[key] = (schedule, program)
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return program
