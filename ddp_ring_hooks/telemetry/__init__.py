"""Per-bucket communication timing: records, clocks, the recorder and its sinks.

A leaf of the package: it uses ``runtime``'s observer interface and never imports ``hooks``.
"""

from .records import BucketRecord, RankArrivals, StepRecord, all_reduce_bus_factor, bandwidths_GBps
from .bucket_marks import BucketObserver
from .options import TELEMETRY_OPTIONS, TelemetryOptions
from .recorder import Telemetry
from .sinks import MemorySink, NullSink, Sink, SummaryTable, TensorBoardSink, TraceSink

__all__ = [
    "TELEMETRY_OPTIONS", "BucketObserver", "BucketRecord", "MemorySink", "NullSink", "RankArrivals", "Sink", "StepRecord",
    "SummaryTable", "Telemetry", "TelemetryOptions", "TensorBoardSink", "TraceSink", "all_reduce_bus_factor", "bandwidths_GBps",
]
