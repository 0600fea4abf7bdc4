"""Our communication in the PyTorch profiler: ``record_function`` ranges per bucket and phase.

While a ``torch.profiler.profile`` is running, every bucket's reduction is a range
``ddp_ring_hooks/bucket_3`` and each phase of its schedule a range inside it
(``ddp_ring_hooks/bucket_3/reduce-scatter``), so the profiler's trace, its TensorBoard view
and Holistic Trace Analysis show our communication next to the model's own ops. The ranges
open on the thread that does the work: on CPU the communication workers. PyTorch's profiler
records only the thread that started it, unless asked for all threads::

    from torch._C._profiler import _ExperimentalConfig
    with torch.profiler.profile(experimental_config=_ExperimentalConfig(profile_all_threads=True)):
        ...

Without a profiler nothing is opened: the hook reads one module attribute per bucket
(``torch.autograd.profiler._is_profiler_enabled``, a plain bool set by every profiler).
"""

from __future__ import annotations

from torch.autograd import profiler as autograd_profiler

from ..runtime.names import NATIVE
from ..runtime.observer import ExecutionObserver
from .watcher import Watcher

PREFIX = "ddp_ring_hooks"


def profiler_active() -> bool:
    """Whether any PyTorch profiler is recording now (process-wide, cheap)."""
    return autograd_profiler._is_profiler_enabled


class ProfilerRanges(Watcher):
    """A watcher: while a profiler runs, every bucket of a schedule gets its ranges (``native``
    does not: its start and end are on different threads, and ranges close where they open)."""

    def on_bucket(self, bucket) -> PhaseRanges | None:
        if not profiler_active() or bucket.algorithm == NATIVE:
            return None
        return PhaseRanges(bucket.index)


class PhaseRanges(ExecutionObserver):
    """One bucket's ranges, on the thread that runs it: entered around the bucket's job
    (``ddp_ring_hooks/bucket_{i}``); ``ddp_ring_hooks/bucket_{i}/{phase}`` opens at each phase
    and closes at the next one, at the end, or when the job fails."""

    def __init__(self, bucket: int) -> None:
        self.bucket = bucket
        self._range: autograd_profiler.record_function | None = None
        self._phase: autograd_profiler.record_function | None = None

    def __enter__(self) -> PhaseRanges:
        self._range = autograd_profiler.record_function(f"{PREFIX}/bucket_{self.bucket}")
        self._range.__enter__()
        return self

    def __exit__(self, *failure) -> None:
        self.on_finish()
        self._range.__exit__(None, None, None)

    def on_phase(self, phase: str) -> None:
        self.on_finish()
        self._phase = autograd_profiler.record_function(f"{PREFIX}/bucket_{self.bucket}/{phase}")
        self._phase.__enter__()

    def on_finish(self) -> None:
        if self._phase is not None:
            self._phase.__exit__(None, None, None)
            self._phase = None
