"""``HookState``: everything the hook needs between calls, and how a bucket gets reduced.

The state holds the process group, the algorithm and its options, the step counter and the
observation of its buckets (:class:`~ddp_ring_hooks.telemetry.Observation`: every watcher,
configured by one :class:`~ddp_ring_hooks.telemetry.TelemetryOptions`). Its own job is to
check, choose, launch and name failures; it hands each bucket to the observation once, as
DDP hands it over, and the watch it gets back goes along as the executor's observer. Like
PyTorch's ``PowerSGDState`` it pickles without its process group (and without its threads):
after unpickling, in a checkpoint or a spawned process, it uses the default process group
until told otherwise.

How a bucket is reduced is decided in one place, :meth:`HookState._launch`:

- ``native`` (also when ``auto`` picks it): the group's own ``all_reduce``, issued on the
  hook thread like DDP's builtin hook (:func:`~ddp_ring_hooks.runtime.native.run_native`).
- CUDA (NCCL): on the device's communication stream, launched by a worker thread of its own
  on a process group of its own (:mod:`~ddp_ring_hooks.runtime.cuda_lane` says why each):
  the autograd thread only makes that stream wait for the compute stream and queues the
  bucket; the Future completes on the side stream. No host sync anywhere.
- CPU (gloo): on a :class:`~ddp_ring_hooks.runtime.CommWorker` thread, so the autograd thread
  goes on computing gradients of earlier layers while this bucket travels. Bucket ``i`` of
  every iteration goes to lane ``i % concurrent_buckets`` (a worker of its own, its messages
  tagged with the lane): each lane takes its buckets in DDP's order, the same on every rank,
  and two buckets can be on the wire at once, as gloo's own two worker threads do for DDP's
  default hook (what that gained: ``docs/design-history.md``).

The result is the average. The schedules divide each piece by the group size at its first use
(before it is sent, or fused into the first addition), as PyTorch's ``allreduce_hook`` divides
before summing (no fp16 overflow); ``native`` multiplies by ``1 / world_size`` first, as DDP's
reducer does, so it matches DDP without a hook bit for bit.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Mapping

import torch
import torch.distributed as dist

from ..advisor import advise
from ..runtime import ExecutionObserver, run_schedule, worker_for, workers_of
from ..runtime import cuda_lane as cuda
from ..runtime import directions
from ..runtime.ring_orders import known_nodes, settle_ring_order
from ..runtime.collectives import check_device_backend
from ..runtime.errors import CommunicationError
from ..runtime.names import NATIVE, check_algorithm_name, has_schedule
from ..runtime.native import run_native
from ..runtime.selection import AUTO, AutoSelector, auto_option_names
from ..runtime.wire import bucket_bytes, tensor_bytes, wire_dtype_for
from ..schedules import Schedule, checked_schedule, get_algorithm, resolve_options, ring_order_of
from ..telemetry import TELEMETRY_OPTIONS, Telemetry, TelemetryOptions
from ..telemetry.observation import Observation
from ..telemetry.stall import check_stall_timeout
from ..telemetry.watcher import BucketWatch
from . import checkpoint
from .advice import advice_table, placement_warning, ring_order_line
from .error_feedback import ErrorFeedback, feedback_for
from .errors import HookFailedError
from .layout_check import BucketLayout, check_bucket_layout
from .validation import validate_bucket, validate_group


class HookState:
    """State of :func:`~ddp_ring_hooks.ring_hook` for one DDP model.

    Args:
        process_group: the group to reduce over; ``None`` means the default (WORLD) group.
        algorithm: the all-reduce algorithm, one of :data:`ddp_ring_hooks.ALGORITHMS`;
            ``"native"``: the group's own ``all_reduce``, bit-identical to DDP without a hook,
            with this hook's telemetry (one option, ``wire_dtype``: with ``"bf16"`` it is
            PyTorch's ``bf16_compress_hook``, timed); or ``"auto"``: per bucket, the fastest
            (``native`` included) under a cost model calibrated by a short collective probe
            right here (so every rank must build its state together); options
            ``calibration=``, ``local_size=``, ``segments=``, ``candidates=``, see
            :class:`~ddp_ring_hooks.runtime.selection.AutoSelector`.
        algorithm_options: the algorithm's own options, e.g. ``{"segments": 4}`` for tree or
            ``{"local_size": 8}`` for hierarchical (default ``LOCAL_WORLD_SIZE``). They may
            also be given as keywords (``HookState(algorithm="tree", segments=4)``). Checked
            here, against the algorithm's registry record: an unknown name is a ``TypeError``
            that names the valid ones.
        device: the model's device, where ``auto``'s probe runs (``register`` passes the DDP
            model's; default: GPU ``LOCAL_RANK`` on NCCL, else the CPU).
        telemetry: the watching of every bucket (TensorBoard, trace, summary, the advisor's
            timeline, stragglers), a :class:`~ddp_ring_hooks.telemetry.TelemetryOptions` or a
            ready :class:`~ddp_ring_hooks.telemetry.Telemetry`; or give its fields as keywords
            (``log_dir=``, ``log_every=``, ``trace_steps=``, ``per_rank=``, ``spread_every=``,
            ``sinks=``, ...), not the same field both ways. Nothing is recorded unless one of
            them asks for it. The stall watchdog always watches: ``stall_after=`` (seconds, 60)
            names the rank everyone waits for, ``stall_timeout=`` (seconds; default just under
            the process group's own timeout) fails the bucket with a ``HookFailedError``
            naming it (``docs/reliability.md``).
        observers: more :class:`~ddp_ring_hooks.runtime.ExecutionObserver` s that watch every
            bucket's all-reduce, e.g. a :class:`~ddp_ring_hooks.runtime.recording.TraceRecorder`
            to replay your own training with ``ddp-ring-hooks animate --trace``.
        check_layout_steps: for this many first iterations, check across ranks that every
            rank reduces the same buckets (see :mod:`~ddp_ring_hooks.hooks.layout_check`);
            ``0`` turns the check off.
        error_feedback: with a narrower ``wire_dtype`` (bf16, fp16), keep what rounding lost
            of each bucket and add it back at the next step, so the error does not build up over
            training (:mod:`~ddp_ring_hooks.hooks.error_feedback`; default ``False``).
        concurrent_buckets: on CPU, how many buckets may be reduced at the same time, each on
            a worker thread of its own (default 2; 1 reduces them strictly one after the other).
            With ``observers``, buckets always run one at a time: an observer sees whole
            all-reduces in order. Every rank must end up with the same number of lanes (the
            layout check says so when they do not).
        **options: the algorithm's options (see ``algorithm_options``) and the telemetry
            fields, as keywords.

    Example::

        >>> state = HookState(algorithm="ring")
        >>> ddp_model.register_comm_hook(state, ring_hook)
    """

    __slots__ = (
        # What to run, and where.
        "process_group",
        "algorithm",
        "algorithm_options",
        # Progress: optimizer steps seen (one DDP reduction each).
        "iteration",
        # Every watcher of the buckets (telemetry, timeline, arrivals, profiler ranges, the
        # user's observers); pickles its options only.
        "observation",
        # CPU: buckets reduced at the same time, one worker lane each.
        "concurrent_buckets",
        # algorithm="auto": the calibrated per-bucket chooser (None otherwise).
        "_auto",
        # Reliability: iterations with the cross-rank layout check, the index of the next
        # bucket (DDP hands them over in order), the first communication failure (the group
        # is unusable after it, so later buckets fail at once instead of waiting).
        "check_layout_steps",
        "_reductions_here",
        "_bucket_index",
        "_failure",
        # error_feedback=True: every bucket's rounding residual (None otherwise).
        "_feedback",
    )

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        algorithm: str = "ring",
        *,
        algorithm_options: Mapping[str, object] | None = None,
        telemetry: TelemetryOptions | Telemetry | None = None,
        observers: tuple[ExecutionObserver, ...] = (),
        check_layout_steps: int = 2,
        concurrent_buckets: int = 2,
        device: torch.device | str | None = None,
        error_feedback: bool = False,
        **options,
    ) -> None:
        check_counts(check_layout_steps=check_layout_steps, concurrent_buckets=concurrent_buckets)
        check_algorithm_name(algorithm)
        telemetry_fields = {name: options.pop(name) for name in TELEMETRY_OPTIONS if name in options}
        options = _merged_options(algorithm_options, options)
        self.process_group = process_group
        self.algorithm = algorithm
        # Checked and resolved now (defaults filled in, LOCAL_WORLD_SIZE read once, here):
        # a typo fails at construction, not at the first backward.
        self.algorithm_options = options if algorithm == AUTO else _resolved(algorithm, options)
        if algorithm != AUTO:  # every rank meets here: "hosts", "measured" settle on one order (auto: in its probe)
            self.algorithm_options = settle_ring_order(self.algorithm_options, self.process_group)
            misplaced = placement_warning(self)
            if misplaced:
                warnings.warn(misplaced, stacklevel=2)
        self.iteration = 0
        self.check_layout_steps = check_layout_steps
        self.concurrent_buckets = concurrent_buckets
        # Reductions run by this process, not restored from a checkpoint: a resumed run
        # rebuilds its buckets and must check their layout again.
        self._reductions_here = 0
        self._bucket_index = 0
        self._failure: CommunicationError | None = None
        self._feedback = feedback_for(error_feedback, algorithm=algorithm, options=self.algorithm_options)
        self._auto = (
            AutoSelector.probed(self.group, device=device, **_auto_options(options)) if algorithm == AUTO else None
        )
        cuda.prepare(self.group)  # NCCL: the side groups, made while every rank is here
        directions.prepare(self.group)  # gloo: the upward transport, a socket per direction of each pair
        self.observation = Observation(telemetry, observers=observers, advice=advice_table, **telemetry_fields)
        check_stall_timeout(self.observation.options, self.group)

    # -- the watchers, by name ---------------------------------------------------------------

    @property
    def telemetry(self) -> Telemetry:
        """The per-bucket recorder (TensorBoard, trace, summary)."""
        return self.observation.recorder

    @property
    def timeline(self):
        """The advisor's timeline (:class:`~ddp_ring_hooks.telemetry.timeline.Timeline`)."""
        return self.observation.timeline

    @property
    def observers(self) -> tuple[ExecutionObserver, ...]:
        """The user's observers of every bucket's all-reduce (not pickled)."""
        return self.observation.observers

    # -- the group -----------------------------------------------------------------------

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group in use (the default group when none was given)."""
        return self.process_group if self.process_group is not None else dist.group.WORLD

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        return dist.get_world_size(self.group)

    # -- reducing a bucket ---------------------------------------------------------------

    def schedule_for(self, buffer: torch.Tensor) -> Schedule | None:
        """The (checked, cached) schedule used for this buffer; ``None`` for ``native``."""
        nbytes = tensor_bytes(buffer)
        if self._auto is not None:
            algorithm, options = self._auto.choose(nbytes)
        else:
            algorithm, options = self.algorithm, self.algorithm_options
        return checked_schedule(algorithm, self.world_size, nbytes=nbytes, **options) if has_schedule(algorithm) else None

    def lanes_for(self, buffer: torch.Tensor, schedule: Schedule | None = None) -> int:
        """Worker lanes the buckets go to, round robin: ``concurrent_buckets`` on CPU; one with
        ``observers`` (they see whole all-reduces in order); none (1) on CUDA (one worker per
        device) and for ``native`` (no worker)."""
        return 1 if buffer.is_cuda or self.observers or schedule is None else self.concurrent_buckets

    def wire_for(self, buffer: torch.Tensor, schedule: Schedule | None) -> torch.dtype | None:
        """The dtype ``buffer``'s transfers carry (``None``: its own); a ``TypeError`` naming the
        fix when the wire dtype is not narrower than the bucket."""
        if schedule is not None:
            return wire_dtype_for(buffer.dtype, schedule.options)
        native = self._auto.choose(tensor_bytes(buffer))[1] if self._auto is not None else self.algorithm_options
        return wire_dtype_for(buffer.dtype, native)

    def reduce_bucket(self, buffer: torch.Tensor, *, is_last: bool, parameters=None) -> torch.futures.Future:
        """Average ``buffer`` over the group in place; the Future holds ``buffer``.
        ``parameters``: how to list the bucket's parameters (``GradBucket.parameters``), for
        error feedback across DDP's rebuild of its buckets."""
        validate_bucket(buffer)
        bucket, self._bucket_index = self._bucket_index, 0 if is_last else self._bucket_index + 1
        checking_layout = self._reductions_here < self.check_layout_steps
        if checking_layout or self._reductions_here == 0:
            validate_group(self.process_group)
            check_device_backend(buffer.device.type, str(dist.get_backend(self.group)))
        schedule = self.schedule_for(buffer)
        wire = self.wire_for(buffer, schedule)
        residual = None
        if self._feedback is not None and wire is not None:
            residual = self._feedback.prepare(bucket, buffer, parameters, is_last=is_last)
        lanes = self.lanes_for(buffer, schedule)
        if checking_layout:
            # On NCCL, on a gloo group with the same ranks: no CUDA tensor, no host sync.
            check_bucket_layout(
                BucketLayout(bucket, buffer.numel(), buffer.dtype, is_last, schedule, lanes, wire),
                group=cuda.control_group(self.group), iteration=self.iteration,
            )
        iteration = self.iteration  # reductions done before this one
        if is_last:
            self.iteration += 1
            self._reductions_here += 1
        # Handed to the observation once, checked and with its algorithm: the hand-over mark
        # (queue_ms, exposed_ms and the rank's arrival start here), and the watch that goes
        # along as the executor's observer.
        watch = self.observation.hand_over(
            buffer, step=iteration + 1, index=bucket, is_last=is_last,
            algorithm=schedule.algorithm if schedule is not None else NATIVE, group=self.group,
            size=bucket_bytes(buffer, wire),
        )
        algorithm = watch.algorithm
        return watch.launched(
            self._launch(schedule, buffer, watch, bucket=bucket, iteration=iteration, lane=bucket % lanes,
                         wire=wire, residual=residual),
            explain=lambda error: self._failed(algorithm, buffer, bucket, iteration, error),
        )

    def _launch(
        self, schedule: Schedule | None, buffer: torch.Tensor, watch: BucketWatch, *,
        bucket: int, iteration: int, lane: int, wire: torch.dtype | None = None, residual: torch.Tensor | None = None,
    ) -> torch.futures.Future:
        """The one place that picks how a bucket is reduced (see the module docstring)."""
        if schedule is None:  # native: the group's own all-reduce, DDP's scaling
            return self._native_or_explain(buffer, watch, bucket=bucket, iteration=iteration, wire=wire, residual=residual)
        if buffer.is_cuda:
            # The watch's hand-over mark is an event after the kernels that produced this
            # bucket; the worker orders its side stream after it when it starts the bucket
            # (see runtime/cuda_lane.py).
            side = cuda.cuda_lane(self.group, buffer.device)

            def job():
                cuda.wait_handed_over(watch.handed)
                return self._average_or_explain(schedule, buffer, watch, bucket=bucket, iteration=iteration,
                                                group=side.group, residual=residual)

            devices = [buffer.device]
            worker = side.worker
        else:
            job = lambda: self._average_or_explain(  # noqa: E731
                schedule, buffer, watch, bucket=bucket, iteration=iteration, tag=lane, residual=residual)
            devices = None
            worker = worker_for(self.group, lane)
        # DDP reads a failed Python Future as a value ("Unable to cast ... to Tensor"); a
        # callback that re-raises turns it into a real error that keeps our message.
        return worker.submit(watch.running(job), devices=devices).then(_value_or_raise)

    def _average(
        self, schedule: Schedule, buffer: torch.Tensor, observer: ExecutionObserver, tag: int,
        group: dist.ProcessGroup | None = None, residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if residual is not None:  # error feedback: last step's losses go in first
            ErrorFeedback.add_into(buffer, residual, schedule.world_size)
        return run_schedule(
            schedule, buffer, group=group or self.group, observer=observer, divisor=schedule.world_size, tag=tag,
            residual=residual,
        )

    def _average_or_explain(
        self, schedule: Schedule, buffer: torch.Tensor, observer: ExecutionObserver, *,
        bucket: int, iteration: int, tag: int = 0, group: dist.ProcessGroup | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`_average`, with failures that name the hook and bucket; once communication
        failed, every later bucket fails at once instead of waiting for the timeout again."""
        self._refuse_after_failure(schedule.algorithm, bucket, iteration)
        try:
            return self._average(schedule, buffer, observer, tag, group, residual)
        except RuntimeError as error:  # backend errors (DistBackendError) and StepFailedError
            raise self._failed(schedule.algorithm, buffer, bucket, iteration, error) from error

    def _native_or_explain(
        self, buffer: torch.Tensor, observer: ExecutionObserver, *, bucket: int, iteration: int,
        wire: torch.dtype | None = None, residual: torch.Tensor | None = None,
    ) -> torch.futures.Future:
        """``native``'s all-reduce, failing like the schedules: named, through the Future (as a
        schedule bucket fails, so DDP's end of backward raises it), and at once after a
        failure (under ``auto`` native and schedule buckets share one record of it). On CUDA
        the Future completes at once and NCCL reports errors through its own watchdog, so
        only gloo's Future is watched."""
        try:
            self._refuse_after_failure(NATIVE, bucket, iteration)
            if residual is not None:
                ErrorFeedback.add_into(buffer, residual, self.world_size)
            future = run_native(buffer, group=self.group, observer=observer, average=True, wire=wire, residual=residual)
        except RuntimeError as error:  # refused, or the backend failed to start the collective
            failure = error
            if not isinstance(error, CommunicationError):
                failure = self._failed(NATIVE, buffer, bucket, iteration, error)
                failure.__cause__ = error
            failed = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
            failed.set_exception(failure)
            return failed.then(_value_or_raise)
        if buffer.is_cuda:
            return future

        def value_or_explain(done: torch.futures.Future) -> torch.Tensor:
            try:
                return done.value()
            except RuntimeError as error:
                raise self._failed(NATIVE, buffer, bucket, iteration, error) from error

        return future.then(value_or_explain)

    def _refuse_after_failure(self, algorithm: str, bucket: int, iteration: int) -> None:
        if self._failure is not None:
            raise CommunicationError(
                f"ring_hook ({algorithm}): bucket {bucket} of iteration {iteration} was not reduced because an "
                f"earlier one failed: {self._failure}"
            )

    def _failed(self, algorithm: str, buffer: torch.Tensor, bucket: int, iteration: int, error: BaseException) -> HookFailedError:
        """Remember the first failure (later buckets are refused with it) and return it, named;
        while the stall watchdog sees a bucket wait too long, with its finding (a peer that gave
        up on the stalled rank closes its connections, and this bucket's error would name it)."""
        failure = HookFailedError(
            hook="ring_hook", algorithm=algorithm, bucket=bucket, iteration=iteration, numel=buffer.numel(),
            dtype=str(buffer.dtype).removeprefix("torch."), cause=error, stalled=self.observation.stall_report(),
        )
        if self._failure is None:
            self._failure = failure
        return failure

    def paused(self, reason: str):
        """``with state.paused("checkpoint"):`` marks planned asymmetric work (a checkpoint
        written by rank 0, an evaluation): the ranks that wait for this one meanwhile say
        nothing of it (no "busy" line, no verdict) and ``stall_timeout`` never fails the job
        for it; the group's own timeout still would. Costs one store write as it starts (in the
        store before the work: it may hold the GIL from its first line); nestable. The Lightning
        strategy and the transformers callback pause around checkpoints and evaluation."""
        return self.observation.watchdog.paused(reason)

    def close(self) -> None:
        """Stop the worker threads after the queued buckets (they restart on the next bucket),
        then close the observation: the advice panel, the timeline, the queued telemetry and
        its sinks. Safe to call twice."""
        for worker in workers_of(self.group):
            worker.close()
        self.observation.close()

    def summary(self) -> str:
        """The per-bucket communication summary table (count, p50/p90/max ms, bytes, busbw),
        a line naming the rank that kept the others waiting (with ``spread_every``), one naming
        a slow link or network (with ``links=True``), and one on what the ring's order costs when
        it crosses the nodes more than it must."""
        lines = [ring_order_line(self), self._feedback.summary_line() if self._feedback is not None else ""]
        return self.telemetry.summary() + "".join(f"\n{line}" for line in lines if line)

    @property
    def nodes(self) -> tuple[int, ...] | None:
        """The node of each rank of the group, as its ranks said when the state was built
        (``GROUP_RANK``); ``None`` when they did not say."""
        return known_nodes(self.process_group) if dist.is_available() and dist.is_initialized() else None

    @property
    def ring(self) -> tuple[int, ...] | None:
        """The order the ring visits the ranks (``None``: the algorithm has no ring order)."""
        return None if self.algorithm == AUTO else ring_order_of(self.algorithm_options, self.world_size)

    def advise(self, **options) -> dict:
        """What to change (bucket size, accumulation, algorithm, world size), predicted from this
        run's timeline; see :func:`ddp_ring_hooks.advisor.advise` (``network=`` costs another cluster)."""
        return advise(self.timeline.records(), **options)

    # -- checkpoints --------------------------------------------------------------------

    def state_dict(self) -> dict:
        """What a checkpoint keeps of this state, as plain values (``accelerator.register_for_checkpointing(state)``
        works with it); what is saved and what deliberately not: :mod:`~ddp_ring_hooks.hooks.checkpoint`."""
        return checkpoint.state_dict_of(self)

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Continue from a :meth:`state_dict`: the step counter, and ``auto``'s calibration where
        it applies; the algorithm and telemetry stay as registered (see :mod:`~ddp_ring_hooks.hooks.checkpoint`)."""
        checkpoint.load_state_dict_into(self, state_dict)

    # -- pickling ------------------------------------------------------------------------

    def __getstate__(self) -> dict:
        # Process groups and threads cannot be pickled; they are rebuilt on load.
        kept = ("algorithm", "algorithm_options", "iteration", "observation", "concurrent_buckets", "_auto",
                "check_layout_steps", "_feedback")
        return {"version": _PICKLE_VERSION, **{name: getattr(self, name) for name in kept}}

    def __setstate__(self, state: dict) -> None:
        state = _current_pickle(dict(state))
        self._feedback = None  # pickled before error feedback existed: off
        for name, value in state.items():
            setattr(self, name, value)
        self.process_group = None
        self._failure = None
        self._reductions_here = self._bucket_index = 0


def _value_or_raise(future: torch.futures.Future) -> torch.Tensor:
    return future.value()


#: What ``__getstate__`` writes; 1 was the format with ``telemetry`` and ``timeline`` of their own.
_PICKLE_VERSION = 2


def _current_pickle(state: dict) -> dict:
    """A pickled state in today's format: version 1 (``telemetry`` and ``timeline`` pickled
    apart) is read into one observation with the telemetry's options; older ones are refused."""
    version = state.pop("version", 1)
    if version == 1:
        if "telemetry" not in state:
            raise ValueError(
                "this HookState was pickled by a ddp_ring_hooks too old to read (it has no telemetry); "
                "build a new HookState with the same options"
            )
        telemetry, _ = state.pop("telemetry"), state.pop("timeline", None)  # the timeline kept only log_dir
        state["observation"] = Observation(telemetry.options, advice=advice_table)
        state.setdefault("concurrent_buckets", 2)  # pickled before the option existed
    elif version != _PICKLE_VERSION:
        raise ValueError(
            f"this HookState was pickled by a newer ddp_ring_hooks (format {version}, this one reads up to "
            f"{_PICKLE_VERSION}); upgrade ddp_ring_hooks to load it"
        )
    return state


#: ``HookState``'s own options that ``register`` and the Lightning strategy pass on (besides the
#: algorithm's options and the telemetry fields, ``TELEMETRY_OPTIONS``).
HOOK_OPTIONS = ("telemetry", "observers", "check_layout_steps", "concurrent_buckets", "error_feedback")

#: What ``HookState`` itself takes besides an algorithm's options (for error messages).
_STATE_OPTIONS = ("process_group", "algorithm", "algorithm_options", *TELEMETRY_OPTIONS, *HOOK_OPTIONS, "device")


def check_counts(*, check_layout_steps: int = 2, concurrent_buckets: int = 2) -> None:
    """``HookState``'s own numbers, checked (also by the Lightning strategy, when it is built)."""
    if isinstance(check_layout_steps, bool) or not isinstance(check_layout_steps, int) or check_layout_steps < 0:
        raise ValueError(f"check_layout_steps must be an integer >= 0, got {check_layout_steps!r}")
    if isinstance(concurrent_buckets, bool) or not isinstance(concurrent_buckets, int) or concurrent_buckets < 1:
        raise ValueError(f"concurrent_buckets must be an integer >= 1, got {concurrent_buckets!r}")


def _merged_options(mapping: Mapping[str, object] | None, keywords: dict[str, object]) -> dict[str, object]:
    both = sorted(set(mapping or {}) & set(keywords))
    if both:
        raise TypeError(f"option {', '.join(map(repr, both))} given twice: in algorithm_options and as a keyword")
    return {**(mapping or {}), **keywords}


def _resolved(algorithm: str, options: dict[str, object]) -> dict[str, object]:
    """The algorithm's options checked against its registry record, defaults filled in; an
    unknown name is reported with everything ``HookState`` accepts."""
    try:
        return resolve_options(algorithm, options)
    except TypeError as error:
        unknown = sorted(set(options) - set(get_algorithm(algorithm).option_names))
        raise TypeError(_unknown_option_message(unknown, algorithm, get_algorithm(algorithm).option_names)) from error


def _auto_options(options: dict[str, object]) -> dict[str, object]:
    accepted = auto_option_names()
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TypeError(_unknown_option_message(unknown, AUTO, accepted))
    return options


def _unknown_option_message(unknown: list[str], algorithm: str, algorithm_options: tuple[str, ...]) -> str:
    everything = (*_STATE_OPTIONS, *algorithm_options)
    close = difflib.get_close_matches(unknown[0], everything, n=1)
    return (
        f"HookState got unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}"
        + (f" (did you mean {close[0]!r}?)" if close else "")
        + f". HookState takes {', '.join(_STATE_OPTIONS)}; the {algorithm} algorithm takes "
        + (", ".join(algorithm_options) if algorithm_options else "no options")
    )
