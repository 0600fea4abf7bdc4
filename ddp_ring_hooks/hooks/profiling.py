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

from collections.abc import Callable

import torch
from torch.autograd import profiler as autograd_profiler

from ..runtime import ExecutionObserver

PREFIX = "ddp_ring_hooks"


def profiler_active() -> bool:
    """Whether any PyTorch profiler is recording now (process-wide, cheap)."""
    return autograd_profiler._is_profiler_enabled


class PhaseRanges(ExecutionObserver):
    """Opens ``ddp_ring_hooks/bucket_{i}/{phase}`` at each phase and closes it at the next one."""

    def __init__(self, bucket: int) -> None:
        self.bucket = bucket
        self._open: autograd_profiler.record_function | None = None

    def on_phase(self, phase: str) -> None:
        self._close()
        self._open = autograd_profiler.record_function(f"{PREFIX}/bucket_{self.bucket}/{phase}")
        self._open.__enter__()

    def on_finish(self) -> None:
        self._close()

    def _close(self) -> None:
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None


def in_bucket_range(job: Callable[[], torch.Tensor], phases: PhaseRanges) -> Callable[[], torch.Tensor]:
    """``job`` run inside the range ``ddp_ring_hooks/bucket_{i}`` (on whichever thread runs it);
    a phase left open by a failure is closed with it."""

    def ranged() -> torch.Tensor:
        with autograd_profiler.record_function(f"{PREFIX}/bucket_{phases.bucket}"):
            try:
                return job()
            finally:
                phases.on_finish()

    return ranged
