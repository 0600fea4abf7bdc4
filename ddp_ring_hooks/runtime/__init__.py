"""Runs schedules on ``torch.distributed``; knows nothing about DDP."""

from .all_reduce import all_reduce
from .executor import run_schedule
from .observer import NULL_OBSERVER, ExecutionObserver, FanOut, combine_observers
from .worker import CommWorker, worker_for, workers_of

__all__ = ["NULL_OBSERVER", "CommWorker", "ExecutionObserver", "FanOut", "all_reduce", "combine_observers", "run_schedule", "worker_for", "workers_of"]
