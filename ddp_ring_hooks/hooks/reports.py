"""What a hook state tells about its run: its watchers by name, the summary, the advice, the
group's nodes and ring order. Read-only views over the observation and the plan, kept beside
``HookState`` (a mixin) so that the state itself only checks, chooses, launches and names failures."""

from __future__ import annotations

import warnings

import torch.distributed as dist

from ..advisor import advise
from ..runtime import ExecutionObserver
from ..runtime.names import AUTO
from ..runtime.ring_orders import known_nodes
from ..schedules import ring_order_of
from ..telemetry import Telemetry
from .advice import placement_warning, ring_order_line


class Reports:
    """The views of :class:`~ddp_ring_hooks.HookState` (see the module docstring)."""

    __slots__ = ()

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

    def summary(self) -> str:
        """The per-bucket communication summary table (count, p50/p90/max ms, bytes, busbw),
        a line naming the rank that kept the others waiting (with ``spread_every``), one naming
        a slow link or network (with ``links=True``), and one on what the ring's order costs when
        it crosses the nodes more than it must; with error feedback, what its residuals hold."""
        feedback = self.plan.feedback
        lines = [ring_order_line(self), feedback.summary_line() if feedback is not None else ""]
        return self.observation.summary() + "".join(f"\n{line}" for line in lines if line)

    def advise(self, **options) -> dict:
        """What to change (bucket size, accumulation, algorithm, world size), predicted from this
        run's timeline; see :func:`ddp_ring_hooks.advisor.advise` (``network=`` costs another cluster)."""
        return advise(self.timeline.records(), **options)

    @property
    def hook(self):
        """The user's own DDP hook this state runs (``hook=``: a :class:`~.foreign.ForeignHook`), or ``None``."""
        return self.plan.foreign

    @property
    def nodes(self) -> tuple[int, ...] | None:
        """The node of each rank of the group, as its ranks said when the state was built
        (``GROUP_RANK``); ``None`` when they did not say."""
        return known_nodes(self.process_group) if dist.is_available() and dist.is_initialized() else None

    @property
    def ring(self) -> tuple[int, ...] | None:
        """The order the ring visits the ranks (``None``: the algorithm has no ring order)."""
        return None if self.algorithm == AUTO else ring_order_of(self.algorithm_options, self.world_size)

    def warn_misplaced(self, *, stacklevel: int) -> None:
        """Warn when ``hierarchical``'s nodes are not the ranks' nodes (as the ranks said)."""
        misplaced = placement_warning(self) if self.algorithm != AUTO else None
        if misplaced:
            warnings.warn(misplaced, stacklevel=stacklevel + 1)
