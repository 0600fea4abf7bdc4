"""The error a DDP hook raises when it cannot reduce a bucket (what :mod:`~ddp_ring_hooks.runtime.errors`
cannot know: which hook, which bucket of which iteration), and a hook state's record of them
(:class:`Failures`: the first one refuses every later bucket)."""

from __future__ import annotations

from collections.abc import Callable

from ..runtime.errors import RECOVERY_ADVICE, CommunicationError, StepFailedError


class HookFailedError(CommunicationError):
    """A DDP hook could not reduce a bucket: names the hook, the algorithm that ran, the bucket
    and, if known, the step and peer.

    Attributes:
        hook: the hook's name (``"ring_hook"``).
        algorithm: the algorithm that reduced this bucket (with ``auto``: the one it chose).
        bucket: the bucket's index in its iteration (DDP hands buckets over in index order).
        iteration: the hook state's ``iteration`` when the bucket arrived.
        step: the :class:`StepFailedError` underneath, or ``None`` when the failure came from
            elsewhere (e.g. posting the operations).
        stalled: the stall watchdog's finding (who everyone waits for) when a bucket of this
            rank was waiting too long as this one failed; ``None`` otherwise.
    """

    def __init__(
        self,
        *,
        hook: str,
        algorithm: str,
        bucket: int,
        iteration: int,
        numel: int,
        dtype: str,
        cause: BaseException,
        stalled: str | None = None,
    ) -> None:
        self.hook = hook
        self.algorithm = algorithm
        self.bucket = bucket
        self.iteration = iteration
        self.step = cause if isinstance(cause, StepFailedError) else None
        self.stalled = stalled
        where = f"{hook} ({algorithm}): bucket {bucket} of iteration {iteration} ({numel:,} {dtype} elements)"
        if self.step is not None:
            detail = f"{self.step.where()}: {self.step.cause}"
        else:
            detail = f"{type(cause).__name__}: {str(cause).strip()}"
        if stalled is not None and stalled not in detail:
            detail += f"\nThe stall watchdog had found: {stalled}"
        super().__init__(f"{where}: {detail}\n{RECOVERY_ADVICE}")


class Failures:
    """A hook state's failures, named: the first one is remembered (the group is unusable after
    it), and every later bucket is refused with it at once instead of waiting for the timeout
    again. ``stalled``: the stall watchdog's latest finding while a bucket waits too long (a
    peer that gave up on the stalled rank closes its connections, and a bucket's own error
    would name that peer, not the stalled rank)."""

    def __init__(self, stalled: Callable[[], str | None] = lambda: None) -> None:
        self.stalled = stalled
        self.first: CommunicationError | None = None

    def refuse_after_first(self, algorithm: str, bucket: int, iteration: int) -> None:
        """Raise at once when an earlier bucket failed."""
        if self.first is not None:
            raise CommunicationError(
                f"ring_hook ({algorithm}): bucket {bucket} of iteration {iteration} was not reduced because an "
                f"earlier one failed: {self.first}"
            )

    def named(self, algorithm: str, buffer, bucket: int, iteration: int, error: BaseException) -> HookFailedError:
        """``error`` as the hook's failure of this bucket (remembered if it is the first)."""
        failure = HookFailedError(
            hook="ring_hook", algorithm=algorithm, bucket=bucket, iteration=iteration, numel=buffer.numel(),
            dtype=str(buffer.dtype).removeprefix("torch."), cause=error, stalled=self.stalled(),
        )
        if self.first is None:
            self.first = failure
        return failure
