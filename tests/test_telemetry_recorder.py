"""The recorder under load: thousands of observed buckets against a sink far slower than
training keep memory flat, never block the caller, and count every dropped step; and on a GPU
the hook times with events and never synchronizes the host.

The buckets are handed to an observation as the hook state hands them (``hand_over``, then
the executor's calls on the watch it returns), without a model around them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ._dist import run_ranks

STEPS = 6000
BUCKETS_PER_STEP = 4
CAPACITY = 16


def _drive_recorder_with_slow_sink(rank: int, world_size: int):
    """Play the hook's side of the observer protocol STEPS times; return what was counted."""
    import gc
    import time
    import tracemalloc

    from ddp_ring_hooks.telemetry import Observation, Sink

    class SlowSink(Sink):
        def __init__(self):
            self.written = 0

        def write(self, record):
            time.sleep(0.002)  # a disk far slower than training
            self.written += 1

    sink = SlowSink()
    observation = Observation(sinks=[sink], capacity=CAPACITY, summary_window=64)
    telemetry = observation.recorder
    buffer = torch.zeros(1024)
    phases = ("reduce-scatter", "all-gather")
    memory_after: dict[int, int] = {}
    tracemalloc.start()
    for step in range(1, STEPS + 1):
        for index in range(BUCKETS_PER_STEP):
            is_last = index == BUCKETS_PER_STEP - 1
            observer = observation.hand_over(buffer, step=step, index=index, is_last=is_last, algorithm="ring", group=None)
            for phase in phases:
                observer.on_phase(phase)
            observer.on_finish()
        if step in (STEPS // 6, STEPS):
            # Live memory: a full collection first empties CPython's free lists (up to 2000
            # tuples of each size, kept allocated for reuse), which would read as growth.
            gc.collect()
            memory_after[step] = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    queued_at_end = telemetry._queue.qsize()
    telemetry.close()
    return {
        "written": sink.written, "dropped": telemetry.dropped, "memory": memory_after,
        "queued_at_end": queued_at_end,
    }


def test_thousands_of_buckets_keep_memory_flat_and_count_drops():
    (result,) = run_ranks(_drive_recorder_with_slow_sink, 1, timeout=120)
    # A blocking queue would never drop: drops prove the caller did not wait for the sink.
    assert result["dropped"] > 0, "a sink this slow must make the recorder drop steps"
    assert result["written"] + result["dropped"] == STEPS, "every step is either written or counted as dropped"
    assert result["queued_at_end"] <= CAPACITY
    early, late = result["memory"][STEPS // 6], result["memory"][STEPS]
    assert late - early < 64 * 1024, f"memory grew from {early} to {late} bytes over {STEPS} steps"


def _finish_buckets_out_of_order(rank: int, world_size: int):
    """Two buckets reduced at once can finish in either order: the step is recorded once,
    when its last bucket to *finish* is done, with every bucket in it."""
    from ddp_ring_hooks.telemetry import MemorySink, Observation

    memory = MemorySink()
    observation = Observation(sinks=[memory])
    telemetry = observation.recorder
    seen_before_all_finished = []
    for step in (1, 2):
        observers = [
            observation.hand_over(torch.zeros(64 * (index + 1)), step=step, index=index, is_last=index == 2,
                                  algorithm="ring", group=None)
            for index in range(3)
        ]
        for observer in observers:
            observer.on_phase("reduce-scatter")
        for index in (2, 0):  # the last bucket first, then the first; bucket 1 still running
            observers[index].on_finish()
        telemetry.flush()
        seen_before_all_finished.append(len(memory.records))
        observers[1].on_finish()
        telemetry.flush()
    telemetry.close()
    return {
        "seen_before_all_finished": seen_before_all_finished,
        "steps": [record.step for record in memory.records],
        "bucket_bytes": [[bucket.nbytes for bucket in record.buckets] for record in memory.records],
    }


def test_a_step_is_recorded_when_its_last_bucket_to_finish_is_done():
    (result,) = run_ranks(_finish_buckets_out_of_order, 1, timeout=120)
    assert result["seen_before_all_finished"] == [0, 1]
    assert result["steps"] == [1, 2]
    assert result["bucket_bytes"] == [[256, 512, 768]] * 2


EXIT_WITHOUT_CLOSE = """
import sys
import torch, torch.distributed as dist
from ddp_ring_hooks.telemetry import Observation

dist.init_process_group("gloo", store=dist.FileStore(sys.argv[2], 1), rank=0, world_size=1)
observation = Observation(log_dir=sys.argv[1], trace_steps=(1, 3))
for step in (1, 2, 3):
    observer = observation.hand_over(torch.zeros(8), step=step, index=0, is_last=True, algorithm="ring", group=None)
    observer.on_phase("reduce-scatter")
    observer.on_finish()
# No close(): interpreter exit must write everything.
"""


def test_exit_without_close_still_writes_events_and_trace(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ddp_ring_hooks.telemetry.recorder import TRACE_FILE

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    log_dir, store = str(tmp_path / "run"), str(tmp_path / "store")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-c", EXIT_WITHOUT_CLOSE, log_dir, store], env=env, check=True, timeout=120)
    accumulator = EventAccumulator(log_dir)
    accumulator.Reload()
    assert [event.step for event in accumulator.Scalars("comm/step/total_ms")] == [1, 2, 3]
    with open(os.path.join(log_dir, TRACE_FILE)) as file:
        steps = {e["args"]["step"] for e in json.load(file)["traceEvents"] if e["name"].startswith("bucket ")}
    assert steps == {1, 2}


def _reduce_on_cuda_without_sync(rank: int, world_size: int):
    from ddp_ring_hooks import HookState
    from ddp_ring_hooks.telemetry import MemorySink

    memory = MemorySink()
    state = HookState(sinks=[memory])
    buffer = torch.ones(1 << 20, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            state.reduce_bucket(buffer, is_last=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    state.close()
    return [(r.step, r.buckets[0].nbytes, r.exposed_ms) for r in memory.records]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_timing_uses_events_and_never_syncs_the_host():
    # NCCL: a CUDA bucket on gloo is refused (gloo's point-to-point path cannot carry it).
    (records,) = run_ranks(_reduce_on_cuda_without_sync, 1, timeout=120, backend="nccl")
    assert [step for step, _, _ in records] == [1, 2, 3]
    assert all(nbytes == 4 << 20 and exposed >= 0 for _, nbytes, exposed in records)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_clock_keeps_its_precision_by_moving_its_anchor():
    """``elapsed_time`` is a 32-bit float: the timer reads marks from an anchor at most
    ~``REANCHOR_MS`` back, so durations late in a run are as exact as early ones."""
    import time

    from ddp_ring_hooks.telemetry.timer import REANCHOR_MS, CudaTimer

    timer = CudaTimer(torch.device("cuda", 0))
    marks, host = [], []
    for _ in range(3):
        time.sleep(REANCHOR_MS / 1e3 * 1.2)
        torch.cuda.synchronize()
        host.append(time.perf_counter() * 1e3)
        marks.append(timer.mark())
    torch.cuda.synchronize()
    clocks = [timer.clock_ms(mark) for mark in marks]
    assert timer._anchor is marks[-1]  # moved up past the first marks
    gaps = [b - a for a, b in zip(clocks, clocks[1:])]
    host_gaps = [b - a for a, b in zip(host, host[1:])]
    assert all(abs(gap - host_gap) < 5.0 for gap, host_gap in zip(gaps, host_gaps)), (gaps, host_gaps)
    # Read again (anchor now at the last mark): the same clock, to float32 precision at 2.4 s.
    assert abs(timer.clock_ms(marks[0]) - clocks[0]) < 1e-3
