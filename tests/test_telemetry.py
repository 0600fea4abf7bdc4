"""Telemetry on real gloo ranks: TensorBoard tags on the right steps, bytes equal to DDP's
buckets, busbw consistent with time and bytes, a trace whose phases nest in their bucket,
per-rank run directories, the spread across ranks, the summary table and clean closing."""

from __future__ import annotations

import glob
import json
import os
import pickle
import re

import pytest

from ddp_ring_hooks import HookState
from ddp_ring_hooks.schedules import checked_schedule
from ddp_ring_hooks.telemetry import Telemetry, all_reduce_bus_factor
from ddp_ring_hooks.telemetry.records import busy_ms
from ddp_ring_hooks.telemetry.recorder import TRACE_FILE

from ._dist import run_ranks

WORLD_SIZE = 2
STEPS = 6
LOG_EVERY = 2
TRACE_WINDOW = (2, 4)
SPREAD_EVERY = 3
PHASES = tuple(dict.fromkeys(name for name, _, _ in checked_schedule("ring", WORLD_SIZE).phases))


def _train_with_telemetry(rank: int, world_size: int, shared_dir: str, per_rank_dir: str):
    """Train a small MLP (several buckets) twice: rank-0 logging with everything on, then per rank."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import ddp_ring_hooks
    from ddp_ring_hooks.telemetry import MemorySink

    def make_model():
        torch.manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)
        )
        return DistributedDataParallel(net, bucket_cap_mb=0.01)  # ~10 kB: several buckets

    def train(model, steps):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(steps):
            model(torch.randn(16, 32)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()

    # 1. Rank 0 writes; record the buckets DDP really hands to the hook, step by step.
    memory = MemorySink()
    state = HookState(
        log_dir=shared_dir, log_every=LOG_EVERY, trace_steps=TRACE_WINDOW, spread_every=SPREAD_EVERY, sinks=[memory]
    )
    seen: dict[tuple[int, int], int] = {}

    def recording_hook(hook_state, bucket):
        step = hook_state.iteration + 1
        seen[(step, bucket.index())] = bucket.buffer().numel() * bucket.buffer().element_size()
        return ddp_ring_hooks.ring_hook(hook_state, bucket)

    model = make_model()
    model.register_comm_hook(state, recording_hook)
    train(model, STEPS)
    summary = state.summary()
    state.close()
    state.close()  # safe twice

    # 2. Every rank writes to its own run directory, through the one-call API.
    model = make_model()
    per_rank_state = ddp_ring_hooks.register(model, log_dir=per_rank_dir, per_rank=True)
    train(model, 2)
    per_rank_state.close()
    return seen, memory.records, summary, memory.ranks


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    shared = str(tmp_path_factory.mktemp("shared"))
    per_rank = str(tmp_path_factory.mktemp("per_rank"))
    results = run_ranks(_train_with_telemetry, WORLD_SIZE, shared, per_rank, timeout=180)
    return shared, per_rank, results


def _scalars(log_dir: str) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(log_dir, size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    accumulator.Reload()
    scalars = {tag: {e.step: e.value for e in accumulator.Scalars(tag)} for tag in accumulator.Tags()["scalars"]}
    scalars["__histograms__"] = {
        tag: {e.step: e.histogram_value.num for e in accumulator.Histograms(tag)}
        for tag in accumulator.Tags()["histograms"]
    }
    scalars["__tensors__"] = accumulator.Tags()["tensors"]
    return scalars


def test_tensorboard_tags_steps_bytes_and_busbw(trained):
    shared, _, results = trained
    seen = results[0][0]  # rank 0 writes
    scalars = _scalars(shared)
    logged = [step for step in range(1, STEPS + 1) if step % LOG_EVERY == 0]
    buckets_per_step = {step: sorted(i for s, i in seen if s == step) for step in logged}
    assert all(len(indices) >= 2 for indices in buckets_per_step.values()), "the model should have several buckets"
    factor = all_reduce_bus_factor(WORLD_SIZE)
    for step, indices in buckets_per_step.items():
        for index in indices:
            prefix = f"comm/bucket_{index}"
            nbytes = scalars[f"{prefix}/bytes"][step]
            time_ms = scalars[f"{prefix}/time_ms"][step]
            assert nbytes == seen[(step, index)]
            assert time_ms > 0
            expected_busbw = nbytes / (time_ms * 1e-3) / 1e9 * factor
            assert scalars[f"{prefix}/busbw_GBps"][step] == pytest.approx(expected_busbw, rel=1e-4)
            assert scalars[f"{prefix}/queue_ms"][step] >= 0
            phases = {phase: scalars[f"{prefix}/{phase}_ms"][step] for phase in PHASES}
            assert sum(phases.values()) == pytest.approx(time_ms, rel=1e-3)
        bucket_times = [scalars[f"comm/bucket_{i}/time_ms"][step] for i in indices]
        # Time with at least one bucket in flight: the sum of the buckets' times where they do
        # not overlap (two run at once on CPU), never less than the longest bucket.
        total = scalars["comm/step/total_ms"][step]
        assert max(bucket_times) * (1 - 1e-4) <= total <= sum(bucket_times) * (1 + 1e-4)
        assert scalars["comm/step/num_buckets"][step] == len(indices)
        # The last bucket's own time is part of what backward could not hide.
        assert scalars["comm/step/exposed_ms"][step] >= bucket_times[-1] * (1 - 1e-4)
        assert scalars["__histograms__"]["comm/step/bucket_time_ms"][step] == len(indices)
        # Communication counts from the hand-overs, as exposed does: it holds exposed and what
        # was in flight, and its excess over in flight is the buckets' queue.
        comm = scalars["comm/step/comm_ms"][step]
        assert comm >= scalars["comm/step/exposed_ms"][step] * (1 - 1e-6)
        assert comm >= total * (1 - 1e-6)
    # Bucket and step tags only on logged steps; the spread only on spread steps.
    for tag in ("comm/bucket_0/time_ms", "comm/bucket_0/bytes", "comm/bucket_0/busbw_GBps",
                "comm/step/total_ms", "comm/step/comm_ms", "comm/step/exposed_ms"):
        assert sorted(scalars[tag]) == logged, tag
    spread_steps = [step for step in range(1, STEPS + 1) if step % SPREAD_EVERY == 0]
    assert sorted(scalars["comm/ranks/total_ms_spread"]) == spread_steps
    assert scalars["comm/telemetry/dropped"] and not any(scalars["comm/telemetry/dropped"].values())
    assert "custom_scalars__config__" in scalars["__tensors__"]


@pytest.mark.fast
@pytest.mark.parametrize("intervals, busy", [
    ([], 0.0),
    ([(0.0, 2.0), (3.0, 4.0)], 3.0),  # one after another: the sum
    ([(0.0, 2.0), (1.0, 4.0)], 4.0),  # overlapping: counted once
    ([(1.0, 4.0), (0.0, 5.0), (2.0, 3.0)], 5.0),  # nested, in any order
])
def test_busy_ms_is_the_length_of_the_union(intervals, busy):
    assert busy_ms(intervals) == pytest.approx(busy)


def test_spread_gathers_every_ranks_own_step_total(trained):
    _, _, results = trained
    records = [{r.step: r for r in rank_result[1]} for rank_result in results]
    spread_and_logged = [s for s in range(1, STEPS + 1) if s % SPREAD_EVERY == 0 and s % LOG_EVERY == 0]
    assert spread_and_logged
    ranks = {r.step: r for r in results[0][3]}
    assert [r.step for r in results[1][3]] == sorted(ranks) == [s for s in range(1, STEPS + 1) if s % SPREAD_EVERY == 0]
    for step in spread_and_logged:
        gathered = ranks[step].total_ms
        assert gathered == tuple(records[rank][step].total_ms for rank in range(WORLD_SIZE))
    scalars = _scalars(trained[0])
    for step in spread_and_logged:
        totals = ranks[step].total_ms
        assert scalars["comm/ranks/total_ms_min"][step] == pytest.approx(min(totals), rel=1e-5)
        assert scalars["comm/ranks/total_ms_max"][step] == pytest.approx(max(totals), rel=1e-5)
        assert scalars["comm/ranks/straggler_rank"][step] == ranks[step].straggler


def test_trace_loads_and_phases_nest_in_their_bucket(trained):
    shared, _, _ = trained
    with open(os.path.join(shared, TRACE_FILE)) as file:
        events = json.load(file)["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert slices and all(isinstance(e["ts"], float | int) and e["dur"] >= 0 for e in slices)
    phases = set(PHASES)
    buckets = [e for e in slices if e["name"].startswith("bucket ")]
    assert {e["args"]["step"] for e in buckets} == set(range(*TRACE_WINDOW))
    assert {e["pid"] for e in slices} == set(range(WORLD_SIZE))  # rank 0 gathered every rank's tracks
    for bucket in buckets:
        inside = [
            e for e in slices
            if e["name"] in phases and (e["pid"], e["tid"]) == (bucket["pid"], bucket["tid"])
            and e["args"]["step"] == bucket["args"]["step"]
        ]
        assert {e["name"] for e in inside} == phases
        slack = 1e-3  # µs of float rounding
        for phase in inside:
            assert bucket["ts"] - slack <= phase["ts"]
            assert phase["ts"] + phase["dur"] <= bucket["ts"] + bucket["dur"] + slack


def test_only_rank0_writes_unless_per_rank(trained):
    shared, per_rank, _ = trained
    assert not glob.glob(os.path.join(shared, "rank_*"))
    assert len(glob.glob(os.path.join(shared, "events.out.tfevents.*"))) == 1
    for rank in range(WORLD_SIZE):
        scalars = _scalars(os.path.join(per_rank, f"rank_{rank}"))
        assert sorted(scalars["comm/step/total_ms"]) == [1, 2]


def test_summary_lists_every_bucket_size(trained):
    _, _, results = trained
    for seen, _, summary, _ in results:
        logged = [(i, nbytes) for (step, i), nbytes in seen.items() if step % LOG_EVERY == 0]
        rows = {}
        for line in summary.splitlines()[2:-2]:  # header, column names, rows..., step footer, stragglers
            index, nbytes, _, count, p50, p90, worst = line.split()[:7]
            rows[(int(index), int(nbytes.replace(",", "")))] = (int(count), float(p50), float(p90), float(worst))
        assert set(rows) == set(logged)
        for key, (count, p50, p90, worst) in rows.items():
            assert count == logged.count(key)
            assert 0 < p50 <= p90 <= worst
        assert_step_line_never_contradicts(summary)


def assert_step_line_never_contradicts(summary: str) -> None:
    """The summary's step line names communication, exposed and in flight, and exposed is never
    more than communication (both from the hand-overs; the glossary of docs/telemetry.md)."""
    (line,) = [line for line in summary.splitlines() if line.startswith("  step: ")]
    numbers = {name: [float(v) for v in re.findall(rf"{name} p50 ([\d.]+) ms, p90 ([\d.]+) ms", line)[0]]
               for name in ("communication", "exposed", "in flight")}
    assert "queue included" in line and "no queue" in line, line
    for quantile in (0, 1):
        assert numbers["exposed"][quantile] <= numbers["communication"][quantile], line
        assert numbers["in flight"][quantile] <= numbers["communication"][quantile], line


@pytest.mark.fast
def test_a_queued_last_bucket_is_exposed_and_communication_but_not_in_flight():
    """The case that read "exposed 37.2 > total 36.8 ms" (issue 31): the last bucket waits 4 ms
    behind the one before it, so 4 ms of exposed time were never in flight. The summary's
    communication counts from the hand-over, so it holds exposed, and names the queue."""
    from ddp_ring_hooks.telemetry.records import BucketRecord, StepRecord
    from ddp_ring_hooks.telemetry.summary import SummaryTable

    def bucket(index, handed, start, end):
        return BucketRecord(step=2, index=index, nbytes=4096, numel=1024, dtype="float32", algorithm="ring",
                            world_size=2, queue_ms=start - handed, time_ms=end - start, phases_ms={},
                            algbw_GBps=0.0, busbw_GBps=0.0, start_ms=start)

    # bucket 0 handed at 0 ms, runs 0-10; bucket 1 (the last) handed at 6 ms, queued until 10, runs 10-14.
    buckets = (bucket(0, 0.0, 0.0, 10.0), bucket(1, 6.0, 10.0, 14.0))
    record = StepRecord(step=2, buckets=buckets, total_ms=14.0, exposed_ms=14.0 - 6.0, num_buckets=2)
    assert record.comm_ms == 14.0 and record.exposed_ms == 8.0
    table = SummaryTable()
    table.write(record)
    assert_step_line_never_contradicts(table.render())
    # The last bucket handed at 3 ms but started at 6 (the hook's start-up): 5 ms exposed, 4 ms in flight.
    late = (bucket(0, 0.0, 0.0, 2.0), bucket(1, 3.0, 6.0, 8.0))
    record = StepRecord(step=3, buckets=late, total_ms=4.0, exposed_ms=5.0, num_buckets=2)
    assert record.exposed_ms > record.total_ms and record.comm_ms == 7.0
    table = SummaryTable()
    table.write(record)
    assert_step_line_never_contradicts(table.render())


@pytest.mark.fast
def test_state_pickles_with_telemetry_options_and_no_threads(tmp_path):
    state = HookState(log_dir=str(tmp_path), log_every=5, trace_steps=3)
    clone = pickle.loads(pickle.dumps(state))
    assert clone.telemetry.enabled and clone.telemetry.options == state.telemetry.options
    assert "no communication telemetry" in HookState().summary()
    assert not HookState().telemetry.enabled


@pytest.mark.fast
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"log_every": 0}, "log_every"),
        ({"spread_every": -1}, "spread_every"),
        ({"trace_steps": 3}, "log_dir"),
        ({"log_dir": "x", "trace_steps": (5, 5)}, "start < stop"),
        ({"per_rank": True}, "log_dir"),
        ({"sinks": [object()]}, "write"),
    ],
)
def test_bad_options_name_the_problem(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        Telemetry(**options)


@pytest.mark.fast
def test_tensorboard_records_are_checksummed_in_c_with_the_same_bytes(tmp_path):
    """``use_fast_checksum`` swaps tensorboard's pure-Python CRC-32C for the ``crc32c`` C
    extension: the same masked checksum on any bytes, and files that tensorboard's reader
    (which verifies every record's checksum) reads back."""
    import random

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as python_checksum
    from tensorboard.summary.writer import record_writer

    from ddp_ring_hooks.telemetry.fast_checksum import use_fast_checksum
    from ddp_ring_hooks.telemetry.sinks import TensorBoardSink

    pytest.importorskip("crc32c")
    sink = TensorBoardSink(tmp_path)  # a sink switches the checksum on
    assert getattr(record_writer.masked_crc32c, "is_c_extension", False)
    assert use_fast_checksum()  # idempotent
    generator = random.Random(0)
    for size in (0, 1, 7, 8, 9, 1000, 3500):
        data = bytes(generator.randrange(256) for _ in range(size))
        assert record_writer.masked_crc32c(data) == python_checksum(data), size
    for step in range(3):
        sink.writer.add_scalar("check/value", step * 1.5, step)
    sink.close()
    accumulator = EventAccumulator(str(tmp_path))
    accumulator.Reload()
    assert [event.value for event in accumulator.Scalars("check/value")] == [0.0, 1.5, 3.0]
