"""Where records go: the sink interface, memory, and TensorBoard with its layout.

A sink gets finished :class:`~.records.StepRecord` s through ``write``, and every watcher's
records (:class:`~.records.Record`: scalars, texts, trace events) through ``write_record``, on
the recorder's writer thread, never on the training path, so a slow disk slows nobody.
``flush`` and ``close`` are called on that thread too (or after it stopped); sinks need no
locks. The other sinks live with their formats: the Chrome/Perfetto trace in :mod:`.trace`,
the summary table in :mod:`.summary`.

TensorBoard tags (stable: dashboards are built on them)::

    comm/bucket_{i}/time_ms  bytes  wire_bytes  busbw_GBps  algbw_GBps  queue_ms  {phase}_ms
    comm/bucket_{i}/nnz                                  (a sparse bucket: its stored entries)
    comm/step/comm_ms  exposed_ms  total_ms  num_buckets  bucket_time_ms (histogram)
    comm/telemetry/dropped
    comm/ranks/straggler_rank  straggler_wait_ms  arrival_spread_ms  clock_error_ms
    comm/ranks/total_ms_min  total_ms_max  total_ms_spread                 (with spread_every)
    comm/links/slowest_src  slowest_dst  slowest_MBps  median_MBps  slow_nic_rank
                                                         (with spread_every and links=True)
    comm/advice                                          (text, when the hook state closes)
    comm/stall                                           (text, while a rank stalls)
    any watcher's own tags                               (its Scalars and Text records)

``wire_bytes`` is what the bucket's transfers carried (half its ``bytes`` with
``wire_dtype="bf16"``); ``busbw_GBps`` is computed on it (the links' load), ``algbw_GBps`` on
``bytes`` (the bucket's own rate). A sparse bucket's ``bytes`` are its indices and values, its
``wire_bytes`` what its gather sends (``(p - 1)`` times as many), ``nnz`` its stored entries
(``runtime/wire.py``). ``straggler_rank`` is the rank that arrived last (handed its last bucket over last) and
``straggler_wait_ms`` the median over the other ranks of how long they waited for it (see
:class:`~.records.RankArrivals`). There is no "slowest rank by communication time": the rank
that communicates longest is the one that waited longest, a victim, not the culprit.
``comm/links/*`` are the naming rule's over the links' recent steps (:mod:`.link_timing`): the
link of the lowest bandwidth (its ends and MB/s, 1e6 bytes/s), the median of all links, and
the rank whose network the rule names slow (``-1`` when none).
``comm/step/comm_ms`` (communication) and ``exposed_ms`` both count from the buckets' hand-over,
so exposed never exceeds communication; ``total_ms`` (in flight) counts transfers only, so the
last bucket's queue can make exposed exceed it (its meaning is unchanged since it was first
written; ``comm_ms`` was added beside it, issue 31). The words: ``docs/telemetry.md``'s glossary.
"""

from __future__ import annotations

import collections
import os

from .fast_checksum import use_fast_checksum
from .records import LinkTimes, RankArrivals, Record, StepRecord

#: The advisor's text panel, written next to the ``comm/*`` charts.
ADVICE_TAG = "comm/advice"


class Sink:
    """Receives step records. Override ``write``; ``write_record``, ``flush`` and ``close``
    default to nothing."""

    def write(self, record: StepRecord) -> None:
        raise NotImplementedError

    def write_record(self, record: Record) -> None:
        """A watcher's record (:class:`~.records.Record`: the forms it has, scalars, texts, trace
        events): every arrival gathered with ``spread_every``, every link's times with
        ``links=True``, the advice and stall panels, any watcher's own. Ignored by default."""

    def flush(self) -> None:
        """Make everything written so far durable or visible."""

    def close(self) -> None:
        """Flush and release resources; called once, at the end."""
        self.flush()



class MemorySink(Sink):
    """Keeps the latest ``maxlen`` step records in memory, for programs that want the numbers.

    Example::

        >>> memory = MemorySink()
        >>> state = ddp_ring_hooks.register(model, sinks=[memory])
        >>> ...train...; state.telemetry.flush()
        >>> [r.exposed_ms for r in memory.records]
    """

    def __init__(self, maxlen: int = 10_000) -> None:
        self._records: collections.deque[StepRecord] = collections.deque(maxlen=maxlen)
        self._watched: collections.deque[Record] = collections.deque(maxlen=maxlen)

    @property
    def records(self) -> list[StepRecord]:
        return list(self._records)

    @property
    def watched(self) -> list[Record]:
        """Every watcher's records, in the order they came."""
        return list(self._watched)

    @property
    def ranks(self) -> list[RankArrivals]:
        """The gathered arrivals of every rank, one per gathered step."""
        return [record for record in self._watched if isinstance(record, RankArrivals)]

    @property
    def links(self) -> list[LinkTimes]:
        """Every link's times, one record per gathered step (``links=True``)."""
        return [record for record in self._watched if isinstance(record, LinkTimes)]

    def write(self, record: StepRecord) -> None:
        self._records.append(record)

    def write_record(self, record: Record) -> None:
        self._watched.append(record)


class TensorBoardSink(Sink):
    """Writes the fixed ``comm/...`` tags with ``torch.utils.tensorboard.SummaryWriter``.

    Args:
        log_dir: the run directory for a writer of its own (closed with the sink).
        writer: an existing ``SummaryWriter`` to write into instead (e.g. Lightning's
            ``trainer.logger.experiment``); it is flushed but never closed here.
        step_offset: added to the optimizer step to get TensorBoard's ``global_step``.
        custom_scalars: write a custom-scalars layout (grouped charts) once, on the first
            record. A writer takes only one layout; pass False if yours already has one.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike | None = None,
        *,
        writer=None,
        step_offset: int = 0,
        custom_scalars: bool = True,
    ) -> None:
        if (log_dir is None) == (writer is None):
            raise ValueError("TensorBoardSink needs exactly one of log_dir=PATH or writer=SummaryWriter")
        use_fast_checksum()  # tensorboard's own record checksum is pure Python (fast_checksum.py)
        if writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:  # tensorboard is an optional extra
                raise ImportError(
                    "TensorBoardSink needs tensorboard; pip install 'ddp_ring_hooks[tensorboard]'"
                ) from error
            writer = SummaryWriter(log_dir=os.fspath(log_dir))
            self._owns_writer = True
        else:
            self._owns_writer = False
        self.writer = writer
        self.step_offset = step_offset
        self._layout_pending = custom_scalars

    def write(self, record: StepRecord) -> None:
        if self._layout_pending:
            self.writer.add_custom_scalars(custom_scalars_layout())
            self._layout_pending = False
        from tensorboard.compat.proto.summary_pb2 import Summary

        # All scalars of a step go into one event: what ``add_scalar`` writes per value
        # (a ``simple_value``), at a fifth of the cost of one event per value.
        values: list[Summary.Value] = []

        def add(tag: str, value: float) -> None:
            values.append(Summary.Value(tag=tag, simple_value=float(value)))

        step = record.step + self.step_offset
        for bucket in record.buckets:
            prefix = f"comm/bucket_{bucket.index}"
            add(f"{prefix}/time_ms", bucket.time_ms)
            add(f"{prefix}/bytes", bucket.nbytes)
            add(f"{prefix}/wire_bytes", bucket.bytes_on_wire)
            add(f"{prefix}/busbw_GBps", bucket.busbw_GBps)
            add(f"{prefix}/algbw_GBps", bucket.algbw_GBps)
            add(f"{prefix}/queue_ms", bucket.queue_ms)
            if bucket.nnz is not None:
                add(f"{prefix}/nnz", bucket.nnz)
            for phase, ms in bucket.phases_ms.items():
                add(f"{prefix}/{phase}_ms", ms)
        if record.buckets:
            add("comm/step/comm_ms", record.comm_ms)  # communication, from the hand-over (>= exposed)
            add("comm/step/total_ms", record.total_ms)  # in flight: transfers only, no queue
            add("comm/step/exposed_ms", record.exposed_ms)
            add("comm/step/num_buckets", record.num_buckets)
            times = [bucket.time_ms for bucket in record.buckets]
            values.append(Summary.Value(tag="comm/step/bucket_time_ms", histo=_histogram(times)))
        add("comm/telemetry/dropped", record.dropped)
        self._write_values(values, step)

    def write_record(self, record: Record) -> None:
        """Its scalars, one event at its step; its texts, a panel each."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        step = record.step + self.step_offset
        values = [Summary.Value(tag=tag, simple_value=float(value)) for tag, value in record.scalars().items()]
        if values:
            self._write_values(values, step)
        for tag, text in record.texts().items():
            self.writer.add_text(tag, text, global_step=step)

    def _write_values(self, values: list, step: int) -> None:
        if self._layout_pending:
            self.writer.add_custom_scalars(custom_scalars_layout())
            self._layout_pending = False
        from tensorboard.compat.proto.summary_pb2 import Summary

        # SummaryWriter's own add_scalar goes through this same (underscored) accessor, which
        # torch's and tensorboardX's writers both have.
        self.writer._get_file_writer().add_summary(Summary(value=values), step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        if self._owns_writer:
            self.writer.close()
        else:
            self.writer.flush()


def custom_scalars_layout() -> dict:
    """TensorBoard's custom-scalars layout: one chart per metric, all buckets on it.

    Multiline charts take regular expressions, so buckets that appear after DDP rebuilt its
    buckets (after step 1) join the charts without a second layout.
    """
    per_bucket = {
        f"bucket {name}": ["Multiline", [rf"comm/bucket_\d+/{tag}"]]
        for name, tag in (
            ("time (ms)", "time_ms"),
            ("busbw (GB/s)", "busbw_GBps"),
            ("bytes", "bytes"),
            ("bytes on the wire", "wire_bytes"),
            ("queue (ms)", "queue_ms"),
        )
    }
    per_step = {
        "step: communication / exposed / in flight (ms)": [
            "Multiline", ["comm/step/comm_ms", "comm/step/exposed_ms", "comm/step/total_ms"]
        ],
        "ranks: total min / max (ms)": ["Multiline", [r"comm/ranks/total_ms_(min|max)"]],
        "ranks: straggler wait / arrival spread (ms)": [
            "Multiline", ["comm/ranks/straggler_wait_ms", "comm/ranks/arrival_spread_ms"]
        ],
        "links: slowest / median (MB/s)": ["Multiline", ["comm/links/slowest_MBps", "comm/links/median_MBps"]],
    }
    return {"comm buckets": per_bucket, "comm steps": per_step}


def _histogram(values: list[float], bins: int = 10):
    """A TensorBoard histogram of ``values`` in ``bins`` equal bins (a few values: pure Python
    is far cheaper than ``add_histogram``'s thousands of default bins)."""
    from tensorboard.compat.proto.summary_pb2 import HistogramProto

    low, high = min(values), max(values)
    width = (high - low) / bins or 1.0
    counts = [0] * bins
    for value in values:
        counts[min(bins - 1, int((value - low) / width))] += 1
    return HistogramProto(
        min=low, max=high, num=len(values), sum=sum(values), sum_squares=sum(v * v for v in values),
        bucket_limit=[low + width * (i + 1) for i in range(bins)], bucket=counts,
    )

def advice_panel(text: str) -> str:
    """``text`` as a TensorBoard text panel: TensorBoard renders Markdown, and indenting every
    line makes it a code block, which keeps the table's columns."""
    return "\n".join("    " + line for line in text.splitlines())
