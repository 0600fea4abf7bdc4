"""Watching the buckets: the observation and its watchers, records, clocks and sinks.

A leaf of the package: it uses ``runtime`` and never imports ``hooks``. The records, the
timeline's records, the options and the sinks are plain Python; the names that need torch
(the observation, the recorder) load on first use, so the advisor reads records without torch.
"""

import importlib

from .options import TELEMETRY_OPTIONS, TelemetryOptions
from .records import BucketRecord, RankArrivals, StepRecord, all_reduce_bus_factor, bandwidths_GBps
from .sinks import MemorySink, Sink, TensorBoardSink
from .summary import SummaryTable
from .trace import TraceSink

#: Names loaded on first use, and their modules (they import torch).
_NEEDS_TORCH = {"Observation": ".observation", "Telemetry": ".recorder", "Watcher": ".watcher"}


def __getattr__(name: str):
    if name in _NEEDS_TORCH:
        return getattr(importlib.import_module(_NEEDS_TORCH[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "TELEMETRY_OPTIONS", "BucketRecord", "MemorySink", "Observation", "RankArrivals", "Sink", "StepRecord",
    "SummaryTable", "Telemetry", "TelemetryOptions", "TensorBoardSink", "TraceSink", "Watcher",
    "all_reduce_bus_factor", "bandwidths_GBps",
]
