"""``Timeline``: what a prediction of another setting needs, recorded per optimizer step.

The per-bucket telemetry (:mod:`.recorder`) says how long each all-reduce took. To predict a
step with another bucket size, accumulation or algorithm, the advisor
(:mod:`ddp_ring_hooks.advisor`) also needs the *compute* around it::

    step n                                                            step n+1
    |- micro 1 (no_sync) -|- micro 2 (no_sync) -|- micro 3 (sync) ------------------|-
    fwd bwd               fwd bwd               fwd | bwd              | opt  rest  fwd
                                                    ^ backward starts  ^ last bucket handed
                                                    |  b0 b1 b2 handed: ready_ms  |
                                                    |  [== b0 ==] [== b1 ==]      | exposed
                                                    |       lane 0 / lane 1 ... ->|

- **step boundaries**: a forward pre-hook on the DDP module; a micro-batch is a forward with
  grad enabled, a step ends after the micro-batch that ran with gradient sync on (DDP's
  ``require_backward_grad_sync``; ``no_sync()`` turns it off);
- **backward start**: a gradient hook on the forward's first output that requires grad;
- **buckets**: bytes (and a sparse bucket's kind, nnz and its size both ways), when each was handed over (relative to backward start), when its
  communication started and ended, and the CPU time its worker thread spent on it
  (``time.thread_time`` on the worker: on CPU, communication "hidden" behind backward still
  takes cores from it);
- **the other threads' CPU time** during the synchronizing micro-batch (``process_time`` minus
  the training thread's ``thread_time``): every byte the communication copies or adds there;
- **arrivals**: on the steps that gather them (``spread_every``, ``diagnose=True``), when each
  rank handed its last bucket over, relative to rank 0 (the arrivals gather calls
  :meth:`Timeline.arrived`): how far the ranks scatter, which a larger world waits for;
- **optimizer time**: PyTorch's global optimizer step pre/post hooks (the part after the last
  bucket: Lightning runs the micro-batch inside ``optimizer.step(closure)``);
- **the run**: world size, algorithm, lanes, DDP's bucket cap and first-bucket cap, every
  parameter's gradient bytes in registration order (and which are sparse), cores and threads.

A watcher of the observation (:mod:`.observation`): the bucket times are the observation's
own marks (hand-over, first phase, end, the worker's CPU time), numbered with the hook state's
step. Each finished step is one :class:`~.timeline_records.TimelineStep` line in
``log_dir/timeline.jsonl`` (rank 0; the first line, a :class:`~.timeline_records.TimelineRun`,
describes the run; the first ``FILE_STEPS`` steps of this run, then one in ``THIN_EVERY``, so a
long run leaves a small file) and stays in memory (the last ``keep`` steps): advice works
offline from ``log_dir`` and live from ``state.advise()``. Cost: a few clock reads per
micro-batch, and one short line written per step.

Telemetry never imports ``hooks`` or ``advisor``: the hook state feeds this, the advisor reads it.
"""

from __future__ import annotations

import json
import os
import threading
import time
import weakref
from collections import deque

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from ..runtime.sparse import sparse_parameters
from .bucket_marks import BucketClocks
from .options import group_log_dir
from .timeline_records import TimelineArrivals, TimelineBucket, TimelineRecord, TimelineRun, TimelineStep, record_from_json
from .watcher import Watcher

TIMELINE_FILE = "timeline.jsonl"
#: Steps written to the file: all of the first FILE_STEPS, then one in THIN_EVERY.
FILE_STEPS, THIN_EVERY = 1000, 100


def _now_ms() -> float:
    return time.perf_counter() * 1e3  # the host timer's clock (timer.HostTimer), in ms


class _Step:
    """The marks of one optimizer step while it runs (its buckets: the observation's watches)."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.micro_starts: list[float] = []
        self.nosync_other_cpu_ms: list[float] = []
        self.sync_start: float | None = None
        self.backward_start: float | None = None
        self.buckets: list = []
        self.last_handed: float | None = None
        self.sync_other_cpu_ms = 0.0
        self.optimizer_ms = 0.0
        self._cpu_mark = (0.0, 0.0)

    def cpu_mark(self) -> None:
        self._cpu_mark = (time.process_time(), time.thread_time())

    def other_cpu_ms(self) -> float:
        """CPU ms of every thread but this one since the last :meth:`cpu_mark`."""
        process, thread = self._cpu_mark
        return max(0.0, ((time.process_time() - process) - (time.thread_time() - thread)) * 1e3)

    def finished_ends_ms(self) -> list[float]:
        return [bucket.timer.clock_ms(bucket.end) for bucket in self.buckets if bucket.end is not None]


class Timeline(Watcher):
    """Step, micro-batch and bucket marks of one DDP model, for the advisor.

    Built by the observation of a :class:`~ddp_ring_hooks.HookState`;
    :func:`~ddp_ring_hooks.register` (and the Lightning strategy) attach it to the DDP model,
    which starts the recording. A state attached to DDP by hand (``register_comm_hook``)
    records nothing here.

    Args:
        log_dir: also write ``log_dir/timeline.jsonl`` (the hook group's rank 0; a group that
            is not every rank writes to ``log_dir/group_0-3``, see :func:`~.options.group_log_dir`).
        keep: finished steps kept in memory (the oldest are forgotten): a few KB each.
    """

    def __init__(self, *, log_dir: str | os.PathLike | None = None, keep: int = 256) -> None:
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self.keep = keep
        self._reset()

    def _reset(self) -> None:
        self.run: TimelineRun | None = None
        self.group = None
        self.directory: str | None = None  # where this group's timeline.jsonl goes (attach)
        self.run_facts: dict = {}  # what the hook state knows of the run (nodes, ring): the observation sets it
        self.steps: deque[TimelineStep] = deque(maxlen=self.keep)
        self.arrivals: deque[TimelineArrivals] = deque(maxlen=self.keep)  # the steps that gathered them
        self._finished = 0  # steps finished in this run (the file keeps the first ones)
        self._recording = False
        self._step: _Step | None = None
        self._synced = False  # the open step's synchronizing micro-batch has run
        self._micro_sync = False
        self._file = None
        self._lock = threading.Lock()
        self._handles: list = []
        self.closed = False

    @property
    def attached(self) -> bool:
        """Whether a DDP model feeds this timeline."""
        return self.run is not None

    @property
    def writes_advice(self) -> bool:
        """Whether the advice panel belongs to this process: it writes the group's timeline
        file (rank 0 with a ``log_dir``), is still open and has steps to advise from."""
        return self._file is not None and not self.closed and bool(self.steps)

    # -- wiring ---------------------------------------------------------------------------

    def attach(self, ddp_model, *, algorithm: str, concurrent_buckets: int, group=None) -> None:
        """Describe the run and hook the model's forward (once per DDP model)."""
        self.group = group or ddp_model.process_group
        self.run = describe_run(
            ddp_model, algorithm=algorithm, concurrent_buckets=concurrent_buckets, group=self.group, **self.run_facts,
        )
        if self.log_dir is not None:
            self.directory = group_log_dir(self.log_dir, self.group)
        if self.run.device != "cpu":
            # On CUDA the host clocks time launches, not work: the advisor refuses such a
            # timeline (it says so), so record nothing on the hot path.
            return
        self._recording = True
        self._handles = [
            ddp_model.register_forward_pre_hook(self._before_forward),
            ddp_model.register_forward_hook(self._after_forward),
        ]
        _OPTIMIZER_CLOCK.add(self)
        if self.directory is not None and self.run.rank == 0:
            os.makedirs(self.directory, exist_ok=True)
            # Line-buffered: every finished step is on disk, for `advise LOG_DIR` during a run
            # and after a crash.
            self._file = open(os.path.join(self.directory, TIMELINE_FILE), "w", encoding="utf-8", buffering=1)  # noqa: SIM115
            self._write(self.run)

    def wants_marks(self, step: int) -> bool:
        return self._recording and not self.closed

    def on_bucket(self, bucket) -> None:
        """Bucket of the synchronizing micro-batch, handed over (hook thread): kept for its marks."""
        step = self._step
        if step is None or not self._micro_sync or not bucket.marked:
            return None
        step.buckets.append(bucket)
        if bucket.is_last:
            step.last_handed = bucket.timer.clock_ms(bucket.handed)
            step.sync_other_cpu_ms = step.other_cpu_ms()
            self._synced = True
        return None

    def _before_forward(self, module, args) -> None:
        if not torch.is_grad_enabled():  # validation, inference: not a training micro-batch
            return
        now = _now_ms()
        if self._step is not None and self._synced:
            self._finish(self._step, end=now)
            self._step = None
        if self._step is None:
            self._step, self._synced = _Step(now), False
        step = self._step
        if step.micro_starts and step.sync_start is None:  # the previous micro-batch had no sync
            step.nosync_other_cpu_ms.append(step.other_cpu_ms())
        step.micro_starts.append(now)
        self._micro_sync = bool(getattr(module, "require_backward_grad_sync", True))
        if self._micro_sync:
            step.sync_start = now
        step.cpu_mark()

    def _after_forward(self, module, args, output) -> None:
        step = self._step
        if step is None or not self._micro_sync or not torch.is_grad_enabled():
            return
        first = next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if first is None:
            step.backward_start = _now_ms()
            return

        def started(grad):  # the first gradient to reach the forward's output
            if step.backward_start is None:
                step.backward_start = _now_ms()

        first.register_hook(started)

    def optimizer_span(self, start: float, end: float) -> None:
        """An ``optimizer.step()`` ran from ``start`` to ``end`` (ms; the optimizer clock calls
        this). Lightning calls ``step(closure)`` and the closure runs the synchronizing
        micro-batch inside it, so only the part after that micro-batch's last bucket counts."""
        step = self._step
        if step is None or not self._synced:
            return
        begin = max([start, *step.finished_ends_ms()])
        step.optimizer_ms += max(0.0, end - begin)

    # -- finished steps --------------------------------------------------------------------

    def _finish(self, step: _Step, *, end: float) -> None:
        if not step.buckets or any(b.end is None for b in step.buckets):
            return  # a step whose buckets never all finished (an error): nothing to learn
        backward_start = step.backward_start if step.backward_start is not None else step.sync_start
        clocks = [BucketClocks.read(bucket) for bucket in step.buckets]  # host marks: ready
        last_end = max(clock.end for clock in clocks)
        record = TimelineStep(
            step=step.buckets[0].step,  # the hook state's step number
            micro_batches=len(step.micro_starts),
            step_ms=end - step.start,
            nosync_micro_ms=tuple(b - a for a, b in zip(step.micro_starts, step.micro_starts[1:])),
            nosync_other_cpu_ms=tuple(step.nosync_other_cpu_ms),
            forward_ms=backward_start - step.sync_start,
            backward_ms=step.last_handed - backward_start,
            exposed_ms=last_end - step.last_handed,
            optimizer_ms=step.optimizer_ms,
            tail_ms=end - last_end,
            sync_other_cpu_ms=step.sync_other_cpu_ms,
            buckets=tuple(
                TimelineBucket(
                    index=bucket.index,
                    nbytes=bucket.nbytes,
                    ready_ms=clock.handed - backward_start,
                    # an executor without phases (nothing to move): timed from the hand-over
                    start_ms=(clock.phases[0][1] if clock.phases else clock.handed) - backward_start,
                    end_ms=clock.end - backward_start,
                    cpu_ms=clock.cpu_ms,
                    call_ms=bucket.call_ms,
                    kind=bucket.kind, nnz=bucket.size.nnz, sparse_bytes=bucket.size.sparse_bytes,
                    dense_bytes=bucket.size.dense_bytes,
                )
                for bucket, clock in zip(step.buckets, clocks)
            ),
        )
        self.steps.append(record)
        self._finished += 1
        if self._finished <= FILE_STEPS or self._finished % THIN_EVERY == 0:
            self._write(record)

    def arrived(self, step: int, last_ms) -> None:
        """Every rank's last hand-over of ``step`` (ms on one clock, the arrivals gather's, on
        rank 0 after the step): kept and written relative to rank 0's, so the advisor knows how
        far the ranks' arrivals scatter (what a larger world waits for)."""
        if not self._recording or self.closed or self.run is None:
            return
        record = TimelineArrivals(step=step, last_ms=tuple(t - last_ms[0] for t in last_ms))
        self.arrivals.append(record)
        self._write(record)

    def _write(self, record: TimelineRecord) -> None:
        if self._file is not None:
            with self._lock:
                self._file.write(record.to_json() + "\n")

    def records(self) -> list[TimelineRecord]:
        """The run description, the finished steps, then the steps' arrivals (what
        ``timeline.jsonl`` holds, in that order here)."""
        if self.run is None:
            raise ValueError(
                "no timeline was recorded: attach the hook with ddp_ring_hooks.register(model, ...) "
                "(or the Lightning strategy), not model.register_comm_hook, and train a few steps"
            )
        return [self.run, *self.steps, *self.arrivals]

    def close(self) -> None:
        """Stop recording and close the file (the in-memory steps stay). Safe to call twice."""
        self.closed = True
        self._step = None  # a DDP model trained on after close hands no bucket to a stale step
        for handle in self._handles:
            handle.remove()
        self._handles = []
        _OPTIMIZER_CLOCK.discard(self)
        if self._file is not None:
            with self._lock:
                self._file.close()
                self._file = None


def read_timeline(path: str | os.PathLike) -> list[TimelineRecord]:
    """The records of a ``timeline.jsonl`` (a file, or the ``log_dir`` that holds one)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        groups = sorted(name for name in os.listdir(path)
                        if name.startswith("group_") and os.path.isfile(os.path.join(path, name, TIMELINE_FILE)))
        if not os.path.exists(os.path.join(path, TIMELINE_FILE)) and groups:
            raise FileNotFoundError(
                f"{path} holds one run per process group ({', '.join(groups)}): the hook ran on groups "
                f"smaller than the world; pass one of them, e.g. {os.path.join(path, groups[0])}"
            )
        path = os.path.join(path, TIMELINE_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"no {TIMELINE_FILE} at {path}; train with ddp_ring_hooks.register(model, log_dir=DIR) "
            "(or RingDDPStrategy(log_dir=DIR)) and pass that DIR"
        )
    with open(path, encoding="utf-8") as file:
        lines = [line for line in file if line.strip()]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            text = json.loads(line)
        except json.JSONDecodeError:
            if number < len(lines):
                raise ValueError(f"{path}, line {number}: not a timeline record") from None
            continue  # the last line of a run still writing (or killed mid-line): the steps before it stand
        try:
            records.append(record_from_json(text))
        except (ValueError, TypeError, KeyError) as error:
            raise ValueError(f"{path}, line {number}: {error}") from None
    return records


def describe_run(
    ddp_model, *, algorithm: str, concurrent_buckets: int, group=None, nodes=None, ring=None, options=None,
    probe=None, probe_algorithm=None,
) -> TimelineRun:
    """The first timeline record: what does not change from step to step (``nodes``, ``ring``,
    ``options``, ``probe``: what the hook state knows, see :class:`~.timeline_records.TimelineRun`;
    ``options`` keeps the values a JSON line can hold, so ``auto``'s ``calibration=`` is left out)."""
    config = getattr(ddp_model, "_bucket_config", None)  # torch >= 2.10
    cap = int(getattr(config, "bucket_bytes_cap", ddp_model.bucket_bytes_cap))
    first = int(getattr(config, "first_bucket_bytes_cap", dist._DEFAULT_FIRST_BUCKET_BYTES))
    params = [p for p in ddp_model.module.parameters() if p.requires_grad]
    sparse = sparse_parameters(ddp_model.module)
    group = group or ddp_model.process_group
    return TimelineRun(
        world_size=dist.get_world_size(group),
        rank=dist.get_rank(group),  # in the hook's group: its rank 0 writes
        algorithm=algorithm,
        concurrent_buckets=concurrent_buckets,
        bucket_cap_bytes=cap,
        first_bucket_bytes=first,
        param_bytes=tuple(p.numel() * p.element_size() for p in params),
        param_dtypes=tuple(str(p.dtype).removeprefix("torch.") for p in params),
        param_sparse=tuple(id(p) in sparse for p in params),
        device=params[0].device.type if params else "cpu",
        cpu_count=os.cpu_count() or 1,
        torch_threads=torch.get_num_threads(),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size(group))),
        nodes=None if nodes is None else tuple(nodes),
        ring=None if ring is None else tuple(ring),
        options=None if options is None else tuple(
            (name, tuple(value) if isinstance(value, list | tuple) else value)
            for name, value in sorted(options.items()) if _plain(value)
        ),
        probe=None if probe is None else tuple(probe),
        probe_algorithm=probe_algorithm,
    )


def _plain(value) -> bool:
    """Whether a JSON line holds ``value`` as it is (a number, a string, a list of numbers)."""
    if isinstance(value, list | tuple):
        return all(isinstance(item, int | float) for item in value)
    return value is None or isinstance(value, str | int | float | bool)


class _OptimizerClock:
    """PyTorch's global optimizer-step hooks, timing every ``optimizer.step()`` once for all
    timelines of this process (registered on first use, removed when none is left)."""

    def __init__(self) -> None:
        self._timelines: weakref.WeakSet[Timeline] = weakref.WeakSet()
        self._handles: tuple = ()
        self._started = 0.0

    def add(self, timeline: Timeline) -> None:
        self._timelines.add(timeline)
        if not self._handles:
            from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

            self._handles = (register_optimizer_step_pre_hook(self._pre), register_optimizer_step_post_hook(self._post))

    def discard(self, timeline: Timeline) -> None:
        self._timelines.discard(timeline)
        if not self._timelines and self._handles:
            for handle in self._handles:
                handle.remove()
            self._handles = ()

    def _pre(self, optimizer, args, kwargs) -> None:
        self._started = _now_ms()

    def _post(self, optimizer, args, kwargs) -> None:
        end = _now_ms()
        for timeline in list(self._timelines):
            timeline.optimizer_span(self._started, end)


_OPTIMIZER_CLOCK = _OptimizerClock()
