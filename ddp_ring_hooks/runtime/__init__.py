"""Runs schedules on ``torch.distributed``; knows nothing about DDP."""

from .all_reduce import all_reduce
from .executor import run_schedule
from .group_context import GroupContext, Needs, context_of, needs_for
from .lanes import Lane
from .observer import NULL_OBSERVER, ExecutionObserver, FanOut, combine_observers
from .worker import CommWorker

__all__ = [
    "NULL_OBSERVER", "CommWorker", "ExecutionObserver", "FanOut", "GroupContext", "Lane", "Needs", "all_reduce",
    "combine_observers", "context_of", "needs_for", "run_schedule",
]
