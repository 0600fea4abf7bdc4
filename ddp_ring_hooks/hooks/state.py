"""``HookState``: everything the hook needs between calls; it checks, chooses, launches and names failures.

Built on every rank of the group at once, in three steps, the local ones first so that a bad
option is refused before anything is made::

    options ----------------> observation -------------------> plan (collective)
    sorted and checked:       every watcher of the buckets,      the algorithm settled on the
    the algorithm's, the      from one TelemetryOptions          group (ring order, auto's probe);
    telemetry fields, its     (telemetry/observation.py:         the group's context prepared for
    own numbers (options.py)  nothing starts before a bucket)    exactly what it needs (plan.py)

Per bucket, in DDP's order, on the hook thread:

1. **check** the bucket (and, in the first iterations, that every rank reduces the same ones);
2. **choose** its schedule (the plan: ``auto`` per size, ``None`` for ``native``), the dtype
   its transfers carry and, with error feedback, its residual (the plan too), and its executor
   (:func:`~.executors.choose`, the one seam: native, a CUDA lane, a CPU lane);
3. **hand it over** to the observation once (the hand-over mark) and **launch** it; the
   watch goes along as the executor's observer;
4. **name failures** (:class:`~.errors.Failures`): the first one is remembered, and every
   later bucket fails at once with it.

What a state tells (summary, advice, nodes, ring) is a mixin of its own (:mod:`.reports`), and
what a checkpoint or a pickle keeps another (:mod:`.checkpoint`). Like PyTorch's
``PowerSGDState`` it pickles without its process group (and without its threads): after
unpickling, in a checkpoint or a spawned process, it uses the default process group until told
otherwise.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..runtime.wire import bucket_bytes
from ..telemetry.observation import Observation
from .advice import advice_table
from .checkpoint import Checkpointing
from .errors import Failures
from .executors import Launch, Run, choose
from .layout_check import BucketLayout, check_bucket_layout
from .foreign import check_hook_group
from .options import DEFAULT_ALGORITHM, sort_options
from .plan import Plan
from .reports import Reports
from .validation import validate_bucket, validate_bucket_on

if TYPE_CHECKING:  # annotations only
    from ..runtime import ExecutionObserver
    from ..schedules import Schedule
    from ..telemetry import Telemetry, TelemetryOptions


class HookState(Reports, Checkpointing):
    """State of :func:`~ddp_ring_hooks.ring_hook` for one DDP model.

    Args:
        process_group: the group to reduce over; ``None`` means the default (WORLD) group.
        algorithm: the all-reduce algorithm (default ``"ring"``), one of :data:`ddp_ring_hooks.ALGORITHMS`;
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
        device: the model's device, where ``auto``'s probe runs and what the group's side
            resources are made for (``register`` passes the DDP model's; default: GPU
            ``LOCAL_RANK`` on NCCL, else the CPU).
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
        network_probe: when :func:`~ddp_ring_hooks.register` attaches the hook, time the
            algorithm at a few sizes on every rank (a short collective probe, a fraction of a
            second: ``docs/advisor.md``), so the advisor knows the network's α and β from the run
            itself (:mod:`~ddp_ring_hooks.runtime.network_probe`). Default ``None``: when any rank
            writes the run's timeline (a ``log_dir``: what ``advise`` reads); ``True``: always (for a
            live ``state.advise()`` without files); ``False``: never (the advisor then fits the run's
            own buckets and says so).
        concurrent_buckets: on CPU, how many buckets may be reduced at the same time, each on
            a worker thread of its own (default 2; 1 reduces them strictly one after the other).
            With ``observers``, buckets always run one at a time: an observer sees whole
            all-reduces in order. Every rank must end up with the same number of lanes (the
            layout check says so when they do not).
        sparse: what a sparse gradient bucket (``nn.Embedding(sparse=True)``) goes through:
            ``"gather"`` (the default), the group's sparse all-reduce, as PyTorch's
            ``allreduce_hook`` (whatever the algorithm; gloo only); ``"dense"``, the algorithm,
            as a dense tensor of the whole table, then sparse again (``docs/hook.md``).
        hook: instead of an algorithm of ours, your own DDP communication hook
            (``powerSGD_hook``, ``bf16_compress_hook``, any ``hook(state, bucket) -> Future``),
            run unchanged inside ours and timed like every bucket (:mod:`~ddp_ring_hooks.hooks.foreign`);
            ``hook_state``: the state it is called with (``PowerSGDState(...)``, or a process
            group); ``wire_bytes``: ``f(hook_state, bucket) -> int``, the bytes it sent (default:
            the bucket's own). Not with ``algorithm=`` or its options.
        **options: the algorithm's options (see ``algorithm_options``) and the telemetry
            fields, as keywords.

    Example::

        >>> state = HookState(algorithm="ring")
        >>> ddp_model.register_comm_hook(state, ring_hook)
        >>> state = HookState(hook=powerSGD_hook, hook_state=PowerSGDState(None, start_powerSGD_iter=10))
    """

    __slots__ = (
        # What to run, and where: the group, the algorithm (None with hook=), and its plan (the
        # algorithm settled on the group, auto's selector, the group's prepared context, error
        # feedback's residuals; or the user's own hook).
        "process_group",
        "algorithm",
        "algorithm_options",
        "plan",
        # Progress: optimizer steps seen (one DDP reduction each).
        "iteration",
        # Every watcher of the buckets (telemetry, timeline, arrivals, stall watchdog, profiler
        # ranges, the user's observers); pickles its options only.
        "observation",
        # CPU: buckets reduced at the same time, one worker lane each.
        "concurrent_buckets",
        # Reliability: iterations with the cross-rank layout check, reductions run by this
        # process (not restored from a checkpoint: a resumed run rebuilds its buckets and must
        # check their layout again), the index of the next bucket (DDP hands them over in
        # order), the failures (the first one refuses every later bucket).
        "check_layout_steps",
        "_reductions_here",
        "_bucket_index",
        "_failures",
    )

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        algorithm: str | None = None,
        *,
        algorithm_options: Mapping[str, object] | None = None,
        telemetry: TelemetryOptions | Telemetry | None = None,
        observers: tuple[ExecutionObserver, ...] = (),
        check_layout_steps: int = 2,
        concurrent_buckets: int = 2,
        device: torch.device | str | None = None,
        error_feedback: bool = False,
        network_probe: bool | None = None,
        sparse: str = "gather",
        hook: Callable | None = None,
        hook_state: object = None,
        wire_bytes: Callable | None = None,
        **options,
    ) -> None:
        given = sort_options(algorithm, algorithm_options, options, check_layout_steps=check_layout_steps,
                             concurrent_buckets=concurrent_buckets, error_feedback=error_feedback,
                             network_probe=network_probe, sparse=sparse, hook=hook, hook_state=hook_state,
                             wire_bytes=wire_bytes)
        if given.foreign is not None:
            check_hook_group(given.foreign, process_group)
        else:
            algorithm = algorithm or DEFAULT_ALGORITHM
        self.process_group = process_group
        self.algorithm = algorithm
        self.iteration = 0
        self.check_layout_steps = check_layout_steps
        self.concurrent_buckets = concurrent_buckets
        # Local first (every option refused before anything is made), then the collective part.
        self.observation = Observation(telemetry, observers=observers, advice=advice_table, **given.telemetry)
        self.observation.check_group(self.group)
        self.plan = Plan(process_group, algorithm, given.algorithm, device=device, feedback=given.feedback,
                         network_probe=network_probe, foreign=given.foreign, sparse=given.sparse)
        self.algorithm_options = self.plan.options
        self._restarted(process_group=process_group)
        self.warn_misplaced(stacklevel=2)

    def _restarted(self, *, process_group: dist.ProcessGroup | None) -> None:
        """What a state starts afresh with, when built or unpickled (see :mod:`.checkpoint`)."""
        self.process_group = process_group
        self._failures = Failures(self.observation.stall_report)
        self._reductions_here = self._bucket_index = 0

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
        """The (checked, cached) schedule used for this buffer; ``None`` for ``native``, a
        foreign hook's bucket or a gathered sparse one (:meth:`.plan.Plan.schedule_of_bucket`)."""
        return self.plan.schedule_of_bucket(buffer, self.world_size)

    def wire_for(self, buffer: torch.Tensor, schedule: Schedule | None) -> torch.dtype | None:
        """The dtype ``buffer``'s transfers carry (``None``: its own); a ``TypeError`` naming the
        fix when the wire dtype is not narrower than the bucket (:meth:`.plan.Plan.wire_for`)."""
        return self.plan.wire_for(buffer, schedule)

    def reduce_bucket(self, buffer: torch.Tensor, *, is_last: bool, parameters=None,
                      grad_bucket: dist.GradBucket | None = None) -> torch.futures.Future:
        """Average ``buffer`` over the group in place; the Future holds ``buffer`` (a sparse
        bucket's: the averaged sparse tensor). ``parameters``: how to list the bucket's
        parameters (``GradBucket.parameters``), for error feedback across DDP's rebuild of its
        buckets; ``grad_bucket``: DDP's bucket itself (what a foreign hook is called with)."""
        entered = time.perf_counter()  # the hook's own time on DDP's thread: the timeline's call_ms
        # 1. check
        validate_bucket(buffer)
        bucket, self._bucket_index = self._bucket_index, 0 if is_last else self._bucket_index + 1
        checking_layout = self._reductions_here < self.check_layout_steps
        if checking_layout or self._reductions_here == 0:
            validate_bucket_on(buffer, self.process_group)
        # 2. choose: the schedule, its wire and residual, and the executor (the one seam)
        plan = self.plan
        schedule = self.schedule_for(buffer)
        wire = self.wire_for(buffer, schedule)
        residual = plan.residual_for(bucket, buffer, wire, parameters=parameters, is_last=is_last)
        executor = choose(schedule, buffer, lanes=1 if self.observers else self.concurrent_buckets,
                          foreign=plan.foreign, densify=plan.densifies)
        run = Run(self.group, plan.context(self.group), self._failures)
        iteration = self.iteration  # reductions done before this one
        algorithm = executor.label(schedule)
        if checking_layout:  # on NCCL on a gloo group with the same ranks: no CUDA tensor, no host sync
            layout = BucketLayout(bucket, buffer.numel(), buffer.dtype, is_last, schedule, executor.lanes, wire,
                                  kind=executor.kind, label=algorithm)
            check_bucket_layout(layout, group=run.context.control_group(), iteration=iteration)
        if is_last:
            self.iteration += 1
            self._reductions_here += 1
        # 3. hand over, once (the hand-over mark: queue_ms, exposed_ms and the rank's arrival
        # start here), and launch, the watch as the executor's observer
        watch = self.observation.hand_over(
            buffer, step=iteration + 1, index=bucket, is_last=is_last, algorithm=algorithm, group=self.group,
            size=bucket_bytes(buffer, wire, kind=executor.kind, world_size=self.world_size), entered=entered,
        )
        launch = Launch(buffer, schedule, watch, bucket, iteration, wire, residual, grad_bucket)
        future = executor.launch(launch, run)
        # 4. name failures (the stall watchdog's too, when it fails the bucket first)
        return watch.launched(future, explain=functools.partial(run.failures.named, algorithm, buffer, bucket, iteration))

    def paused(self, reason: str):
        """``with state.paused("checkpoint"):`` marks planned asymmetric work (a checkpoint
        written by rank 0, an evaluation): the ranks that wait for this one meanwhile say
        nothing of it (no "busy" line, no verdict) and ``stall_timeout`` never fails the job
        for it; the group's own timeout still would. Costs one store write as it starts (in the
        store before the work: it may hold the GIL from its first line); nestable. The Lightning
        strategy and the transformers callback pause around checkpoints and evaluation."""
        return self.observation.watchdog.paused(reason)

    def close(self) -> None:
        """Stop the worker threads after the queued buckets and shut what the group's context
        made for this state (the last state on a group: pairs' sockets, side groups), then close
        the observation: the advice panel, the timeline, the queued telemetry and its sinks. A
        later bucket prepares them anew. Safe to call twice."""
        self.plan.release()  # once per hold: a state used again after close holds again
        self.observation.close()
