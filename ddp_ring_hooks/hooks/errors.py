"""The error a DDP hook raises when it cannot reduce a bucket (what :mod:`~ddp_ring_hooks.runtime.errors`
cannot know: which hook, which bucket of which iteration)."""

from __future__ import annotations

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
