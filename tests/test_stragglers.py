"""Stragglers on real gloo ranks: a delay injected on one rank is named, with its cost; no delay
names nobody; clock offsets across (pretend) hosts are recovered by ping-pong; rank 0 writes
one merged trace with every rank on one time axis; ``trace merge`` joins per-rank files;
``diagnose=True`` names the straggler within the cadence's warm-up, gathers on the steps its
recorded gaps say, and blames no link."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from ddp_ring_hooks.telemetry import RankArrivals
from ddp_ring_hooks.telemetry.recorder import TRACE_FILE
from ddp_ring_hooks.telemetry.stragglers import StragglerTally

from ._dist import run_ranks

STEPS = 12
SKIP = 2  # the first steps: DDP's provisional buckets, the layout check's collectives
DELAY_S = 0.06
TRACE_WINDOW = (4, 6)


def _train(rank: int, world_size: int, delayed_rank: int | None, log_dir: str, per_rank: bool,
           separate_clocks: bool = False, diagnose: bool = False, steps: int = STEPS):
    """A small MLP in several buckets; ``delayed_rank`` sleeps before every forward;
    ``separate_clocks``: every rank claims a clock of its own, so offsets are measured;
    ``diagnose``: the one switch instead of ``spread_every=1`` and the trace window."""
    import time

    from ddp_ring_hooks.telemetry.clocks import CLOCK_DOMAIN_VARIABLE

    if separate_clocks:
        os.environ[CLOCK_DOMAIN_VARIABLE] = f"pretend host {rank}"

    import torch
    from torch.nn.parallel import DistributedDataParallel

    import ddp_ring_hooks
    from ddp_ring_hooks.telemetry import MemorySink

    torch.manual_seed(0)
    width = 512 if diagnose else 32  # diagnose: links with enough bytes to be judged (MIN_JUDGED_BYTES)
    net = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                              torch.nn.Linear(width, 4))
    model = DistributedDataParallel(net, bucket_cap_mb=0.002)  # ~2 kB: several buckets
    memory = MemorySink()
    asked = {"diagnose": True} if diagnose else {"spread_every": 1, "trace_steps": TRACE_WINDOW}
    state = ddp_ring_hooks.register(model, sinks=[memory], log_dir=log_dir, per_rank=per_rank, **asked)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * 32 / width)  # the wide net diverges (NaN) at the narrow one's rate
    for _ in range(steps):
        if rank == delayed_rank:
            time.sleep(DELAY_S)
        model(torch.randn(8, 16)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    summary = state.summary()
    state.close()
    grads = [p.detach().clone() for p in model.parameters()]
    return memory.ranks, summary, grads


def _measured(records: list[RankArrivals]) -> list[RankArrivals]:
    return [r for r in records if r.step > SKIP]


@pytest.mark.parametrize("world_size, delayed_rank", [(3, 2), (4, 1)])
def test_delayed_rank_is_named_with_its_cost(tmp_path, world_size, delayed_rank):
    results = run_ranks(_train, world_size, delayed_rank, str(tmp_path), False, timeout=240)
    records = _measured(results[0][0])
    assert len(records) == STEPS - SKIP
    # Every rank recorded the same gathered numbers.
    for other, _, _ in results[1:]:
        assert [(r.step, r.last_ms) for r in _measured(other)] == [(r.step, r.last_ms) for r in records]
    named = sum(r.straggler == delayed_rank for r in records)
    assert named >= 0.9 * len(records), [r.straggler for r in records]
    wait_ms = statistics.median(r.straggler_wait_ms for r in records)
    assert wait_ms == pytest.approx(DELAY_S * 1e3, rel=0.3)
    assert all(r.clock_error_ms == 0.0 and not any(r.offsets_ms) for r in records)  # one host: one clock
    # What slowest_rank used to log, the longest communication, names a victim, not the culprit:
    # the others' communication includes their wait for it.
    longest = [max(range(world_size), key=r.total_ms.__getitem__) for r in records]
    assert sum(rank == delayed_rank for rank in longest) <= 0.5 * len(records), longest
    summary = results[0][1]
    assert f"rank {delayed_rank} arrived last in" in summary, summary
    # TensorBoard names the culprit, not a victim; slowest_rank is gone.
    scalars = _scalars(str(tmp_path))
    assert "comm/ranks/slowest_rank" not in scalars
    logged = {step: rank for step, rank in scalars["comm/ranks/straggler_rank"].items() if step > SKIP}
    assert sum(rank == delayed_rank for rank in logged.values()) >= 0.9 * len(logged)
    assert statistics.median(scalars["comm/ranks/straggler_wait_ms"].values()) == pytest.approx(DELAY_S * 1e3, rel=0.3)
    assert set(scalars["comm/ranks/arrival_spread_ms"]) == set(range(1, STEPS + 1))
    # Training itself is unchanged: every rank ends with the same gradients.
    for _, _, grads in results[1:]:
        assert all((a == b).all() for a, b in zip(grads, results[0][2]))
    if world_size == 3:
        _check_merged_trace(os.path.join(str(tmp_path), TRACE_FILE), world_size, delayed_rank)
    _check_timeline_arrivals(str(tmp_path), results[0][0], delayed_rank)


def _check_timeline_arrivals(log_dir: str, gathered: list[RankArrivals], delayed_rank: int) -> None:
    """The advisor's timeline holds every gathered step's arrivals, relative to rank 0's, and
    prices the latest rank from them: the delayed rank is the late one."""
    from ddp_ring_hooks.advisor import advise
    from ddp_ring_hooks.telemetry.timeline import read_timeline
    from ddp_ring_hooks.telemetry.timeline_records import TimelineArrivals

    records = read_timeline(log_dir)
    arrived = [r for r in records if isinstance(r, TimelineArrivals)]
    assert [a.step for a in arrived] == [r.step for r in gathered]
    for a, r in zip(arrived, gathered):
        assert a.last_ms == pytest.approx([t - r.last_ms[0] for t in r.last_ms])
    late = [a.last_ms[delayed_rank] - statistics.median(a.last_ms) for a in arrived if a.step > SKIP]
    assert statistics.median(late) == pytest.approx(DELAY_S * 1e3, rel=0.3)
    waits = {w["world_size"]: w["wait_ms"] for w in advise(records)["model"]["latest_rank"]["waits"]}
    assert 0 < waits[8] < waits[64], waits  # a larger world waits for a later latest rank


DIAGNOSED_STEPS = 40


# Solo: its link rates on loopback are read against the cores. Beside the other worker's tests one
# suite run (-n 2) named the straggler's own network once (3 gathered steps agreeing, when a link
# needed 3); alone it passes.
@pytest.mark.solo
def test_diagnose_names_the_straggler_within_the_warm_up_and_blames_no_link(tmp_path):
    from ddp_ring_hooks.telemetry.cadence import WARMUP

    results = run_ranks(_train, 3, 2, str(tmp_path), False, False, True, DIAGNOSED_STEPS, timeout=240)
    records = results[0][0]
    assert [r.step for r in records[:WARMUP]] == list(range(1, WARMUP + 1))  # the warm-up gathers every step
    # Named within the warm-up, and in 90% of every gathered step after DDP's first (3 ranks on
    # 2 cores: a step where the scheduler delays another rank by more than 60 ms can name it).
    assert [r.straggler for r in records[SKIP:WARMUP]].count(2) >= 0.5 * (WARMUP - SKIP), records[SKIP:WARMUP]
    assert sum(r.straggler == 2 for r in records[SKIP:]) >= 0.9 * len(records[SKIP:]), records
    for other, _, _ in results[1:]:  # every rank gathered the same steps
        assert [r.step for r in other] == [r.step for r in records]
    summary = results[0][1]
    assert "rank 2 arrived last in" in summary, summary
    assert "cadence: auto" in summary and "steps gathered, now every" in summary, summary
    assert "\nlinks: no slow link: median" in summary, summary  # links measured (every ring link), none blamed
    scalars = _scalars(str(tmp_path))
    gaps = scalars["comm/diagnosis/gather_every"]
    assert set(gaps) == {r.step for r in records}  # a decision at every gathered step
    # diagnose=True records the buckets at its cadence too: the gathered steps, no others
    assert set(scalars["comm/bucket_0/time_ms"]) == {r.step for r in records}
    # The steps gathered after the warm-up follow the gaps decided LAG gathers before.
    from ddp_ring_hooks.telemetry.cadence import LAG

    steps = [r.step for r in records]
    for k in range(WARMUP, len(steps) - 1):
        assert steps[k + 1] - steps[k] == gaps[steps[k - LAG]], (steps, gaps)
    # No link blamed for the straggler's lateness: its network never named, and no network in
    # 90% of the gathered steps (on loopback, a step where the 2 cores are busy elsewhere can
    # slow one rank's transfers; the lab tests of test_link_timing.py assert "never"). After the
    # first SKIP steps, as for the straggler: DDP's provisional buckets and the layout check's
    # collectives there blamed a link in 2 of 3 runs under load, and with the cadence's budget
    # (0.35% of a step) there are few gathered steps after the warm-up to outvote them.
    blamed = [rank for step, rank in scalars["comm/links/slow_nic_rank"].items() if step > SKIP]
    assert 2 not in blamed and blamed.count(-1) >= 0.9 * len(blamed), blamed
    assert "comm/ranks/straggler_rank" in scalars
    for _, _, grads in results[1:]:
        assert all((a == b).all() for a, b in zip(grads, results[0][2]))


def _scalars(log_dir: str) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: {e.step: e.value for e in accumulator.Scalars(tag)} for tag in accumulator.Tags()["scalars"]}


def _check_merged_trace(path: str, world_size: int, delayed_rank: int) -> None:
    with open(path) as file:
        trace = json.load(file)
    events = trace["traceEvents"]
    assert trace["ddp_ring_hooks"]["merged_ranks"] == list(range(world_size))
    sort_index = {e["pid"]: e["args"]["sort_index"] for e in events if e["name"] == "process_sort_index"}
    assert sort_index == {rank: rank for rank in range(world_size)}  # every rank's tracks, in rank order
    slices = [e for e in events if e["ph"] == "X"]
    # Aligned: a bucket's all-reduce cannot end on one rank before it started on another
    # (up to the stated alignment error, 0 on one clock).
    slack_us = trace["ddp_ring_hooks"]["clock_error_ms"] * 1e3 * 2
    by_bucket: dict[str, list[dict]] = {}
    for event in slices:
        if event["name"].startswith("bucket "):
            by_bucket.setdefault(event["name"], []).append(event)
    assert by_bucket
    for name, copies in by_bucket.items():
        assert {e["pid"] for e in copies} == set(range(world_size)), name
        assert max(e["ts"] for e in copies) <= min(e["ts"] + e["dur"] for e in copies) + slack_us, name
    # The others' wait ends where the straggler finished handing over.
    for step in range(*TRACE_WINDOW):
        handed = {e["pid"]: e for e in slices if e["name"] == f"handing over step {step}"}
        assert set(handed) == set(range(world_size))
        arrived = handed[delayed_rank]["ts"] + handed[delayed_rank]["dur"]
        waits = [e for e in slices if e["name"].startswith("wait for rank ") and e["args"]["step"] == step]
        for wait in waits:
            assert wait["ts"] + wait["dur"] == pytest.approx(arrived, abs=1.0)  # µs


def test_no_delay_names_no_straggler_and_trace_merge_joins_ranks(tmp_path):
    world_size = 3
    results = run_ranks(_train, world_size, None, str(tmp_path), True, timeout=240)
    tally = StragglerTally()
    for record in _measured(results[0][0]):
        tally.add(record)
    rank, share, wait_ms = tally.leader()
    assert not (share >= 0.9 and wait_ms >= 0.3 * DELAY_S * 1e3), (rank, share, wait_ms)
    assert "no consistent straggler" in results[0][1] or wait_ms < 0.3 * DELAY_S * 1e3, results[0][1]
    # per_rank: each rank wrote its own trace; the command puts them on one axis.
    completed = subprocess.run(
        [sys.executable, "-m", "ddp_ring_hooks", "trace", "merge", str(tmp_path)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert completed.returncode == 0, completed.stderr
    with open(os.path.join(str(tmp_path), TRACE_FILE)) as file:
        merged = json.load(file)
    assert merged["ddp_ring_hooks"]["merged_ranks"] == [0, 1, 2]
    assert {e["pid"] for e in merged["traceEvents"] if e["ph"] == "X"} == {0, 1, 2}
    bad = subprocess.run([sys.executable, "-m", "ddp_ring_hooks", "trace", "merge", str(tmp_path / "nothing")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "per_rank=True" in bad.stderr


def _summary_right_after_a_late_exchange(rank: int, world_size: int, steps: int, late_s: float) -> str:
    """``steps`` gathered steps, rank 1's exchange worker kept busy ``late_s`` before the last one
    (a real job on its lane: what a slow peer's exchange looks like), the summary read at once."""
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import ddp_ring_hooks
    from ddp_ring_hooks.runtime.group_context import context_of
    from ddp_ring_hooks.runtime.lanes import EXCHANGE

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)))
    state = ddp_ring_hooks.register(model, spread_every=1, sinks=[ddp_ring_hooks.telemetry.MemorySink()])
    for step in range(steps):
        if rank == 1 and step == steps - 1:
            context_of(dist.group.WORLD).worker(EXCHANGE).submit(lambda: time.sleep(late_s))
        model(torch.randn(8, 16)).sum().backward()
    summary = state.summary()
    state.close()
    return summary


def test_a_summary_read_right_after_the_last_step_holds_its_exchange():
    """The exchange runs beside training, so the last step's can still be under way when the
    summary is read (CI, a Fabric run of 4 steps: "no step's arrivals gathered yet"); the
    summary waits for it. Red without ``StepExchange.settle``: "over 3 steps" of the 5."""
    steps = 5
    summaries = run_ranks(_summary_right_after_a_late_exchange, 2, steps, 1.5, timeout=120)
    for summary in summaries:
        assert f"over {steps} steps" in summary or f"of {steps} steps" in summary, summary
        assert "still running" not in summary, summary


def _offsets_of_skewed_clocks(rank: int, world_size: int, skew_s: float):
    import time

    import torch.distributed as dist

    from ddp_ring_hooks.telemetry.clocks import estimate_clock_offsets

    group = dist.group.WORLD
    shared = estimate_clock_offsets(group, tag=7)  # real hosts: all ranks here share one clock
    # Pretend every rank is a host of its own whose clock runs skew_s * rank ahead.
    skewed = estimate_clock_offsets(group, tag=7, hosts=list(range(world_size)),
                                    clock=lambda: time.perf_counter() + skew_s * rank)
    return shared, skewed


def test_ping_pong_recovers_clock_offsets_across_hosts():
    skew_s = 5.0
    results = run_ranks(_offsets_of_skewed_clocks, 3, skew_s, timeout=120)
    shared, skewed = results[0]
    assert shared.offsets_ms == (0.0, 0.0, 0.0) and shared.max_error_ms == 0.0
    assert skewed.hosts == (0, 1, 2)
    for rank in range(3):
        expected = skew_s * 1e3 * rank
        assert abs(skewed.offsets_ms[rank] - expected) <= skewed.error_ms[rank] + 1e-6
        assert skewed.error_ms[rank] < 50.0  # half a loopback round trip, even on a busy machine
    assert all(result == results[0] for result in results)  # every rank knows every offset


@pytest.mark.fast
def test_arrivals_name_the_last_rank_and_the_others_wait():
    record = RankArrivals(step=3, first_ms=(0.0, 1.0, 30.0, 2.0), last_ms=(10.0, 12.0, 40.0, 11.0),
                          total_ms=(45.0, 44.0, 9.0, 44.5), offsets_ms=(0.0,) * 4)
    assert record.straggler == 2
    assert record.waits_ms == (30.0, 28.0, 0.0, 29.0)
    assert record.straggler_wait_ms == 29.0  # median of the others, not counting the straggler's 0
    assert record.arrival_spread_ms == 30.0


@pytest.mark.fast
def test_summary_line_names_a_consistent_straggler_only():
    def arrivals(step, last_rank, wait):
        last = [100.0] * 3
        last[last_rank] += wait
        return RankArrivals(step=step, first_ms=(0.0,) * 3, last_ms=tuple(last), total_ms=(1.0,) * 3,
                            offsets_ms=(0.0,) * 3)

    culprit = StragglerTally()
    for step in range(1, 26):
        culprit.add(arrivals(step, 2 if step != 7 else 0, 29.0))
    assert culprit.is_consistent()
    assert culprit.render().startswith("stragglers: rank 2 arrived last in 96% of 25 steps, costing the others 29 ms")
    balanced = StragglerTally()
    for step in range(1, 26):
        balanced.add(arrivals(step, step % 3, 29.0))  # everyone is last now and then
    assert not balanced.is_consistent() and "no consistent straggler" in balanced.render()
    short = StragglerTally()
    for step in range(1, 3):
        short.add(arrivals(step, 1, 29.0))
    assert not short.is_consistent()  # two steps prove nothing
    noise = StragglerTally()
    for step in range(1, 26):
        noise.add(arrivals(step, 1, 0.2))  # always last, but by a fraction of a millisecond
    assert not noise.is_consistent()
    assert "no step" in StragglerTally().render()


@pytest.mark.fast
def test_trace_merge_shifts_each_rank_onto_rank0s_clock_and_refuses_strangers(tmp_path):
    from ddp_ring_hooks.telemetry.trace_merge import merge_trace_files

    def write(name, rank, offset_ms, ts):
        path = tmp_path / name
        path.write_text(json.dumps({
            "traceEvents": [{"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
                            {"ph": "X", "name": "bucket 0 step 2", "pid": rank, "tid": 0, "ts": ts, "dur": 5.0}],
            "ddp_ring_hooks": {"rank": rank, "clock_offset_ms": offset_ms, "clock_error_ms": 0.02},
        }))
        return str(path)

    # Rank 1's clock runs 2 s ahead: its event at 2_000_100 µs happened at 100 µs on rank 0's clock.
    merged = merge_trace_files([write("a.json", 0, 0.0, 100.0), write("b.json", 1, 2000.0, 2_000_100.0)])
    slices = {e["pid"]: e["ts"] for e in merged["traceEvents"] if e["ph"] == "X"}
    assert slices == {0: 100.0, 1: pytest.approx(100.0)}
    assert merged["ddp_ring_hooks"]["merged_ranks"] == [0, 1] and merged["ddp_ring_hooks"]["clock_error_ms"] == 0.02
    assert merged["ddp_ring_hooks"]["clock_known"]
    unaligned = json.loads(open(write("d.json", 1, 0.0, 1.0)).read())
    unaligned["ddp_ring_hooks"]["clock_known"] = False  # no arrivals were gathered: offset assumed 0
    (tmp_path / "d.json").write_text(json.dumps(unaligned))
    assert not merge_trace_files([write("a.json", 0, 0.0, 1.0), str(tmp_path / "d.json")])["ddp_ring_hooks"]["clock_known"]
    with pytest.raises(ValueError, match="both hold rank 0"):
        merge_trace_files([write("a.json", 0, 0.0, 1.0), write("c.json", 0, 0.0, 1.0)])
    stranger = tmp_path / "profiler.json"
    stranger.write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(ValueError, match="not a trace written by ddp_ring_hooks"):
        merge_trace_files([str(stranger)])


def test_straggler_is_named_across_measured_clocks(tmp_path):
    """Every rank claims a clock of its own: the offsets come from ping-pong (the true ones are
    0, one machine), within the error they state, and the delayed rank is still named."""
    world_size, delayed_rank = 3, 1
    results = run_ranks(_train, world_size, delayed_rank, str(tmp_path), False, True, timeout=240)
    records = _measured(results[0][0])
    assert records
    for record in records:
        assert record.clock_error_ms > 0.0
        assert all(abs(offset) <= record.clock_error_ms + 1e-6 for offset in record.offsets_ms)
    assert sum(r.straggler == delayed_rank for r in records) >= 0.9 * len(records)
    assert statistics.median(r.straggler_wait_ms for r in records) == pytest.approx(DELAY_S * 1e3, rel=0.3)
    assert "clocks aligned to within" in results[0][1]
    _check_merged_trace(os.path.join(str(tmp_path), TRACE_FILE), world_size, delayed_rank)
