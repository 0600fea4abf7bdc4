"""Error feedback: what rounding to a narrower wire dtype lost, added back at the next step.

With ``wire_dtype="bf16"`` every partial sum a rank sends, and the final value of each chunk,
is rounded once (``runtime/program.py``). Each rounding loses a little; over many steps the
losses are biased the same way (a gradient component smaller than half a bf16 step next to a
large one is lost every time), so they can build up. Error feedback (as in PowerSGD and 1-bit
Adam) keeps them and sends them again::

    step k      bucket g_k ─(+ p·r_{k-1})─▶ all-reduce on the wire ─▶ average
                                                  │ every rounding this rank does
                                                  ▼
                                          r_k = value before - value after (per element)

1. Each rank keeps, per bucket, a residual the size of the bucket, in the bucket's dtype.
2. Before the bucket is communicated (on the bucket's worker, not the autograd thread), the
   residual is added into it, times the world size: the hook averages, and residuals are
   kept in averaged units (they are losses of partial sums of ``g / p``).
3. While the bucket is reduced, the executor writes into the residual what each of this
   rank's roundings lost (the ranks' residuals together are exactly what the all-reduce lost,
   up to fp32's own rounding), and zero where this rank rounded nothing. ``native``, PyTorch's
   compress hook, keeps what the cast of this rank's own contribution lost (gloo's roundings
   inside its all-reduce are not seen).

Which residual is a bucket's. DDP hands buckets over by index, but the first iteration's
buckets are provisional: from the second iteration on DDP rebuilds them in the order gradients
became ready, so bucket 0 may hold other parameters, in another order, even at the same size.
A bucket's residual therefore remembers its *layout*, the parameters it holds (their storage),
and when a bucket comes with another layout its residual is rebuilt from the old ones by
parameter (each parameter's slice moves to its new place), so nothing is lost to the rebuild.
Under gradient accumulation (``no_sync``) DDP does not call the hook: the residual waits for
the next synced step.

Checkpoints: :meth:`ErrorFeedback.state_dict` keeps each residual with its bucket's index,
size, dtype and parameter shapes. A resumed run's first iteration has DDP's provisional
buckets again, so a restored residual is applied to the first bucket with the same index and
layout (by size and shapes), at most one iteration late; one that matches no bucket after two
iterations is dropped with a warning.

Memory: one residual per bucket, the size of the model's gradients in all
(:attr:`ErrorFeedback.nbytes`, in the summary).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..runtime.wire import tensor_bytes
from ..schedules import is_narrow

#: Iterations a restored residual may wait for its bucket (DDP's provisional one, then the rebuilt).
PENDING_ITERATIONS = 2


@dataclass(frozen=True, slots=True)
class Layout:
    """Which parameters a bucket holds, in order: their storages (``None`` when the bucket came
    without its parameters) and shapes."""

    numel: int
    dtype: torch.dtype
    storages: tuple[int, ...] | None
    shapes: tuple[tuple[int, ...], ...] | None


def layout_of(buffer: torch.Tensor, parameters: Sequence[torch.Tensor] | None) -> Layout:
    """A bucket's layout (call it on the hook thread, where DDP hands the bucket over)."""
    if parameters is None:
        return Layout(buffer.numel(), buffer.dtype, None, None)
    return Layout(buffer.numel(), buffer.dtype, tuple(p.data_ptr() for p in parameters),
                  tuple(tuple(p.shape) for p in parameters))


class _Residual:
    """One bucket's residual and the layout it was kept for."""

    __slots__ = ("layout", "tensor")

    def __init__(self, layout: Layout, tensor: torch.Tensor) -> None:
        self.layout = layout
        self.tensor = tensor

    def slices(self) -> dict[int, torch.Tensor]:
        """Each parameter's part of the residual, by its storage."""
        if self.layout.storages is None:
            return {}
        found, offset = {}, 0
        for storage, shape in zip(self.layout.storages, self.layout.shapes):
            numel = _numel(shape)
            found[storage] = self.tensor[offset : offset + numel]
            offset += numel
        return found


class ErrorFeedback:
    """Every bucket's residual for one hook state (see the module docstring).

    ``prepare`` on the hook thread as DDP hands a bucket over (it finds or rebuilds the
    bucket's residual); ``add_into`` on the bucket's worker, before the bucket is communicated
    (the executor then overwrites the residual with this step's).
    """

    def __init__(self) -> None:
        self._residuals: dict[int, _Residual] = {}
        self._seen: set[int] = set()  # buckets handed over in the current iteration
        # Residuals replaced in this iteration (a rebuilt layout): later buckets of the same
        # iteration may hold their parameters.
        self._retired: list[_Residual] = []
        self._pending: list[dict] = []  # restored from a checkpoint, not yet matched
        self._pending_iterations = 0
        self._lock = threading.Lock()  # summary() reads the sizes from another thread

    # -- the hook thread -----------------------------------------------------------------------

    def prepare(self, index: int, buffer: torch.Tensor, parameters: Callable[[], Sequence[torch.Tensor]] | None,
                *, is_last: bool) -> torch.Tensor:
        """The residual of bucket ``index`` (``parameters``: how to list its parameters, e.g.
        ``GradBucket.parameters``), rebuilt by parameter when the bucket's layout changed."""
        layout = layout_of(buffer, parameters() if parameters is not None else None)
        with self._lock:
            kept = self._residuals.get(index)
            if kept is None or kept.layout != layout:
                if kept is not None:
                    self._retired.append(kept)
                kept = self._residuals[index] = _Residual(layout, self._rebuilt(layout, buffer))
            self._adopt_pending(index, kept)
            self._seen.add(index)
            if is_last:
                self._end_iteration()
        return kept.tensor

    def _rebuilt(self, layout: Layout, buffer: torch.Tensor) -> torch.Tensor:
        """A residual for a new layout: each parameter's slice from the residual that held it
        (DDP's rebuild moves parameters between buckets), zero for the rest."""
        fresh = torch.zeros_like(buffer)
        if layout.storages is None:
            return fresh
        # The old layout's residuals: replaced ones, and those of buckets not handed over yet in
        # this iteration (the ones handed over already are being written by their workers).
        old_layout = [*self._retired, *(kept for i, kept in self._residuals.items() if i not in self._seen)]
        old = {storage: part for kept in old_layout for storage, part in kept.slices().items()}
        offset = 0
        for storage, shape in zip(layout.storages, layout.shapes):
            numel = _numel(shape)
            part = old.get(storage)
            if part is not None and part.numel() == numel:
                fresh[offset : offset + numel].copy_(part)
            offset += numel
        return fresh

    def _adopt_pending(self, index: int, kept: _Residual) -> None:
        for saved in self._pending:
            if saved["index"] == index and _matches(saved, kept.layout):
                kept.tensor.add_(saved["residual"].to(kept.tensor.device, kept.tensor.dtype))
                self._pending.remove(saved)
                return

    def _end_iteration(self) -> None:
        """The iteration's last bucket: residuals of buckets DDP no longer hands over (the
        provisional layout, after the rebuild) are dropped; restored ones wait a little."""
        for index in [i for i in self._residuals if i not in self._seen]:
            del self._residuals[index]
        self._seen = set()
        self._retired = []
        if self._pending:
            self._pending_iterations += 1
            if self._pending_iterations >= PENDING_ITERATIONS:
                warnings.warn(
                    f"error feedback: {len(self._pending)} residual(s) restored from the checkpoint match none of "
                    "this run's buckets (another model or bucket_cap_mb?); they are dropped and this run's start "
                    "from zero", stacklevel=2,
                )
                self._pending = []

    # -- the bucket's worker ------------------------------------------------------------------

    @staticmethod
    def add_into(buffer: torch.Tensor, residual: torch.Tensor, world_size: int) -> None:
        """Add last step's residual into the bucket before it is communicated: the hook
        averages, and the residual is in averaged units, so it goes in times the world size."""
        buffer.add_(residual, alpha=world_size)

    # -- what it holds ---------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes the residuals take (one per bucket: the model's gradients' size in all)."""
        with self._lock:
            return sum(tensor_bytes(kept.tensor) for kept in self._residuals.values())

    def summary_line(self) -> str:
        """``"error feedback: residuals of 3 buckets, 1.2 MiB"`` (MiB = 2^20 bytes)."""
        with self._lock:
            count = len(self._residuals)
        return f"error feedback: residuals of {count} bucket{'s' if count != 1 else ''}, {self.nbytes / 2**20:.1f} MiB"

    def state_dict(self) -> dict:
        """Each residual with what finds its bucket again (index, size, dtype, parameter shapes),
        on the CPU (``torch.load(weights_only=True)`` reads it)."""
        with self._lock:
            saved = [
                {"index": index, "numel": kept.layout.numel, "dtype": str(kept.layout.dtype).removeprefix("torch."),
                 "shapes": None if kept.layout.shapes is None else [list(s) for s in kept.layout.shapes],
                 "residual": kept.tensor.detach().to("cpu", copy=True)}
                for index, kept in sorted(self._residuals.items())
            ]
        return {"buckets": saved + [dict(p) for p in self._pending]}

    # Pickled (a spawned process, a copy of the state), it starts empty: residuals are tensors
    # of this process; checkpoints keep them through state_dict.
    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def load_state_dict(self, saved: Mapping) -> None:
        """Take residuals saved by :meth:`state_dict`; each is added to its bucket's when that
        bucket is next handed over (see the module docstring)."""
        with self._lock:
            self._pending = [dict(bucket) for bucket in saved.get("buckets", [])]
            self._pending_iterations = 0


def _matches(saved: Mapping, layout: Layout) -> bool:
    if saved["numel"] != layout.numel or saved["dtype"] != str(layout.dtype).removeprefix("torch."):
        return False
    shapes = saved.get("shapes")
    return shapes is None or layout.shapes is None or [list(s) for s in layout.shapes] == [list(s) for s in shapes]


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def feedback_for(enabled: object, *, algorithm: str, options: Mapping[str, object]) -> ErrorFeedback | None:
    """``error_feedback=`` checked where the hook state is built (a bool, and only with a wire
    dtype narrower than fp32: with nothing rounded there is nothing to feed back); the
    :class:`ErrorFeedback` to keep, or ``None``."""
    if not isinstance(enabled, bool):
        raise TypeError(f"error_feedback must be True or False, got {enabled!r}")
    if enabled and not is_narrow(options):
        raise ValueError(
            f"error_feedback=True keeps what rounding to a narrower wire dtype loses, and the {algorithm} algorithm "
            "here sends buckets as they are (wire_dtype='fp32', the default), so nothing would be fed back: pass "
            "wire_dtype='bf16' (or 'fp16') with it, or drop error_feedback"
        )
    return ErrorFeedback() if enabled else None
