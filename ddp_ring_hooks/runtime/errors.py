"""Errors that say *where* communication failed: which step of which algorithm, and which peer.

A backend error alone ("Connection closed by peer [127.0.0.1]:40123") names neither the rank
nor the place in the algorithm. The executor and the hook each add what they know, from the
inside out::

    gloo:      Connection closed by peer [127.0.0.1]:40123
    executor:  StepFailedError   step 2/6 (reduce-scatter) of ring, rank 1 waiting to receive from rank 0
    hook:      HookFailedError   ring_hook (tree), bucket 3 of iteration 12 (40,960 float32 elements)

The runtime knows nothing about DDP: :class:`~ddp_ring_hooks.hooks.errors.HookFailedError`
(hook, bucket, iteration) lives with the hooks.

After a peer dies the process group cannot be used again (gloo and NCCL both leave it broken),
so the message ends with what to do: find the first rank that failed, restart from a
checkpoint (``torchrun --max-restarts=N`` does it automatically).
"""

from __future__ import annotations

#: What the user should do after a failed step; shared by every message so they read alike.
RECOVERY_ADVICE = (
    "A peer process has probably died or hung: look for the first rank that failed. The process "
    "group cannot be used after this; restart the job from its last checkpoint (torchrun "
    "--max-restarts=N restarts it for you)."
)


class CommunicationError(RuntimeError):
    """Communication of a ``ddp_ring_hooks`` all-reduce failed (base class)."""


class StepFailedError(CommunicationError):
    """A step of a schedule failed while this rank waited for one of its peers.

    Attributes:
        algorithm: the schedule's algorithm.
        rank: this rank, in the group.
        step_index, num_steps, phase: where in the schedule (``step_index`` counts from 0).
        direction: ``"receive from"`` or ``"send to"``: the transfer that failed.
        peer: that transfer's peer, as a rank of the group.
        global_peer: the same peer as a global rank (equal to ``peer`` on the default group).
        cause: the backend's own message.
    """

    def __init__(
        self,
        *,
        algorithm: str,
        rank: int,
        step_index: int,
        num_steps: int,
        phase: str,
        direction: str,
        peer: int,
        global_peer: int,
        cause: str,
    ) -> None:
        self.algorithm = algorithm
        self.rank = rank
        self.step_index = step_index
        self.num_steps = num_steps
        self.phase = phase
        self.direction = direction
        self.peer = peer
        self.global_peer = global_peer
        self.cause = cause
        super().__init__(f"{self.where()}: {cause}\n{RECOVERY_ADVICE}")

    def where(self) -> str:
        """The place of the failure in words, without the backend's message."""
        peer = f"rank {self.peer}"
        if self.global_peer != self.peer:
            peer += f" (global rank {self.global_peer})"
        return (
            f"step {self.step_index + 1}/{self.num_steps} ({self.phase}) of the {self.algorithm} "
            f"all-reduce failed on rank {self.rank} waiting to {self.direction} {peer}"
        )
