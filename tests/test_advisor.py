"""The advisor: the step model's closed cases on synthetic timelines (pure, no ranks), DDP's
bucketing rules against a real DDP model's buckets on 2 gloo ranks, and the whole path: 2 ranks
train with a log_dir, then ``advise --json`` reads it and the ``comm/advice`` panel is there."""

from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import dataclasses

import pytest

from ddp_ring_hooks.advisor import (
    Setting,
    advise,
    from_bench,
    format_advice,
    from_latency_bandwidth,
    profile_run,
    run_setting,
    step_model,
)
from ddp_ring_hooks.advisor.advice import could_go_either_way, recommend
from ddp_ring_hooks.advisor.bucketing import MIB, assign_buckets, bucket_limits, rebuilt_bucket_bytes
from ddp_ring_hooks.advisor.link_directions import counted_directions, link_directions
from ddp_ring_hooks.advisor.network import DENSIFY, GATHER, SparseBucket, bucket_cost
from ddp_ring_hooks.advisor.profile import service_ms
from ddp_ring_hooks.advisor.replay import BucketCost, replay
from ddp_ring_hooks.schedules import BOTH, IN, OUT, algorithm_examples, build_schedule, get_algorithm, resolve_options, with_wire
from ddp_ring_hooks.advisor.ready_curve import ReadyCurve
from ddp_ring_hooks.telemetry.timeline_records import TimelineBucket, TimelineRun, TimelineStep

from ._dist import run_ranks
from .conftest import imports_torch

ALPHA_MS, BETA_MS = 0.1, 1e-6  # 100 us per message, 1 GB/s


def ring_ms(nbytes: float, alpha: float = ALPHA_MS, beta: float = BETA_MS) -> float:
    """Ring all-reduce on 2 ranks: 2 messages, n bytes sent per rank."""
    return 2 * alpha + nbytes * beta


def timeline(*, ready, lanes=1, k=1, forward=10.0, backward=20.0, optimizer=1.0, rest=2.0, micro=None,
             other_cpu=0.0, cpu_count=64, steps=4, hook=0.0, beta=BETA_MS):
    """Timeline records of a run whose buckets take exactly the α-β ring time (``beta``: ms per byte).

    Parameters (registration order) are [3 MiB, 1 MiB]: with DDP's default limits the rebuilt
    buckets are [1 MiB, 3 MiB] (the last parameter first, the 1 MiB first bucket closes).
    ``hook``: each bucket's ``call_ms`` (the ready times given include it, as measured ones do).
    """
    sizes = [1 * MIB, 3 * MIB]
    free, buckets = [float("-inf")] * lanes, []
    for i, (n, r) in enumerate(zip(sizes, ready)):
        start = max(r, free[i % lanes])
        end = free[i % lanes] = start + ring_ms(n, beta=beta)
        buckets.append(TimelineBucket(index=i, nbytes=n, ready_ms=r, start_ms=start, end_ms=end, cpu_ms=0.0,
                                      call_ms=hook))
    exposed = max(b.end_ms for b in buckets) - backward
    step_ms = (k - 1) * (micro or 0.0) + forward + backward + exposed + optimizer + rest
    run = TimelineRun(
        world_size=2, rank=0, algorithm="ring", concurrent_buckets=lanes, bucket_cap_bytes=25 * MIB,
        first_bucket_bytes=MIB, param_bytes=(3 * MIB, MIB), param_dtypes=("float32", "float32"), device="cpu",
        cpu_count=cpu_count, torch_threads=1, local_world_size=2,
    )
    step = TimelineStep(
        step=0, micro_batches=k, step_ms=step_ms, nosync_micro_ms=(micro,) * (k - 1) if micro else (),
        nosync_other_cpu_ms=(), forward_ms=forward, backward_ms=backward, exposed_ms=exposed,
        optimizer_ms=optimizer, tail_ms=rest, sync_other_cpu_ms=other_cpu, buckets=tuple(buckets),
    )
    return [run, *(dataclasses.replace(step, step=i + 1) for i in range(steps))]


# -- closed cases of the simulation ----------------------------------------------------------------


@pytest.mark.fast
def test_nothing_to_overlap_exposes_every_bucket():
    """Buckets ready only when backward ends, one lane: all communication is exposed, on the
    run's network and on a given one."""
    records = timeline(ready=[20.0, 20.0])
    model = step_model(records)
    assert model.profile.exposed_ms == pytest.approx(ring_ms(MIB) + ring_ms(3 * MIB))
    assert model.predict(run_setting(model.profile)).step_ms == pytest.approx(model.profile.step_ms)
    faster = from_latency_bandwidth(latency_s=5e-6, bandwidth_Bps=10e9)
    prediction = model.with_network(faster).predict(run_setting(model.profile))
    expected = ring_ms(MIB, 5e-3, 1e-7) + ring_ms(3 * MIB, 5e-3, 1e-7)
    assert prediction.exposed_ms == pytest.approx(expected)
    assert prediction.step_ms == pytest.approx(10 + 20 + 1 + 2 + expected)


@pytest.mark.fast
def test_everything_hidden_leaves_only_the_last_bucket():
    """Early buckets finish behind backward; the last one is ready when backward ends, so its
    all-reduce is all that is exposed, whatever the number of lanes."""
    for lanes in (1, 2):
        records = timeline(ready=[2.0, 20.0], lanes=lanes)
        model = step_model(records)
        prediction = model.predict(run_setting(model.profile))
        assert prediction.exposed_ms == pytest.approx(ring_ms(3 * MIB))
        assert prediction.comm_ms == pytest.approx(ring_ms(MIB) + ring_ms(3 * MIB))


@pytest.mark.fast
def test_every_bucket_handed_over_costs_backward_the_hook_s_own_time():
    """The hook runs on DDP's thread, backward's: every bucket handed over before the last one
    holds the rest of backward for its ``call_ms`` (timeline version 6), and only the
    synchronizing micro-batch calls it. Against the same run without the hook's time: the run's
    own row is exact in both; one bucket (cap 25: DDP's first bucket capped too) saves one call;
    k = 4 pays the calls once, where counting them in every micro-batch would pay them 4 times."""
    hook = 0.5  # bucket 0 is handed over at 19.5 ms, its hook returns at 20, when bucket 1 is
    plain, timed = (step_model(timeline(ready=[19.5, 20.0], hook=h)) for h in (0.0, hook))
    assert timed.profile.call_ms == hook and timed.profile.calls_ms == hook  # 2 buckets: one call before the last
    for model in (plain, timed):
        assert model.predict(run_setting(model.profile)).step_ms == pytest.approx(model.profile.step_ms)
    one_bucket = Setting(bucket_cap_mb=25, accumulate=1, algorithm="ring", world_size=2)
    assert timed.predict(one_bucket).buckets == 1
    assert timed.predict(one_bucket).step_ms == pytest.approx(plain.predict(one_bucket).step_ms - hook)
    four = Setting(bucket_cap_mb=None, accumulate=4, algorithm="ring", world_size=2)
    assert timed.predict(four).step_ms == pytest.approx(plain.predict(four).step_ms - 3 * hook)


@pytest.mark.fast
def test_accumulation_scales_compute_not_communication():
    """k micro-batches cost k clean micro-batches plus one step's rest, exposed communication
    and optimizer: speedup(k) = k T / (k clean + rest + exposed + optimizer)."""
    records = timeline(ready=[20.0, 20.0])
    model = step_model(records)
    p = model.profile
    clean = 10 + 20
    assert p.clean_micro_ms == pytest.approx(clean) and p.step_rest_ms == pytest.approx(2.0)
    for k in (1, 2, 4, 8, 16):
        step = k * clean + 2.0 + p.exposed_ms + 1.0
        setting = Setting(bucket_cap_mb=None, accumulate=k, algorithm="ring", world_size=2)
        assert model.predict(setting).step_ms == pytest.approx(step)
        assert model.speedup(setting) == pytest.approx(k * p.step_ms / step)


@pytest.mark.fast
def test_contention_is_measured_from_a_no_sync_micro_batch_and_priced_once_per_step():
    """With k=2 the synchronizing micro-batch is slower than a no_sync one by the contention of
    its hidden communication; at k=1 the step is that micro-batch again."""
    records = timeline(ready=[2.0, 20.0], k=2, micro=27.0)
    model = step_model(records)
    p = model.profile
    assert p.contention_ms == pytest.approx(10 + 20 + 2 - 27.0)
    one = Setting(bucket_cap_mb=None, accumulate=1, algorithm="ring", world_size=2)
    assert model.predict(one).step_ms == pytest.approx(10 + 20 + 2 + p.exposed_ms + 1.0)
    assert p.clean_micro_ms == 27.0  # the measured no_sync micro-batch
    assert model.predict(run_setting(p)).step_ms == pytest.approx(p.step_ms)  # the run itself, exactly


@pytest.mark.fast
def test_contention_at_k1_is_the_other_threads_cpu_when_cores_are_short():
    """At k=1 the contention is the other threads' CPU time during backward, when the ranks'
    compute threads leave no core to the communication lanes (2 cores, 2 ranks), none with many."""
    assert profile_run(timeline(ready=[2.0, 20.0], other_cpu=4.0, cpu_count=2)).contention_ms == pytest.approx(4.0)
    assert profile_run(timeline(ready=[2.0, 20.0], other_cpu=4.0, cpu_count=64)).contention_ms == 0.0


@pytest.mark.fast
def test_lanes_queue_buckets_in_order():
    """Without link time (all fixed), each lane serves its buckets in order and the lanes run side by side."""
    fixed = [BucketCost(4.0, 0.0)] * 3
    one = replay([0.0, 0.0, 0.0], fixed, lanes=1, backward_ms=1.0)
    two = replay([0.0, 0.0, 0.0], fixed, lanes=2, backward_ms=1.0)
    assert one.ends == (4.0, 8.0, 12.0) and one.exposed_ms == 11.0
    assert two.ends == (4.0, 4.0, 8.0) and two.comm_ms == 8.0 and two.hidden_ms == 1.0
    assert two.queue_ms == (0.0, 0.0, 4.0)


@pytest.mark.fast
def test_replay_matches_the_closed_forms():
    """One bucket with nothing to overlap ends after fixed + link; buckets handed early enough
    are hidden and only the last one's cost is exposed; a link-bound queue ends after the sum of
    the links' times, whatever the lanes; exposed never exceeds communication."""
    alone = replay([10.0], [BucketCost(1.5, 6.0)], lanes=2, backward_ms=10.0)
    assert alone.ends == (17.5,) and alone.exposed_ms == 7.5 and alone.comm_ms == 7.5
    hidden = replay([0.0, 20.0, 40.0], [BucketCost(1.0, 3.0)] * 3, lanes=2, backward_ms=40.0)
    assert hidden.exposed_ms == pytest.approx(4.0) and hidden.hidden_ms == pytest.approx(8.0)
    for lanes, last in ((1, 4 * (0.5 + 5.0)), (2, 0.5 + 4 * 5.0), (4, 0.5 + 4 * 5.0)):
        # one lane: each bucket's alpha, then its bytes; more lanes: the link never idles after the first alpha
        bound = replay([0.0] * 4, [BucketCost(0.5, 5.0)] * 4, lanes=lanes, backward_ms=0.0)
        assert bound.ends[-1] == pytest.approx(last), lanes
        assert bound.exposed_ms <= bound.comm_ms
    # Two lanes of independent links would end at 5.5: the shared link is what the lab confirms.
    assert replay([0.0, 0.0], [BucketCost(0.5, 5.0)] * 2, lanes=2, backward_ms=0.0).ends[-1] == pytest.approx(10.5)
    with pytest.raises(ValueError, match="2 ready times but 1 costs"):
        replay([0.0, 1.0], [BucketCost(1.0, 1.0)], lanes=1, backward_ms=0.0)


@pytest.mark.fast
def test_an_exchange_beside_backward_goes_at_its_rate_and_a_one_way_part_at_the_links():
    """``backward_rate``: a ring (both ways) beside backward progresses at that share of its
    price until backward ends, then at full price: ``L/r`` when ``r·B >= L``, else
    ``B + L - r·B``; after backward, or for a tree's one-way halves, the link's price (measured
    on the lab: a ring's 2 MiB bucket beside backward took 53-150 ms, after it 42; a tree's kept
    the link's rate). ``pickup_ms``: a bucket starts that long after its hand-over."""
    ring, tree = BucketCost(0.0, 8.0), BucketCost(0.0, 8.0, ((IN, 0.5), (OUT, 0.5)))
    assert replay([0.0], [ring], lanes=1, backward_ms=20.0, backward_rate=0.5).ends == (16.0,)  # L/r
    assert replay([0.0], [ring], lanes=1, backward_ms=4.0, backward_rate=0.5).ends == (10.0,)  # B + L - r·B
    assert replay([5.0], [ring], lanes=1, backward_ms=4.0, backward_rate=0.5).ends == (13.0,)  # after backward
    assert replay([0.0], [tree], lanes=1, backward_ms=20.0, backward_rate=0.5).ends == (8.0,)
    assert replay([0.0], [ring], lanes=1, backward_ms=20.0).ends == (8.0,)  # the default: not slowed
    # a bucket's fixed part (its messages' alpha) is its lane's, not the link's: never slowed
    assert replay([0.0], [BucketCost(2.0, 8.0)], lanes=1, backward_ms=20.0, backward_rate=0.5).ends == (18.0,)
    picked = replay([0.0, 0.0], [ring, ring], lanes=2, backward_ms=0.0, pickup_ms=1.5)
    assert picked.starts == (1.5, 1.5) and picked.ends == (9.5, 17.5)
    with pytest.raises(ValueError, match="backward_rate is a share of the link's price, in \\(0, 1\\]; got 0.0"):
        replay([0.0], [ring], lanes=1, backward_ms=0.0, backward_rate=0.0)


@pytest.mark.fast
def test_a_tree_queue_uses_both_ways_of_the_full_duplex_link():
    """A link is full duplex. K equal tree (or naive) buckets of 2nβ each (the reduce comes in,
    then the broadcast goes out), all handed at once on two lanes, end after (K+1)·nβ: each
    one's broadcast goes out while the next one's reduce comes in. One lane serializes them
    (2K·nβ); one bucket alone takes its 2nβ; rings, both ways at once, take turns (K·nβ)."""
    network = from_latency_bandwidth(latency_s=0.0, bandwidth_Bps=1e9)
    n, count = 4 * MIB, 5
    n_beta = n * 1e-6  # ms at 1 GB/s
    for algorithm in ("tree", "naive"):
        tree = bucket_cost(network, algorithm, n, 2)
        assert tree.link_ms == pytest.approx(2 * n_beta) and tree.link_directions == ((IN, 0.5), (OUT, 0.5))
        assert replay([0.0] * count, [tree] * count, lanes=2, backward_ms=0.0).ends[-1] == pytest.approx((count + 1) * n_beta)
        assert replay([0.0] * count, [tree] * count, lanes=1, backward_ms=0.0).ends[-1] == pytest.approx(2 * count * n_beta)
        assert replay([3.0], [tree], lanes=2, backward_ms=3.0).exposed_ms == pytest.approx(2 * n_beta)
    ring = bucket_cost(network, "ring", n, 2)
    assert ring.link_ms == pytest.approx(n_beta) and ring.link_directions == ((BOTH, 1.0),)
    assert replay([0.0] * count, [ring] * count, lanes=2, backward_ms=0.0).ends[-1] == pytest.approx(count * n_beta)
    # A densified sparse bucket travels as its algorithm does; a gathered one (ring all-gathers) both ways.
    assert bucket_cost(network, "tree", SparseBucket(1e5, n, DENSIFY), 2).link_directions == tree.link_directions
    assert bucket_cost(network, "tree", SparseBucket(1e5, n, GATHER), 2).link_directions == ((BOTH, 1.0),)
    with pytest.raises(ValueError, match="shares add up to 1"):
        BucketCost(0.0, 1.0, ((IN, 0.5),))


@pytest.mark.fast
def test_the_step_model_prices_a_tree_on_both_ways_of_the_link():
    """From a ring run whose buckets (1 and 3 MiB) are all exposed, on two lanes: the tree's
    exposed time on a network of 1 GB/s is 7 MiB·β (b0 in, then out while b1's 3 MiB come in,
    then b1 out), not the 8 MiB·β of one link shared by both ways; the ring's 4 MiB·β."""
    model = step_model(timeline(ready=[20.0, 20.0], lanes=2)).with_network(
        from_latency_bandwidth(latency_s=0.0, bandwidth_Bps=1e9))
    exposed = {a: model.predict(Setting(bucket_cap_mb=None, accumulate=1, algorithm=a, world_size=2)).exposed_ms
               for a in ("ring", "tree", "naive")}
    assert exposed["tree"] - exposed["ring"] == pytest.approx(3 * MIB * 1e-6)
    assert exposed["naive"] == pytest.approx(exposed["tree"])


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 6, 8, 12])
@pytest.mark.fast
def test_link_directions_are_counted_on_the_schedule(world_size):
    """The closed forms (the ring's, the hierarchy's: both ways throughout) say what the schedule
    says, for every example option; a tree's and naive's root is in for half its link time, then
    out; halving-doubling off a power of two folds in and unfolds out, its shares the formula's."""
    for name, options in algorithm_examples(world_size, scheduled_only=True):
        record = get_algorithm(name)
        if record.link_directions is None or not record.applies(world_size, resolve_options(name, options)):
            continue
        counted = counted_directions(build_schedule(name, world_size, **options))
        assert record.link_directions(world_size, **options) == counted, (name, options)
    for name in ("tree", "naive"):
        assert link_directions(name, world_size) == ((IN, 0.5), (OUT, 0.5))
    pof2 = 1 << (world_size.bit_length() - 1)
    fold = (pof2 != world_size) / (2 * (pof2 - 1) / pof2 + 2 * (pof2 != world_size))
    expected = ((BOTH, 1.0),) if not fold else ((IN, fold), (BOTH, 1 - 2 * fold), (OUT, fold))
    found = link_directions("halving_doubling", world_size)
    assert [way for way, _ in found] == [way for way, _ in expected]
    assert [share for _, share in found] == pytest.approx([share for _, share in expected])
    assert link_directions("native", world_size) == link_directions("auto", world_size) == ((BOTH, 1.0),)


@pytest.mark.fast
def test_a_buckets_own_link_time_counts_what_ran_beside_it():
    """``service_ms``: two buckets started together on two lanes, the second ending later. Two
    rings took turns: the second's own time is from the first's end. Two trees overlapped: the
    second's reduce came in from the end of the first's (its broadcast went out beside it)."""
    spans = [(0.0, 2.0), (0.0, 3.0)]
    assert service_ms(spans) == [2.0, 1.0]
    trees = [((IN, 0.5), (OUT, 0.5))] * 2
    assert service_ms(spans, trees) == [2.0, 2.0]


@pytest.mark.fast
def test_ready_curve_interpolates_between_hand_overs():
    curve = ReadyCurve.from_buckets([10.0, 30.0], [100, 300])
    assert curve.time_at(50) == 5.0 and curve.time_at(250) == 20.0 and curve.time_at(400) == 30.0
    assert curve.ready_times([200, 200]) == [pytest.approx(50 / 3), 30.0]


# -- DDP's bucketing rules -------------------------------------------------------------------------


@pytest.mark.fast
def test_bucket_limits_follow_ddp():
    assert bucket_limits(bucket_cap_mb=None) == (MIB, 25 * MIB)
    assert bucket_limits(bucket_cap_mb=5) == (5 * MIB,)
    assert bucket_limits(bucket_cap_mb=5, explicit_first_is_cap=False) == (MIB, 5 * MIB)
    with pytest.raises(ValueError, match="bucket_cap_mb must be positive"):
        bucket_limits(bucket_cap_mb=0)


@pytest.mark.fast
def test_assign_buckets_closes_at_the_limit_and_keeps_dtypes_apart():
    assert assign_buckets([600, 600, 3000, 10], [1000, 2000]) == [[0, 1], [2], [3]]
    assert assign_buckets([6, 6, 6], [5, 100], dtypes=["float32", "float16", "float32"]) == [[0], [1], [2]]
    assert rebuilt_bucket_bytes([4, 4, 4], [8]) == [8, 4]


def _real_buckets(rank: int, world_size: int, widths: list[int], cap):
    """Bucket bytes of a real DDP model: DDP's own report (its initial layout), what the hook
    saw in step 1 and after the rebuild, and the advisor's replay of DDP's rules."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import ddp_ring_hooks

    torch.manual_seed(0)
    layers = [torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])]
    model = DistributedDataParallel(torch.nn.Sequential(*layers), **({} if cap is None else {"bucket_cap_mb": cap}))
    state = ddp_ring_hooks.register(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        model(torch.randn(4, widths[0])).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    reported = [int(s) for s in str(model._get_ddp_logging_data()["bucket_sizes"]).split(",")]
    first = [b.nbytes for b in state.timeline.steps[0].buckets]
    seen = [b.nbytes for b in state.timeline.steps[-1].buckets]
    run = state.timeline.run
    predicted = rebuilt_bucket_bytes(list(run.param_bytes), bucket_limits(bucket_cap_mb=cap), dtypes=list(run.param_dtypes))
    state.close()
    return reported, first, seen, predicted


@pytest.mark.parametrize(("widths", "cap"), [([512, 512, 512, 512], None), ([300, 400, 500, 100], 0.5), ([64] * 6, 0.02)])
def test_bucket_repacking_matches_a_real_ddp_model(widths, cap):
    """Step 1 reduces all gradients in one bucket (DDP does not know their order yet); after
    it, the hook receives exactly the buckets the replay of DDP's rules predicts, in order."""
    reported, first, seen, predicted = run_ranks(_real_buckets, 2, widths, cap, timeout=120)[0]
    assert reported == first == [sum(predicted)]
    assert len(predicted) > 1
    assert seen == predicted


@pytest.mark.fast
def test_network_from_bench_records_fits_each_algorithm():
    records = [
        {"algorithm": algorithm, "world_size": 4, "nbytes": n, "time_us": 1e6 * t(n)}
        for n in (1 << 12, 1 << 16, 1 << 20)
        for algorithm, t in (("ring", lambda n: 6 * 1e-5 + 1.5 * n * 1e-9), ("native", lambda n: 6 * 2e-5 + 1.5 * n * 1e-9))
    ]
    network = from_bench(records)
    assert network.calibration("ring").alpha == pytest.approx(1e-5)
    assert network.calibration("native").alpha == pytest.approx(2e-5)
    assert network.calibration("tree") == network.calibration("ring")


@pytest.mark.fast
def test_advice_has_the_stable_shape_and_names_the_change():
    advice = advise(timeline(ready=[20.0, 20.0]))
    assert set(advice["run"]) == {"world_size", "algorithm", "accumulate", "bucket_cap_mb", "steps", "step_ms",
                                  "compute_ms", "comm_ms", "exposed_ms"}
    assert {r["knob"] for r in advice["what_if"]} == {"bucket_cap_mb", "accumulate", "algorithm", "world_size", "wire_dtype"}
    assert {r["value"] for r in advice["what_if"] if r["knob"] == "algorithm"} >= {"ring", "tree", "native"}
    # The fields every row had before, and the ones added since (issue 31): the shape only grows.
    row_fields = {"knob", "value", "step_ms", "comm_ms", "exposed_ms", "speedup", "this_run", "speedup_range", "uncertain"}
    assert all(set(r) == row_fields | ({"verdict"} if r["knob"] == "wire_dtype" else set()) for r in advice["what_if"])
    wires = {r["value"]: r for r in advice["what_if"] if r["knob"] == "wire_dtype"}
    assert set(wires) == {"fp32", "bf16", "fp16"} and wires["fp32"]["this_run"] and wires["fp32"]["verdict"] is None
    # No probe: the casts were never timed, so a narrower wire's row says it is uncertain.
    assert wires["bf16"]["verdict"] in ("pays", "does not pay") and wires["bf16"]["uncertain"]
    rec = advice["recommendation"]
    # Accumulation gains 1.08x, 1.12x, 1.15x, 1.16x at k=2..16: the knee (80% of the largest gain) is k=8.
    gains = {r["value"]: r["speedup"] for r in advice["what_if"] if r["knob"] == "accumulate"}
    assert gains[8] - 1 >= 0.8 * (gains[16] - 1) > gains[4] - 1
    assert rec["knob"] == "accumulate" and rec["value"] == 8 and "effective batch grows 8x" in rec["why"]


@pytest.mark.fast
def test_the_table_marks_the_runs_own_rows_and_explains_the_explicit_cap_of_its_size():
    default_cap = advise(timeline(ready=[20.0, 20.0]))  # DDP's default: 1 MiB first bucket, then 25 MiB
    own = {(r["knob"], r["value"]) for r in default_cap["what_if"] if r["this_run"]}
    assert own == {("accumulate", 1), ("algorithm", "ring"), ("world_size", 2), ("wire_dtype", "fp32")}
    text = format_advice(default_cap)
    assert "  1 (this run) " in text and "  ring (this run) " in text and "  2 (this run) " in text
    assert "25 (this run)" not in text
    assert "(25 is bucket_cap_mb=25 given explicitly, not this run: an explicit cap also makes the first bucket 25 MB" in text

    records = timeline(ready=[20.0, 20.0])
    records[0] = dataclasses.replace(records[0], first_bucket_bytes=25 * MIB)  # bucket_cap_mb=25 given explicitly
    explicit = advise(records)
    assert ("bucket_cap_mb", 25) in {(r["knob"], r["value"]) for r in explicit["what_if"] if r["this_run"]}
    assert "  25 (this run) " in format_advice(explicit) and "given explicitly" not in format_advice(explicit)


@pytest.mark.fast
def test_too_few_steps_and_gpu_timelines_are_clear_errors():
    with pytest.raises(ValueError, match="holds 1 optimizer step\\(s\\); the advisor needs at least 3"):
        advise(timeline(ready=[20.0, 20.0], steps=1))
    # One step after step 1 is no median: a message, never a number.
    with pytest.raises(ValueError, match="holds 2 optimizer step\\(s\\); the advisor needs at least 3 .*train a few more"):
        advise(timeline(ready=[20.0, 20.0], steps=2))
    # Enough steps, but only one of them at the run's k: the others were other settings.
    records = timeline(ready=[20.0, 20.0], steps=4)
    mixed_k = [*records[:3], *(dataclasses.replace(s, micro_batches=k, nosync_micro_ms=(30.0,) * (k - 1))
                               for s, k in zip(records[3:], (2, 3)))]
    with pytest.raises(ValueError, match="holds 1 measured step\\(s\\) of the run's setting .*one step is no median"):
        advise(mixed_k)
    assert advise(timeline(ready=[20.0, 20.0], steps=3))["run"]["steps"] == 2
    records = timeline(ready=[20.0, 20.0])
    with pytest.raises(ValueError, match="one rank communicates nothing"):
        advise([dataclasses.replace(records[0], world_size=1), *records[1:]])
    with pytest.raises(ValueError, match="recorded on cuda.*CPU \\(gloo\\) runs"):
        advise([dataclasses.replace(records[0], device="cuda"), *records[1:]])


# -- end to end: 2 ranks, a log_dir, advise --json ------------------------------------------------


def _train_and_advise(rank: int, world_size: int, log_dir: str):
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import ddp_ring_hooks

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                              torch.nn.Linear(256, 10))
    model = DistributedDataParallel(net, bucket_cap_mb=0.2)
    state = ddp_ring_hooks.register(model, log_dir=log_dir)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(8):
        for micro in range(2):  # accumulation: the first micro-batch without sync
            if micro == 0:
                with model.no_sync():
                    model(torch.randn(16, 256)).sum().backward()
            else:
                model(torch.randn(16, 256)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    advice = state.advise()
    state.close()
    grads = [p.grad for p in model.parameters()]
    probe = state.plan.probed[1]
    # By default the probe runs only for a run whose timeline is written (a log_dir, on any rank).
    probed = {}
    for case, options in {"no log_dir": {}, "log_dir on rank 0 only": {"log_dir": log_dir + "_rank0"} if rank == 0 else {},
                          "asked, no log_dir": {"network_probe": True}}.items():
        other = ddp_ring_hooks.register(DistributedDataParallel(torch.nn.Linear(8, 8)), **options)
        probed[case] = other.plan.probed is not None
        other.close()
    return advice, torch.cat([torch.zeros(1)] + [g.flatten() for g in grads if g is not None]), (probe, probed)


def test_two_ranks_then_advise_json_reads_the_log_dir(tmp_path):
    log_dir = str(tmp_path / "run")
    (advice, grads0, (probe0, probed0)), (_, grads1, (probe1, probed1)) = run_ranks(
        _train_and_advise, 2, log_dir, timeout=180)
    probes = [probe0, probe1]
    expected = {"no log_dir": False, "log_dir on rank 0 only": True, "asked, no log_dir": True}
    assert probed0 == probed1 == expected
    assert grads0.equal(grads1)
    assert advice["run"]["accumulate"] == 2 and advice["run"]["world_size"] == 2
    assert advice["run"]["steps"] == 6  # 8 steps: the first is DDP's single bucket, the last never ends

    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-m", "ddp_ring_hooks", "advise", log_dir, "--json"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    offline = json.loads(done.stdout)
    assert offline["run"] == advice["run"]  # the file holds what memory held
    assert {r["knob"] for r in offline["what_if"]} == {"bucket_cap_mb", "accumulate", "algorithm", "world_size", "wire_dtype"}
    assert set(offline["recommendation"]) == {"knob", "value", "speedup", "why"}
    # The probe ran when the hook was registered (collective: every rank holds the same numbers),
    # the timeline recorded it, and the advice is priced with it and says so.
    from ddp_ring_hooks.runtime.network_probe import (
        MESSAGES_PROBE, PROBE_BUDGET_S, PROBE_MOST, PROBE_REPEATS, PROBE_SIZES, WIRE_SIZES, other_wire_size,
    )
    from ddp_ring_hooks.telemetry.timeline import read_timeline

    (run_path,) = glob.glob(os.path.join(log_dir, "**", "timeline*.jsonl"), recursive=True)[:1]
    run = read_timeline(run_path)[0]
    assert run.probe_algorithm == "ring" and dict(run.options)["wire_dtype"] == "fp32"
    assert [(s.nbytes, s.wire, s.algorithm) for s in run.probe] == [
        *((n, "fp32", "") for n in PROBE_SIZES), *((2 * n, "bf16", "") for n in WIRE_SIZES),  # bf16: as many bytes on the wire
        (PROBE_SIZES[0], "fp32", MESSAGES_PROBE[0])]
    assert run.probe[-1].options == MESSAGES_PROBE[1]  # read back from the file as it was written
    for s in run.probe:  # three blocks, then more while they took under the budget (every rank alike)
        assert min(s.seconds) > 0 and PROBE_REPEATS <= len(s.seconds) <= PROBE_MOST, s
        assert len(s.seconds) == PROBE_MOST or sum(s.seconds) >= PROBE_BUDGET_S, s
        assert len(s.seconds) == PROBE_REPEATS or sum(s.seconds[:-1]) < PROBE_BUDGET_S, s
    assert offline["model"]["network"]["source"].startswith("probed when the hook was registered: ring at 16 KiB-4 MiB")
    assert [other_wire_size(n, own="fp32", other="bf16") for n in WIRE_SIZES] == [2 * n for n in WIRE_SIZES]
    assert all(r["speedup_range"] is not None for r in offline["what_if"])
    assert probes[0] == probes[1] == run.probe
    # Every bucket of a measured step recorded the hook's own time on DDP's thread.
    steps = read_timeline(run_path)[2:]
    assert steps and all(0 < b.call_ms < 1000 for s in steps for b in s.buckets), [b.call_ms for s in steps for b in s.buckets]
    assert offline["model"]["buckets"] and sum(offline["model"]["buckets"]) == (256 * 256 + 256) * 4 * 2 + (256 * 10 + 10) * 4

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # The panel goes through the run's own TensorBoard sink: one events file, beside comm/*.
    (events,) = glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))
    accumulator = EventAccumulator(events, size_guidance={"tensors": 0, "scalars": 0}).Reload()
    assert "comm/advice/text_summary" in accumulator.Tags()["tensors"]
    assert "comm/step/total_ms" in accumulator.Tags()["scalars"]
    (panel,) = accumulator.Tensors("comm/advice/text_summary")
    assert "recommendation:" in panel.tensor_proto.string_val[0].decode()

    (tmp_path / "empty").mkdir()
    bad = subprocess.run([sys.executable, "-m", "ddp_ring_hooks", "advise", str(tmp_path / "empty")], capture_output=True,
                         text=True, timeout=60, env=env)
    assert bad.returncode == 2 and "no timeline.jsonl" in bad.stderr


@pytest.mark.fast
def test_the_communication_cpu_contention_follows_is_a_part_per_bucket_and_a_part_per_byte():
    """The workers' CPU per bucket (``cpu_ms``) is fitted as a part per bucket and a part per
    byte, the shape contention grows with: a bucket of four times the bytes costs one bucket's
    part plus four times the bytes' (per byte alone, MLP 1's 4 MB cap was priced 4.7 ms of
    contention where its backward grew by none). A run that timed no CPU falls back to the bytes."""
    import dataclasses

    from ddp_ring_hooks.advisor.step_model import CommCpu, comm_cpu

    def run_with_cpu(cpus):
        run, *steps = timeline(ready=[2.0, 20.0], k=2, micro=27.0)
        return profile_run([run, *(dataclasses.replace(step, buckets=tuple(
            dataclasses.replace(b, cpu_ms=c) for b, c in zip(step.buckets, cpus))) for step in steps)])

    fitted = comm_cpu(run_with_cpu([0.5, 0.9]))  # 1 MiB: 0.5 ms, 3 MiB: 0.9 ms
    assert fitted.per_bucket_ms == pytest.approx(0.3) and fitted.per_byte_ms * MIB == pytest.approx(0.2)
    assert fitted.of(4 * MIB) == pytest.approx(0.3 + 0.8)
    # Never a negative part: CPU that falls with the bytes is all per bucket, one that would
    # start below 0 all per byte.
    assert comm_cpu(run_with_cpu([0.9, 0.5])) == CommCpu(pytest.approx(0.7), 0.0)
    assert comm_cpu(run_with_cpu([0.1, 1.0])) == CommCpu(0.0, pytest.approx(0.55 / (2 * MIB)))
    assert comm_cpu(run_with_cpu([0.0, 0.0])) == CommCpu(0.0, 1.0)


@pytest.mark.fast
def test_contention_grows_with_what_the_busiest_rank_sends():
    """Ring and tree at 2 ranks each send the buffer once per rank (tree's formula counts it
    twice on the critical path); naive's master sends it to every peer."""
    from ddp_ring_hooks.advisor.network import bytes_factor

    assert bytes_factor("ring", 2) == bytes_factor("tree", 2) == bytes_factor("native", 2) == 1.0
    assert bytes_factor("ring", 8) == pytest.approx(1.75) and bytes_factor("naive", 8) == 7.0
    assert bytes_factor("ring", 1) == 0.0


def test_advisor_imports_no_torch():
    """The advisor is pure: it runs offline on a log_dir, without torch or process groups."""
    assert not imports_torch("ddp_ring_hooks.advisor")


def _lightning_fit_prints_advice(rank: int, world_size: int, directory: str):
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    import contextlib
    import io

    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger

    import ddp_ring_hooks.integrations.lightning as ring_lightning
    from ddp_ring_hooks.advisor import profile_run
    from train_examples.char_lm import CharLanguageModel, make_dataloader, quiet_lightning

    quiet_lightning()
    pl.seed_everything(0, verbose=False)
    strategy = ring_lightning.RingDDPStrategy(bucket_cap_mb=0.02)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=5, accumulate_grad_batches=2,
        logger=TensorBoardLogger(directory, name="", version="run"), callbacks=[ring_lightning.CommTimingLogger()],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.fit(CharLanguageModel(seq_len=16, width=32, num_layers=2, num_heads=2),
                    make_dataloader(seq_len=16, micro_batch=64))
    return printed.getvalue(), profile_run(strategy.hook_state.timeline.records())


def test_lightning_prints_the_advice_at_the_end_of_fit_on_rank_0(tmp_path):
    """Lightning accumulates with no_sync and runs the synchronizing micro-batch inside
    optimizer.step(closure): the timeline still finds k=2 and leaves forward and backward out
    of the optimizer time (else the rest of the step would come out negative)."""
    pytest.importorskip("lightning")
    (text0, profile), (text1, _) = run_ranks(_lightning_fit_prints_advice, 2, str(tmp_path), timeout=240)
    assert "communication advice" in text0 and "recommendation:" in text0
    assert "communication advice" not in text1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    panels = EventAccumulator(str(tmp_path / "run"), size_guidance={"tensors": 0}).Reload().Tags()["tensors"]
    assert "comm/advice/text_summary" in panels
    assert profile.accumulate == 2 and len(profile.buckets) > 1
    # The rest is a difference of medians of a few steps, so noise moves it: -3.4 ms of a 27 ms
    # step (-13%) with the whole suite on the other core; counting forward and backward as
    # optimizer time made it -57 ms of a ~100 ms step (-57%). Micro-batches of 64 make forward
    # and backward 3-5x the optimizer's own 2-4 ms, so counting them in it fails, and noise does
    # not (at 2, forward and backward were 4-8 ms and a CI run's optimizer read 4.3 ms).
    assert profile.rest_ms > -0.25 * profile.step_ms and profile.optimizer_ms < profile.forward_ms + profile.backward_ms


@pytest.mark.fast
def test_advise_cli_reads_a_network_profile_and_rejects_bad_input(tmp_path, capsys):
    """--network takes `bench --json` records; a faster network shrinks the predicted exposed
    time; wrong files and half-given networks are clear errors naming the fix."""
    from ddp_ring_hooks.cli.__main__ import main

    (tmp_path / "timeline.jsonl").write_text("\n".join(r.to_json() for r in timeline(ready=[20.0, 20.0])))
    bench = [{"algorithm": a, "world_size": 2, "nbytes": n, "time_us": 2 * 5 + n * 1e-4, "count": n // 4,
              "dtype": "float32", "algbw_GBps": 0, "busbw_GBps": 0, "wrong": 0}
             for a in ("ring", "native") for n in (1 << 16, 1 << 20, 1 << 24)]
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    assert main(["advise", str(tmp_path), "--json"]) == 0
    here = json.loads(capsys.readouterr().out)
    assert main(["advise", str(tmp_path), "--network", str(tmp_path / "bench.json"), "--json"]) == 0
    there = json.loads(capsys.readouterr().out)
    assert there["model"]["network"]["source"].startswith("bench records at 2 ranks")
    cap = {r["value"]: r for r in there["what_if"] if r["knob"] == "accumulate"}
    assert cap[1]["exposed_ms"] < here["run"]["exposed_ms"]  # 10 GB/s instead of 1 GB/s

    (tmp_path / "bad.json").write_text('{"not": "records"}')
    assert main(["advise", str(tmp_path), "--network", str(tmp_path / "bad.json")]) == 2
    assert "is not `ddp-ring-hooks bench --json` output" in capsys.readouterr().err
    assert main(["advise", str(tmp_path), "--latency", "5us"]) == 2
    assert "--latency and --bandwidth go together" in capsys.readouterr().err


@pytest.mark.fast
def test_advise_on_a_directory_of_runs_lists_them_and_advises_on_the_first(tmp_path, capsys):
    """The main job's version_N holds one run per k and round: all listed, the first advised on."""
    from ddp_ring_hooks.cli.__main__ import main

    for k in (1, 2, 10):
        for round_index in (0, 1):
            run = tmp_path / f"accumulate_{k}" / f"round_{round_index}"
            run.mkdir(parents=True)
            records = timeline(ready=[20.0, 20.0], k=k, micro=5.0)
            (run / "timeline.jsonl").write_text("\n".join(r.to_json() for r in records))
    assert main(["advise", str(tmp_path), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["run"]["accumulate"] == 1  # stdout stays one JSON document
    assert f"{tmp_path} holds 6 runs with a timeline: accumulate_1/round_0, accumulate_1/round_1, " \
           "accumulate_2/round_0, accumulate_2/round_1, accumulate_10/round_0, accumulate_10/round_1" in err
    assert f"advising on the first, {tmp_path / 'accumulate_1' / 'round_0'}" in err
    assert main(["advise", str(tmp_path / "accumulate_10" / "round_1")]) == 0
    out, err = capsys.readouterr()
    assert "accumulate 10" in out and "10 (this run)" in out and not err


@pytest.mark.fast
def test_a_torn_last_timeline_line_is_skipped_and_an_auto_run_gets_advice(tmp_path):
    """A run still writing (or killed mid-line) leaves a partial last line: the steps before it
    stand. A run with algorithm="auto" is priced as the ring, and gets its tables."""
    from ddp_ring_hooks.telemetry.timeline import read_timeline

    records = timeline(ready=[2.0, 20.0])
    records[0] = dataclasses.replace(records[0], algorithm="auto")
    path = tmp_path / "timeline.jsonl"
    path.write_text("".join(r.to_json() + "\n" for r in records) + '{"type": "step", "step_ms": 1')
    assert read_timeline(path) == records
    advice = advise(read_timeline(path))
    assert {row["knob"] for row in advice["what_if"]} >= {"accumulate", "bucket_cap_mb", "algorithm"}
    path.write_text(records[0].to_json() + "\nnot json\n" + records[1].to_json() + "\n")
    with pytest.raises(ValueError, match="line 2: not a timeline record"):
        read_timeline(path)


@pytest.mark.fast
def test_timeline_records_round_trip_and_old_or_foreign_files_are_read_or_refused(tmp_path):
    """Every record survives ``to_json``/``from_json``; a file written before records carried a
    version (the same fields, as plain JSON) reads the same; a newer version, a line missing a
    field or with a field this version does not know is refused, naming the line and the field."""
    from ddp_ring_hooks.telemetry.timeline import read_timeline
    from ddp_ring_hooks.telemetry.timeline_records import TIMELINE_VERSION, record_from_json

    records = timeline(ready=[2.0, 20.0], k=2, micro=27.0)
    assert [record_from_json(r.to_json()) for r in records] == records
    assert records[0].version == TIMELINE_VERSION

    def as_old_dict(record):  # what the timeline wrote before its records were typed
        data = {"type": "run" if isinstance(record, TimelineRun) else "step", **dataclasses.asdict(record)}
        data.pop("version", None)
        return data

    path = tmp_path / "timeline.jsonl"
    path.write_text("".join(json.dumps(as_old_dict(r)) + "\n" for r in records))
    # A file without a version is version 1: the same run, without the fields version 2 added.
    assert read_timeline(path) == [dataclasses.replace(records[0], version=1), *records[1:]]
    assert advise(read_timeline(path)) == advise(records)

    newer = {**as_old_dict(records[0]), "version": TIMELINE_VERSION + 1}
    path.write_text(json.dumps(newer) + "\n")
    with pytest.raises(ValueError, match=f"line 1: .*format version {TIMELINE_VERSION + 1}.*upgrade"):
        read_timeline(path)
    lacking = as_old_dict(records[1])
    del lacking["tail_ms"]
    path.write_text(records[0].to_json() + "\n" + json.dumps(lacking) + "\n" + records[2].to_json() + "\n")
    with pytest.raises(ValueError, match="line 2: .*TimelineStep record lacks tail_ms"):
        read_timeline(path)
    path.write_text(json.dumps({**as_old_dict(records[0]), "colour": "blue"}) + "\n")
    with pytest.raises(ValueError, match="line 1: .*has unknown colour"):
        read_timeline(path)

    # A probe with its second message count survives the file; a version-4 probe (its samples
    # without ``algorithm`` and ``options``) reads as the run's algorithm alone: no per-call cost.
    probed = _probed(records, probe_samples(180e-6, 50e6, 1e-9, per_call_s=440e-6))
    path.write_text("".join(r.to_json() + "\n" for r in probed))
    assert read_timeline(path) == probed
    old_probe = {**as_old_dict(probed[0]), "version": 4}
    old_probe["probe"] = [{k: v for k, v in sample.items() if k not in ("algorithm", "options")}
                          for sample in old_probe["probe"][:-1]]
    path.write_text(json.dumps(old_probe) + "\n" + "".join(r.to_json() + "\n" for r in probed[1:]))
    old_run = read_timeline(path)[0]
    assert [s.algorithm for s in old_run.probe] == [""] * (len(probed[0].probe) - 1)
    assert advise(read_timeline(path))["model"]["network"]["per_algorithm"]["*"]["per_call_us"] == 0

    # A version-5 file's buckets carry no call_ms: they read 0, and no hook time is counted.
    timed = timeline(ready=[2.0, 20.0], hook=0.4)
    old_step = as_old_dict(timed[1])
    for bucket in old_step["buckets"]:
        del bucket["call_ms"]
    path.write_text(json.dumps({**as_old_dict(timed[0]), "version": 5}) + "\n" + json.dumps(old_step) + "\n")
    assert [b.call_ms for b in read_timeline(path)[1].buckets] == [0.0, 0.0]


@pytest.mark.fast
def test_contention_counts_what_the_busiest_rank_sends_for_every_algorithm():
    from ddp_ring_hooks.advisor.network import bytes_factor

    assert bytes_factor("halving_doubling", 3) == 2.0  # the fold's sender sends once; the formula's beta says 3
    assert bytes_factor("hierarchical", 8, local_size=4) == pytest.approx(1.75)



@pytest.mark.fast
def test_a_hierarchical_run_is_advised_with_its_own_node_size_wherever_its_log_is_read(monkeypatch):
    """The advisor resolves each algorithm's options as the run did (its LOCAL_WORLD_SIZE, recorded
    in the timeline), not from the shell that reads the log: that shell often has none, and then a
    hierarchical run could not be advised at all."""
    from ddp_ring_hooks.advisor.network import bytes_factor
    from ddp_ring_hooks.advisor.step_model import setting_options

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    records = timeline(ready=[2.0, 20.0])
    records[0] = dataclasses.replace(records[0], algorithm="hierarchical", world_size=4, local_world_size=2)
    model = step_model(records)
    here = run_setting(model.profile)
    # (segments: None, chosen per bucket size where the bucket is priced)
    assert setting_options(model.profile, here) == {
        "local_size": 2, "segments": None, "ring_order": "rank", "node_of": None, "wire_dtype": "fp32",
    }
    assert model.predict(here).step_ms == pytest.approx(model.profile.step_ms)  # the run itself, exactly
    algorithms = {row["value"] for row in advise(records)["what_if"] if row["knob"] == "algorithm"}
    assert {"ring", "tree", "hierarchical"} <= algorithms
    # An option the setting gives wins over the run's environment.
    eight = replace(here, world_size=8, algorithm_options=(("local_size", 4),))
    assert setting_options(model.profile, eight) == {
        "local_size": 4, "segments": None, "ring_order": "rank", "node_of": None, "wire_dtype": "fp32",
    }
    assert bytes_factor("hierarchical", 8, **setting_options(model.profile, eight)) == pytest.approx(1.75)


def accuracy_benchmark():
    """``benchmarks/advisor_accuracy.py`` as a module."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    try:
        import advisor_accuracy
    finally:
        sys.path.pop(0)
    return advisor_accuracy


@pytest.mark.fast
def test_the_accuracy_benchmark_ends_with_a_verdict_per_model_and_target():
    advisor_accuracy = accuracy_benchmark()
    assert advisor_accuracy.verdict_lines({"mlp": [0.047, 0.01, 0.285], "char-lm": [0.02, 0.03, 0.09]}) == [
        "target mlp median |error| <= 5%: 4.7%, met",
        "target mlp worst |error| <= 15%: 28.5%, missed",
        "target char-lm median |error| <= 5%: 3.0%, met",
        "target char-lm worst |error| <= 15%: 9.0%, met",
    ]
    # A wire row's verdict, predicted and measured (issue 29: right in every case measured).
    assert advisor_accuracy.wire_verdicts("wire", 0.9, 1.1) == "   pays, measured does not pay: WRONG"
    assert advisor_accuracy.wire_verdicts("wire", 1.2, 1.01) == "   does not pay, measured does not pay: right"
    assert advisor_accuracy.wire_verdicts("accumulate", 0.5, 0.5) == ""
    # On the lab, issue 31's tighter worst case.
    assert advisor_accuracy.verdict_lines({"mlp": [0.047, 0.12]}, lab=True)[1] == "target mlp worst |error| <= 10%: 12.0%, missed"


@pytest.mark.fast
def test_the_base_against_a_copy_of_itself_is_printed_as_the_measurement_s_own_error_and_judged_in_no_target(capsys):
    """The copy row is predicted 1.00x by definition: what it measures is the benchmark's noise
    (over 5 pairs on the lab, a setting identical to the base read 1.13x), said apart from the
    rows whose errors the targets count."""
    advisor_accuracy = accuracy_benchmark()
    records = timeline(ready=[2.0, 20.0])
    base_ms = records[1].step_ms
    data = {"runs": [[record.to_json() for record in records]],
            "pairs": [[*advisor_accuracy.COPY, [[1.05 * base_ms, base_ms]] * 3],
                      ["accumulate", 2, [[2 * base_ms, base_ms]] * 3]]}
    errors = advisor_accuracy.report("mlp", data, advisor_accuracy.parse_args([]))
    printed = capsys.readouterr().out
    assert "(the base against a copy of itself: the measurement)" in printed and "+5.0%" in printed
    assert len(errors) == 1  # accumulate only
    assert "median |error|" in printed and f"{errors[0]:.1%}" in printed


@pytest.mark.fast
def test_each_rows_measured_median_carries_its_order_statistic_interval():
    """A row's measured ratio is a median of its pairs: the interval printed beside it is the
    narrowest [x(j), x(n+1-j)] holding the median with 90% (binomial, p = 1/2), and a miss is
    named as beyond the measurement only when even its interval's nearer end misses."""
    advisor_accuracy = accuracy_benchmark()
    fifteen = [1.0 + i / 100 for i in range(15)]  # sorted already: x(j) = 1 + (j - 1)/100
    assert advisor_accuracy.median_interval(fifteen) == (1.03, 1.11)  # x(4)..x(12): 96.5% (x(5)..x(11): 88.2%)
    assert advisor_accuracy.median_interval([5.0, 1.0, 3.0, 2.0, 4.0]) == (1.0, 5.0)  # 5 pairs: 93.8%
    assert advisor_accuracy.median_interval([2.0]) == (2.0, 2.0)
    low, high = advisor_accuracy.error_interval(1.0, [0.8, 1.0, 1.25])  # predicted 1.00x
    assert (low, high) == (pytest.approx(-0.2), pytest.approx(0.25))
    assert advisor_accuracy.nearest_error((low, high)) == 0.0
    assert advisor_accuracy.nearest_error((-0.14, -0.11)) == pytest.approx(0.11)
    line = advisor_accuracy.beyond_the_measurement({("accumulate", 4): 0.11, ("wire", "bf16"): 0.02}, 0.10)
    assert line.endswith("intervals: accumulate=4 (11.0%)")
    assert advisor_accuracy.beyond_the_measurement({("wire", "bf16"): 0.02}, 0.10).endswith(": none")


@pytest.mark.fast
def test_a_wrong_recommendation_says_whether_the_measurements_spread_could_make_it_the_best():
    """Accumulation's knee (the smallest k with 80% of the largest gain) can fall between two k
    whose medians lie a few percent apart: k = 4 at 1.15x against k = 8 at 1.25x picks k = 8, while
    with k = 4 at the top of its interval and k = 8 at the bottom the rule picks k = 4. Intervals
    that do not reach that far leave the pick wrong beyond the measurement."""
    advisor_accuracy = accuracy_benchmark()
    model = step_model(timeline(ready=[2.0, 20.0]))

    def rows(k4: tuple[float, float, float], k8: tuple[float, float, float]) -> list[dict]:
        return [{"knob": "accumulate", "value": k, "this_run": False, "uncertain": False, "speedup": median,
                 "interval": (low, high), "comm_ms": 1.0, "exposed_ms": 1.0}
                for k, (low, median, high) in ((4, k4), (8, k8))]

    k4 = {"knob": "accumulate", "value": 4}
    # Each end counts: k = 4's median against k = 8's bottom, or its top against k = 8's median, picks k = 8.
    close = rows((1.12, 1.15, 1.18), (1.20, 1.25, 1.30))
    assert recommend(model, close)["value"] == 8  # at the medians
    assert advisor_accuracy.settled_by_the_measurement(model, close, k4).startswith("within the measurement")
    apart = rows((1.13, 1.15, 1.155), (1.20, 1.25, 1.30))
    assert advisor_accuracy.settled_by_the_measurement(model, apart, k4).startswith("beyond the measurement")


@pytest.mark.fast
def test_a_saved_lab_run_is_judged_as_a_lab_run_without_lab():
    """``--load`` of a lab run's file once printed loopback's header and worst target (15%, not
    10%) and no world-size rows unless ``--lab`` was given again."""
    advisor_accuracy = accuracy_benchmark()
    args = advisor_accuracy.as_saved(advisor_accuracy.parse_args(["--load", "lab.json"]),
                                     {"mlp_wide": {"runs": [], "lab": True, "link": "100Mbit"}})
    assert args.lab and args.link == "100Mbit" and args.world_sizes == [3, 4, 6, 8] and args.load == "lab.json"
    loopback = advisor_accuracy.parse_args(["--load", "loopback.json"])
    assert advisor_accuracy.as_saved(loopback, {"mlp": {"runs": []}}) is loopback


def test_the_accuracy_benchmark_on_the_lab_measures_world_sizes_and_refuses_bad_input(capsys):
    advisor_accuracy = accuracy_benchmark()
    args = advisor_accuracy.parse_args(["--lab"])
    assert (args.models, args.accumulate, args.bucket_caps, args.world_sizes) == ("mlp_wide,mlp_overlap", "2,4", "1,100",
                                                                                  [3, 4, 6, 8])
    # 15 pairs on the lab's quota'd hosts (5 on loopback), and each of 8 hosts a share of 80% of the cores
    assert (args.pairs, advisor_accuracy.parse_args([]).pairs, advisor_accuracy.parse_args(["--lab", "--pairs", "3"]).pairs) == (15, 5, 3)
    assert args.host_cpus == pytest.approx(max(0.1, 0.8 * os.cpu_count() / 8))
    base, variants = advisor_accuracy.variants_of(args)
    assert base["ranks"] == 2 and advisor_accuracy.lab_hosts(args) == 8
    assert variants[0] == (*advisor_accuracy.COPY, base)  # the measurement's own error, first
    assert [(knob, value, setting["ranks"]) for knob, value, setting in variants if knob == "world_size"] == [
        ("world_size", 3, 3), ("world_size", 4, 4), ("world_size", 6, 6), ("world_size", 8, 8)]
    assert [(knob, value, setting["wire"]) for knob, value, setting in variants if knob == "wire"] == [
        ("wire", "bf16", "bf16")]
    assert advisor_accuracy.setting_of("world_size", 4, SimpleNamespace(world_size=2)).world_size == 4
    assert advisor_accuracy.variants_of(advisor_accuracy.parse_args([]))[0]["ranks"] is None  # loopback: every rank
    for argv, message in ((["--world-sizes", "3"], "--world-sizes needs --lab"),
                          (["--lab", "--link", "400Mbps"], "megabytes per second"),
                          (["--lab", "--world-sizes", "1"], "at least 2 hosts"),
                          (["--lab", "--network", "/no/such/bench.json"], "write one with `ddp-ring-hooks bench --json")):
        with pytest.raises(SystemExit):
            advisor_accuracy.parse_args(argv)
        assert message in capsys.readouterr().err


@pytest.mark.fast
def test_a_ring_order_reaches_the_advisor_as_any_option_does():
    """The ring's ``ring_order`` is priced like every registry option: on one tier of links every
    order of the ring costs the same (two tiers: ``cost_model.two_tier``)."""
    from ddp_ring_hooks.advisor.step_model import setting_options

    model = step_model(timeline(ready=[2.0, 20.0]))
    here = run_setting(model.profile)
    reversed_ring = replace(here, algorithm_options=(("ring_order", [1, 0]),))
    assert setting_options(model.profile, reversed_ring) == {"ring_order": (1, 0), "node_of": None, "wire_dtype": "fp32"}
    assert model.predict(reversed_ring).step_ms == pytest.approx(model.predict(here).step_ms)
    with pytest.raises(ValueError, match="ring: ring_order=\\(1, 1\\) names a rank twice"):
        model.predict(replace(here, algorithm_options=(("ring_order", (1, 1)),)))


@pytest.mark.fast
def test_a_ring_across_misplaced_nodes_is_named_with_the_order_that_fixes_it_and_its_predicted_gain():
    """The timeline records the ranks' nodes and the ring's order; the advice says what the order
    costs, priced with the run's own fit (its β already holds the run's crossings)."""
    records = timeline(ready=[2.0, 20.0])
    misplaced = dataclasses.replace(records[0], world_size=4, nodes=(0, 1, 0, 1), ring=(0, 1, 2, 3))
    advice = advise([misplaced, *records[1:]])
    note = advice["rank_order"]
    assert (note["crossings"], note["fewest"], note["busiest"], note["calibrated"]) == (4, 2, 2, True)
    # 2(p-1)α + 2(p-1)/p·nβ against the same with half the bytes through the busiest uplink:
    fitted = step_model([misplaced, *records[1:]]).run_network.calibration("ring")
    latency, transfer = 6 * fitted.alpha, 1.5 * 3 * MIB * fitted.beta
    assert note["speedup"] == pytest.approx((latency + transfer) / (latency + transfer / 2))
    assert note["line"] == (f"the ring crosses the node boundary 4 times; ring_order='hosts' would cross it 2 times: "
                            f"predicted {note['speedup']:.2g}x faster")
    assert f"ring order: {note['line']}" in format_advice(advice)
    # Placed node by node, nodes unknown, or one node: nothing to say.
    for run in (dataclasses.replace(misplaced, nodes=(0, 0, 1, 1)), dataclasses.replace(misplaced, nodes=None),
                dataclasses.replace(misplaced, nodes=(0, 0, 0, 0))):
        assert advise([run, *records[1:]])["rank_order"] is None
    # Old timelines (no nodes, no ring) still read, and say nothing.
    old = {k: v for k, v in json.loads(misplaced.to_json()).items() if k not in ("nodes", "ring")}
    assert TimelineRun.from_json(old).nodes is None
    assert TimelineRun.from_json(misplaced.to_json()) == misplaced


@pytest.mark.fast
def test_a_two_tier_network_prices_the_what_ifs_with_the_uplink_shared_by_a_nodes_ranks():
    from ddp_ring_hooks.advisor import from_two_tier
    from ddp_ring_hooks.cost_model import Links, TwoTier

    lab = TwoTier(Links(200e-6, 1 / 50e6, local=Links(50e-6, 1 / 1e9)), ranks_per_node=2)
    network = from_two_tier(lab)
    assert network.cost_ms("ring", 16 << 20, 4) == pytest.approx(1e3 * lab.predict("ring", 16 << 20, 4))
    assert network.cost_ms("hierarchical", 16 << 20, 4, local_size=2) < 0.7 * network.cost_ms("ring", 16 << 20, 4)
    records = timeline(ready=[2.0, 20.0])
    rows = advise(records, network=network)["what_if"]
    assert {r["value"] for r in rows if r["knob"] == "world_size"} == {2, 4, 6, 8, 64, 512}  # nodes of 2 fit each (not 3)
    assert "two tiers (nodes of 2 ranks)" in advise(records, network=network)["model"]["network"]["source"]


# -- the probe, wire rows, what the advice withholds (issue 31) -------------------------------------


def probe_samples(alpha_s: float, rate_Bps: float, gamma_s_per_B: float, *, spread: float = 0.0,
                  per_call_s: float | None = None):
    """A probe of the ring at p=2 on a network of exactly ``alpha``, ``1 / rate``, ``gamma``: the
    times its formula gives, each size's three blocks ``spread`` apart (fastest, median, slowest).
    With ``per_call_s``, each call also costs that, and the probe times its second message count
    (``MESSAGES_PROBE``) as the hook's probe does."""
    from ddp_ring_hooks.cost_model import Links, ProbeSample, predict
    from ddp_ring_hooks.runtime.network_probe import MESSAGES_PROBE, PROBE_SIZES, WIRE_SIZES, other_wire_size

    links = Links(alpha_s, 1.0 / rate_Bps, gamma_s_per_B, per_call=per_call_s or 0.0)
    blocks = lambda t: (t * (1 - spread), t, t * (1 + spread))  # noqa: E731
    samples = []
    bf16_sizes = [other_wire_size(n, own="fp32", other="bf16") for n in WIRE_SIZES]
    for wire, sizes in (("fp32", PROBE_SIZES), ("bf16", bf16_sizes)):
        for n in sizes:
            samples.append(ProbeSample(n, wire, blocks(predict("ring", n, 2, links=links, wire_dtype=wire))))
    if per_call_s is not None:
        counted, options = MESSAGES_PROBE
        t = predict(counted, PROBE_SIZES[0], 2, links=links, **dict(options))
        samples.append(ProbeSample(PROBE_SIZES[0], "fp32", blocks(t), counted, options))
    return tuple(samples)


@pytest.mark.fast
def test_the_probe_fit_recovers_alpha_beta_gamma_and_its_blocks_spread_is_the_error_bar():
    from ddp_ring_hooks.advisor.network import from_probe

    exact = from_probe(probe_samples(50e-6, 50e6, 1e-9), algorithm="ring", world_size=2)
    links = exact.calibration("ring")
    assert links.alpha == pytest.approx(50e-6, rel=1e-6) and links.beta == pytest.approx(1 / 50e6, rel=1e-6)
    assert links.gamma == pytest.approx(1e-9, rel=1e-6)
    assert exact.here and exact.source.startswith("probed when the hook was registered: ring at 16 KiB-4 MiB")
    noisy = from_probe(probe_samples(50e-6, 50e6, 1e-9, spread=0.2), algorithm="ring", world_size=2)
    assert noisy.calibration("ring").beta == pytest.approx(0.9 / 50e6, rel=1e-6)  # three blocks: halfway to the fastest
    fastest, slowest = (n.calibration("ring") for n in noisy.bounds)  # the error bar: the fastest and the median
    assert fastest.beta == pytest.approx(0.8 / 50e6, rel=1e-6) and slowest.beta == pytest.approx(1 / 50e6, rel=1e-6)
    # Nine blocks a size, five of them waiting out another thread's time slice (5-10x, as on
    # shared 2-core loopback at register): the median is disturbed, the lower quartile is not.
    def disturbed(t: float) -> tuple[float, ...]:
        return (t, 6 * t, 0.98 * t, 9 * t, 1.02 * t, 5 * t, t, 10 * t, 7 * t)

    found = from_probe([dataclasses.replace(s, seconds=disturbed(s.seconds[1])) for s in probe_samples(50e-6, 50e6, 1e-9)],
                       algorithm="ring", world_size=2)
    links = found.calibration("ring")
    assert links.alpha == pytest.approx(50e-6, rel=1e-6) and links.beta == pytest.approx(1 / 50e6, rel=1e-6)
    assert found.bounds[1].calibration("ring").beta == pytest.approx(5 / 50e6, rel=1e-6)  # the median: 5x
    assert "its blocks' median lay up to 410% above their fastest" in found.source and "WARNING" not in found.source
    # Every block disturbed (four ranks on two cores): 16 KiB as slow as 2 MiB, nothing left for
    # the bytes; the source says so rather than pricing them free in silence.
    flat = [dataclasses.replace(s, seconds=(5e-3,) * 3) for s in probe_samples(50e-6, 50e6, 1e-9)]
    assert "WARNING: its blocks left the bytes (beta) at 0" in from_probe(flat, algorithm="ring", world_size=2).source


@pytest.mark.fast
def test_a_second_message_count_tells_the_per_call_cost_from_the_per_message_one():
    """A call's hand-offs cost once, its messages each (loopback, 2 ranks: 0.44 ms per call, 0.18
    ms per message). The ring's probe alone spreads the call over its 2 messages and prices a
    25 MiB double binary tree (64 messages in one call) at 64 of those; with the second count
    (``MESSAGES_PROBE``) the fit finds both, and the tree costs one call and 64 messages."""
    from ddp_ring_hooks.advisor.network import bucket_cost, from_probe

    both = from_probe(probe_samples(180e-6, 50e6, 1e-9, per_call_s=440e-6), algorithm="ring", world_size=2)
    links = both.calibration("ring")
    assert links.per_call == pytest.approx(440e-6, rel=1e-6) and links.alpha == pytest.approx(180e-6, rel=1e-6)
    assert links.beta == pytest.approx(1 / 50e6, rel=1e-6) and links.gamma == pytest.approx(1e-9, rel=1e-6)
    assert "+ 440 us per call" in both.source and both.as_dict()["per_algorithm"]["*"]["per_call_us"] == pytest.approx(440)
    one_count = [s for s in probe_samples(180e-6, 50e6, 1e-9, per_call_s=440e-6) if not s.algorithm]
    spread = from_probe(one_count, algorithm="ring", world_size=2).calibration("ring")
    assert spread.per_call == 0 and spread.alpha == pytest.approx(180e-6 + 440e-6 / 2, rel=1e-6)
    tree = 25 << 20
    assert bucket_cost(both, "double_binary_tree", tree, 2).fixed_ms == pytest.approx(
        1e3 * (440e-6 + 64 * 180e-6) + 1e3 * tree * 0.5 * 1e-9, rel=1e-6)
    assert bucket_cost(from_probe(one_count, algorithm="ring", world_size=2), "double_binary_tree", tree, 2).fixed_ms \
        > 1.5 * bucket_cost(both, "double_binary_tree", tree, 2).fixed_ms
    # the ring, priced either way, costs what the probe measured: both fits agree where they were measured
    assert bucket_cost(both, "ring", 1 << 20, 2).total_ms == pytest.approx(
        bucket_cost(from_probe(one_count, algorithm="ring", world_size=2), "ring", 1 << 20, 2).total_ms, rel=1e-6)


def _probed(records, samples):
    """``records`` with the run line carrying ``samples`` as the ring's probe and an fp32 wire."""
    run = dataclasses.replace(records[0], probe=samples, probe_algorithm="ring", options=(("wire_dtype", "fp32"),))
    return [run, *records[1:]]


@pytest.mark.fast
def test_the_wire_rows_say_pays_on_a_slow_link_and_does_not_pay_where_casts_cost_more_than_the_bytes():
    """bf16 halves the bytes for two casts per byte: on a 50 MB/s link with cheap casts it pays;
    on a fast link whose casts cost more than the bytes saved it does not (loopback's case)."""
    records = timeline(ready=[20.0, 20.0])  # nothing hidden: all communication is exposed
    slow = advise(_probed(records, probe_samples(50e-6, 50e6, 0.1e-9)))
    fast = advise(_probed(records, probe_samples(50e-6, 5e9, 2e-9)))
    for advice, verdict in ((slow, "pays"), (fast, "does not pay")):
        rows = {r["value"]: r for r in advice["what_if"] if r["knob"] == "wire_dtype"}
        assert rows["bf16"]["verdict"] == verdict and not rows["bf16"]["uncertain"], rows["bf16"]
        assert rows["fp32"]["this_run"] and rows["fp32"]["speedup"] == pytest.approx(1.0)
        assert advice["model"]["network"]["source"].startswith("probed when the hook was registered")
        assert advice["model"]["reproduced_error"] == pytest.approx(0.0, abs=1e-9)  # the run's own row, exactly
    assert slow["recommendation"]["knob"] in ("wire_dtype", "accumulate")
    assert "wire_dtype (what the buckets travel in)" in format_advice(slow) and "  pays" in format_advice(slow)


def _large_blocks_slowed(samples):
    """A probe as the lab's throttled hosts read it: its small block waits 0.4 ms, its large
    blocks' bytes (fp32 and bf16 alike) run 25% slower than ``samples``."""
    from ddp_ring_hooks.runtime.network_probe import PROBE_SIZES

    def measured(s):
        if s.nbytes == PROBE_SIZES[0]:
            return dataclasses.replace(s, seconds=tuple(t + 0.4e-3 for t in s.seconds))
        return dataclasses.replace(s, seconds=tuple(2 * ALPHA_MS * 1e-3 + 1.25 * (t - 2 * ALPHA_MS * 1e-3) for t in s.seconds))

    return tuple(measured(s) for s in samples)


@pytest.mark.fast
def test_the_link_is_priced_at_the_probes_two_large_blocks_where_its_small_block_waits():
    """On the lab's throttled hosts the probe's 16 KiB blocks carry a waiting core's
    milliseconds that a long transfer hides, and α and β fitted to them read the links up to
    34% fast. On several hosts the link's price is scaled so that the difference of the probe's
    two large blocks is their bytes alone (here the small block waits 0.4 ms and the large ones'
    bytes run 25% slower than the fit says), and bf16 saves half the run's bytes at that rate.
    On an exact network the scale is 1; on one host (loopback: no wire, the cores' time) the
    probe prices the rows as it read them."""
    from ddp_ring_hooks.runtime.network_probe import PROBE_SIZES

    small, middle, largest = PROBE_SIZES
    exact = probe_samples(ALPHA_MS * 1e-3, 1e3 / BETA_MS, 0.0)
    records = _probed(timeline(ready=[20.0, 20.0]), _large_blocks_slowed(exact))
    two_hosts = [dataclasses.replace(records[0], nodes=(0, 1), local_world_size=1), *records[1:]]
    bf16 = Setting(bucket_cap_mb=None, accumulate=1, algorithm="ring", world_size=2, wire="bf16")
    model = step_model(two_hosts)
    (n1, ms1), (n2, ms2) = model.network.large_blocks
    assert (n1, n2) == (middle, largest)
    priced = [bucket_cost(model.network, "ring", n, 2).link_ms for n in (middle, largest)]
    assert model.own_link.scale * (priced[1] - priced[0]) == pytest.approx(ms2 - ms1)  # the bytes alone
    assert ms2 - ms1 == pytest.approx(1.25 * (largest - middle) * BETA_MS)
    assert model.own_link.scale > 1.1  # the fit leaned on the waiting small block; the scale takes the rest
    assert model.predict(run_setting(model.profile)).exposed_ms == pytest.approx(model.profile.exposed_ms)
    # Both buckets exposed, one lane: bf16 saves half of their bytes at the blocks' rate, less its casts.
    def priced_ms(**wire):
        costs = [bucket_cost(model.network, "ring", b.nbytes, 2, **wire) for b in model.profile.buckets]
        return sum(c.fixed_ms + model.own_link.scale * c.link_ms for c in costs)

    saved = priced_ms() - priced_ms(**with_wire({}, "bf16"))
    assert saved == pytest.approx(model.own_link.scale * sum(bucket_cost(model.network, "ring", b.nbytes, 2).link_ms
                                                             for b in model.profile.buckets) / 2, rel=0.1)
    assert model.predict(bf16).exposed_ms == pytest.approx(model.profile.exposed_ms - saved)
    assert model.own_link.backward_rate == 1.0  # nothing ran beside backward: nothing to slow
    exact_two_hosts = [dataclasses.replace(r, probe=exact) if r is two_hosts[0] else r for r in two_hosts]
    assert step_model(exact_two_hosts).own_link.scale == pytest.approx(1.0)  # an exact network is priced as fitted
    assert step_model(records).own_link.scale == 1.0  # one host


def _slowed_beside_backward(rate: float):
    """Two hosts, an exact probe, and a run whose 1 MiB bucket, handed over at 2 ms of a 3 ms
    backward, went at ``rate`` of the link's price until backward ended: its 3 MiB bucket waits
    for it, so the run's exposed time holds the slowdown."""
    records = _probed(timeline(ready=[2.0, 3.0], backward=3.0), probe_samples(ALPHA_MS * 1e-3, 1e3 / BETA_MS, 0.0))
    first, last = ring_ms(MIB) - 2 * ALPHA_MS, ring_ms(3 * MIB)  # the first's link part, the last's whole
    done = (3.0 - 2.0 - 2 * ALPHA_MS) * rate  # of the first's link part by backward's end
    first_end = 2.0 + 2 * ALPHA_MS + first / rate if first <= done else 3.0 + first - done
    steps = []
    for step in records[1:]:
        b0, b1 = step.buckets
        b0 = dataclasses.replace(b0, end_ms=first_end)
        b1 = dataclasses.replace(b1, start_ms=first_end, end_ms=first_end + last)
        exposed = b1.end_ms - 3.0
        steps.append(dataclasses.replace(step, buckets=(b0, b1), exposed_ms=exposed,
                                         step_ms=step.step_ms - step.exposed_ms + exposed))
    return [dataclasses.replace(records[0], nodes=(0, 1), local_world_size=1), *steps]


@pytest.mark.fast
def test_the_exchanges_slowed_beside_backward_are_found_on_the_run_and_spare_what_runs_after_it():
    """The run's own exposed time, beyond its network's price, is priced as its exchanges' rate
    beside backward (found by bisection on the run): the run's own row is exact, a 4 MiB bucket
    alone after backward (cap 100) costs the link's price, and a tree's one-way halves are not
    slowed. Before, the run's link time scaled every byte: cap 100 and the tree read 10-50% slow
    on the lab (``docs/advisor.md``, the tenth series)."""
    for rate in (0.5, 0.25):
        model = step_model(_slowed_beside_backward(rate))
        assert model.own_link.scale == pytest.approx(1.0) and model.own_link.backward_rate == pytest.approx(rate, rel=1e-4)
        assert model.predict(run_setting(model.profile)).step_ms == pytest.approx(model.profile.step_ms)
        alone = model.predict(Setting(bucket_cap_mb=100, accumulate=1, algorithm="ring", world_size=2))
        assert alone.exposed_ms == pytest.approx(ring_ms(4 * MIB), rel=1e-4)
    tree = model.predict(Setting(bucket_cap_mb=None, accumulate=1, algorithm="tree", world_size=2))
    unslowed = replay([2.0, 3.0], [bucket_cost(model.network, "tree", n, 2) for n in (MIB, 3 * MIB)], lanes=1,
                      backward_ms=3.0)
    assert tree.exposed_ms == pytest.approx(unslowed.exposed_ms, rel=1e-4)
    # said in the advice (the --json shape's model.own_link, and a note); another cluster's network is taken as given
    advice = advise(_slowed_beside_backward(0.5))
    assert json.loads(json.dumps(advice))["model"]["own_link"]["backward_rate"] == pytest.approx(0.5, rel=1e-4)
    assert any("its exchanges beside backward at 50% of the link's rate" in note for note in advice["model"]["notes"])
    given = advise(_slowed_beside_backward(0.5), network=from_latency_bandwidth(latency_s=1e-4, bandwidth_Bps=1e9))
    assert given["model"]["own_link"] is None and not any("this run's link" in n for n in given["model"]["notes"])
    # on one host there is no wire to calibrate: the rate stays 1
    one_host = [dataclasses.replace(_slowed_beside_backward(0.5)[0], nodes=(0, 0), local_world_size=2),
                *_slowed_beside_backward(0.5)[1:]]
    assert step_model(one_host).own_link.backward_rate == 1.0


@pytest.mark.fast
def test_a_buckets_pickup_is_its_wait_from_hand_over_to_start_on_a_free_lane():
    """The worker's wake-up: measured where the bucket's lane was free (a queue behind the bucket
    before it on its lane is the replay's own), and added to every bucket's start."""
    records = timeline(ready=[2.0, 20.0], lanes=1)
    late = [records[0], *(dataclasses.replace(step, buckets=tuple(
        dataclasses.replace(b, start_ms=b.start_ms + 0.7, end_ms=b.end_ms + 0.7) for b in step.buckets))
        for step in records[1:])]
    assert step_model(records).profile.pickup_ms == 0.0 and step_model(late).profile.pickup_ms == pytest.approx(0.7)
    queued = timeline(ready=[0.0, 0.5], lanes=1)  # the second waits for the first on its lane: not a pickup
    assert step_model(queued).profile.pickup_ms == 0.0


@pytest.mark.fast
def test_on_one_host_the_two_ways_are_one_resource():
    """On loopback the same cores copy both ways: a tree's one-way halves each have the whole
    resource, so at p=2 it costs what the ring costs (measured 0.93-1.14x), where ranks on two
    hosts (full duplex) pay the tree's 2n·β against the ring's n·β."""
    tree = BucketCost(0.0, 8.0, ((IN, 0.5), (OUT, 0.5)))
    ring = BucketCost(0.0, 4.0)
    for lanes in (1, 2):
        shared = replay([0.0] * 3, [tree] * 3, lanes=lanes, backward_ms=0.0, shared_ways=2.0)
        assert shared.ends == replay([0.0] * 3, [ring] * 3, lanes=lanes, backward_ms=0.0, shared_ways=2.0).ends
        assert shared.ends[-1] == pytest.approx(12.0)
    records = _probed(timeline(ready=[20.0, 20.0]), probe_samples(ALPHA_MS * 1e-3, 1e3 / BETA_MS, 0.0))
    two_hosts = [dataclasses.replace(records[0], nodes=(0, 1), local_world_size=1), *records[1:]]
    exposed = {}
    for where, run in (("one host", records), ("two hosts", two_hosts)):
        model = step_model(run)
        assert model.profile.one_host == (where == "one host")
        exposed[where] = {a: model.predict(Setting(bucket_cap_mb=None, accumulate=1, algorithm=a, world_size=2)).exposed_ms
                          for a in ("ring", "tree")}
    assert exposed["one host"]["tree"] == pytest.approx(exposed["one host"]["ring"])
    assert exposed["two hosts"]["tree"] - exposed["two hosts"]["ring"] == pytest.approx(4 * MIB * BETA_MS, rel=1e-6)


def _link_scattered(records, factors):
    """``records`` whose steps' buckets took ``factors`` times as long, step by step (their
    link busy time scatters; the medians stay those of the steps at 1), on two hosts."""
    steps = [dataclasses.replace(step, buckets=tuple(
        dataclasses.replace(b, end_ms=b.start_ms + f * (b.end_ms - b.start_ms)) for b in step.buckets))
        for step, f in zip(records[1:], factors)]
    return [dataclasses.replace(records[0], nodes=(0, 1), local_world_size=1), *steps]


@pytest.mark.fast
@pytest.mark.parametrize("where", ["one host", "two hosts"])
def test_a_row_whose_error_bar_is_wider_than_its_gain_says_so_and_is_not_recommended(where):
    """The error bar: the network at the probe's fastest and median blocks (on one host, as the
    probe read them); on two hosts each also scaled to the run's fastest and slowest step on its
    link (the run measures its own wire's rate), so there the run's scatter makes it wide."""
    if where == "two hosts":
        records, spread = _link_scattered(timeline(ready=[20.0, 20.0], steps=5), (1.0, 0.2, 1.0, 3.0, 1.0)), 0.6
    else:  # buckets at half the probe's 50 MB/s (a probe slower than them was slowed: slowed_probe_scale),
        # the first one hidden: a probe's scatter alone makes the bar, wide around its small gains
        records, spread = timeline(ready=[2.0, 20.0], steps=5, beta=2 * 1e3 / 50e6), 0.9
    advice = advise(_probed(records, probe_samples(50e-6, 50e6, 0.1e-9, spread=spread)))
    uncertain = [r for r in advice["what_if"] if r["uncertain"]]
    assert uncertain and all(could_go_either_way(r["speedup_range"], r["speedup"]) for r in uncertain)
    assert not [r for r in advice["what_if"] if not r["uncertain"] and not r["this_run"] and r["speedup_range"]
                and could_go_either_way(r["speedup_range"], r["speedup"])]
    assert (advice["recommendation"]["knob"], advice["recommendation"]["value"]) not in {(r["knob"], r["value"]) for r in uncertain}
    assert "(uncertain: its error bar is wider than its gain or reaches past no change)" in format_advice(advice)


@pytest.mark.fast
def test_a_probe_slower_than_the_runs_own_largest_bucket_on_one_host_is_scaled_down_to_it():
    """On one host a bucket in training shares the cores with backward, so it takes at least
    the probe's price of it: a probe that prices it slower was slowed as a whole (loopback run
    3 of the tenth series: a 5 MiB bucket that took 3.2 ms priced at 5.2), and every cost is
    scaled until that bucket costs what it took. A probe no slower, or ranks on two hosts, keep
    theirs."""
    from ddp_ring_hooks.advisor.network import from_probe
    from ddp_ring_hooks.advisor.step_model import slowed_probe_scale

    records = timeline(ready=[20.0, 20.0])  # buckets at 1 GB/s
    slowed = step_model(_probed(records, probe_samples(50e-6, 50e6, 1e-9)))  # a probe at 50 MB/s
    p = slowed.profile
    largest = max(p.buckets, key=lambda b: b.nbytes)
    assert largest.nbytes == 3 * MIB and slowed.network.cost_ms("ring", largest.nbytes, 2) == pytest.approx(ring_ms(3 * MIB))
    raw = from_probe(p.probe, algorithm="ring", world_size=2)
    scale = ring_ms(3 * MIB) / raw.cost_ms("ring", largest.nbytes, 2)
    links, scaled_links = raw.calibration("ring"), slowed.network.calibration("ring")
    assert scale < 0.1 and all(getattr(scaled_links, k) == pytest.approx(scale * getattr(links, k))
                               for k in ("alpha", "beta", "gamma", "per_call"))
    assert slowed.network.bounds[0].calibration("ring").beta == pytest.approx(scale * raw.bounds[0].calibration("ring").beta)
    assert f"every cost scaled by {scale:.2f}" in slowed.network.source
    assert f"every cost scaled by {scale:.2f}" in advise(_probed(records, probe_samples(50e-6, 50e6, 1e-9)))["model"]["network"]["source"]
    # a probe as fast as the buckets, or faster: as it read
    for rate in (1e9, 2e9):
        kept = step_model(_probed(records, probe_samples(ALPHA_MS * 1e-3, rate, 0.0)))
        assert slowed_probe_scale(kept.profile, kept.network) == 1.0 and "scaled" not in kept.network.source
    # two hosts: the link's own rate comes from the probe's large blocks (link_scale), not this
    two_hosts = [dataclasses.replace(records[0], nodes=(0, 1), local_world_size=1), *records[1:]]
    assert "scaled" not in step_model(_probed(two_hosts, probe_samples(50e-6, 50e6, 1e-9))).network.source


@pytest.mark.fast
def test_a_gain_whose_lopsided_error_bar_reaches_a_loss_is_uncertain():
    """A range of 0.98-1.07x around 1.07x: half its width (0.05) is under the gain, but the
    slowest network the probe allows makes the change a loss (bf16 on loopback, measured no
    gain: the ninth series). It is uncertain, its verdict unreliable, and it is not recommended."""
    assert could_go_either_way([0.976, 1.071], 1.069)
    assert could_go_either_way([0.93, 1.01], 0.935)  # a loss that could be a gain
    assert not could_go_either_way([1.04, 1.09], 1.07)  # a gain at both ends
    assert not could_go_either_way([0.80, 0.86], 0.80)  # a loss at both ends
    assert could_go_either_way([0.99, 1.03], 1.01)  # wider than the gain, as before


@pytest.mark.fast
def test_a_run_the_model_cannot_reproduce_says_by_how_much_and_gets_no_recommendation():
    """Buckets that end before backward does with a k=2 no_sync micro-batch slower than forward
    and backward together: the clocks disagree (exposed < 0), the model clamps, and misses the step."""
    advice = advise(timeline(ready=[0.0, 1.0], lanes=2, other_cpu=19.0, cpu_count=2, k=2, micro=25.0))
    assert abs(advice["model"]["reproduced_error"]) > 0.02
    assert advice["recommendation"]["knob"] is None
    assert "reproduces this run's own step only within +37.0%" in advice["recommendation"]["why"]


@pytest.mark.fast
def test_a_network_far_from_the_runs_own_buckets_is_named_as_another_network():
    records = timeline(ready=[20.0, 20.0])
    other = advise(records, network=from_latency_bandwidth(latency_s=5e-6, bandwidth_Bps=100e9))
    assert any("describes another network" in note for note in other["model"]["notes"])
    close = advise(records, network=from_latency_bandwidth(latency_s=ALPHA_MS * 1e-3, bandwidth_Bps=1e3 / BETA_MS))
    assert not any("describes another network" in note for note in close["model"]["notes"])


@pytest.mark.fast
def test_network_probe_takes_true_or_false():
    from ddp_ring_hooks.hooks.options import check_register_options

    check_register_options(network_probe=False)
    check_register_options(network_probe=None)
    with pytest.raises(ValueError, match="network_probe must be None .* True .* or False .*got 'no'"):
        check_register_options(network_probe="no")


@pytest.mark.fast
def test_exposed_never_exceeds_communication_in_any_row_and_the_runs_own_row_reads_as_measured():
    """Both timed from the hand-over: communication is hidden + exposed (the queue included)."""
    cases = [timeline(ready=[2.0, 20.0]), timeline(ready=[19.0, 20.0]), timeline(ready=[2.0, 20.0], lanes=2),
             timeline(ready=[20.0, 20.0], k=2, micro=31.0), _probed(timeline(ready=[2.0, 20.0]), probe_samples(50e-6, 50e6, 1e-9))]
    for records in cases:
        advice = advise(records)
        run = advice["run"]
        assert run["exposed_ms"] <= run["comm_ms"] + 1e-9, run
        for row in advice["what_if"]:
            assert row["exposed_ms"] <= row["comm_ms"] + 1e-9, row
            if row["this_run"]:
                assert row["comm_ms"] == pytest.approx(run["comm_ms"]) and row["step_ms"] == pytest.approx(run["step_ms"])


@pytest.mark.fast
def test_a_timeline_that_mixes_runs_of_another_world_size_is_refused_by_advise_itself(tmp_path, capsys):
    """Two runs in one file (a log_dir's timeline joined with another's): the steps are not of
    one world size, so advise says so (the CLI too), instead of pricing them all at the first's."""
    from ddp_ring_hooks.cli.__main__ import main

    two, four = timeline(ready=[2.0, 20.0]), timeline(ready=[2.0, 20.0])
    four = [dataclasses.replace(four[0], world_size=4), *four[1:]]
    with pytest.raises(ValueError, match="mixes runs: record 6 starts a run of 4 ranks \\(ring\\) after one of 2 ranks"):
        advise([*two, *four])
    other_cap = [dataclasses.replace(two[0], bucket_cap_bytes=MIB), *two[1:]]
    with pytest.raises(ValueError, match="mixes runs: record 6 starts a second run \\(ring, cap 1048576 B"):
        advise([*two, *other_cap])
    path = tmp_path / "timeline.jsonl"
    path.write_text("".join(r.to_json() + "\n" for r in [*two, *four]))
    assert main(["advise", str(tmp_path)]) == 2
    assert "mixes runs: record 6 starts a run of 4 ranks" in capsys.readouterr().err


@pytest.mark.fast
def test_the_world_size_table_has_3_4_6_and_8_from_a_two_rank_run():
    rows = advise(timeline(ready=[2.0, 20.0]))["what_if"]
    sizes = [r["value"] for r in rows if r["knob"] == "world_size"]
    assert sizes == [2, 3, 4, 6, 8, 64, 512]
    by_size = {r["value"]: r["step_ms"] for r in rows if r["knob"] == "world_size"}
    assert by_size[2] < by_size[3] < by_size[4] < by_size[6] < by_size[8]  # the ring's 2(p-1) messages and bytes grow
    assert "6" in format_advice(advise(timeline(ready=[2.0, 20.0]))).split("world size (same micro-batch per rank)")[1].split("\n")[6]


@pytest.mark.fast
def test_a_bench_of_another_world_size_is_named_and_one_of_the_runs_own_is_preferred(tmp_path, capsys):
    from ddp_ring_hooks.cli.__main__ import main

    def records_at(p, alpha_us):
        return [{"algorithm": "ring", "world_size": p, "nbytes": n, "time_us": 2 * (p - 1) * alpha_us + n * 1e-3 * (p - 1) / p,
                 "count": n // 4, "dtype": "float32"} for n in (1 << 12, 1 << 16, 1 << 20, 1 << 22)]

    run = timeline(ready=[2.0, 20.0])
    four = from_bench(records_at(4, 80.0))
    assert four.measured_at == 4 and "at 4 ranks" in four.source
    notes = advise(run, network=four)["model"]["notes"]
    assert any("measured at 4 ranks and this run at 2" in n and "--nproc_per_node=2" in n for n in notes), notes
    both = from_bench([*records_at(4, 80.0), *records_at(2, 100.0)], world_size=2)
    assert both.measured_at == 2 and not any("measured at" in n for n in advise(run, network=both)["model"]["notes"])
    assert from_bench([*records_at(4, 80.0), *records_at(2, 100.0)]).measured_at == 4  # the run unknown: the largest
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(records_at(4, 80.0)))
    (tmp_path / "timeline.jsonl").write_text("".join(r.to_json() + "\n" for r in run))
    assert main(["advise", str(tmp_path), "--network", str(bench)]) == 0
    assert "note: the network given was measured at 4 ranks and this run at 2" in capsys.readouterr().out
    bench.write_text(json.dumps([*records_at(4, 80.0), *records_at(2, 100.0)]))
    assert main(["advise", str(tmp_path), "--network", str(bench), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["network"]["source"].startswith("bench records at 2 ranks")


@pytest.mark.fast
def test_two_tiers_predicted_from_a_one_tier_run_put_its_own_network_on_each_uplink(tmp_path, capsys):
    """``advise --placement 2`` without --latency/--bandwidth: the uplink is the network the run
    probed (its buckets' 1 GB/s and 100 us), shared by a node's 2 ranks; inside a node 10 GB/s.
    2 ranks on one node use only the fast links inside it; 4 ranks in nodes of 2 cost the ring what
    4 separate hosts cost (in node order it crosses each uplink once each way: the slowest link is
    the same), and 3 ranks fit no nodes of 2."""
    from ddp_ring_hooks.cli.__main__ import main

    records = _probed(timeline(ready=[20.0, 20.0]), probe_samples(ALPHA_MS * 1e-3, 1e3 / BETA_MS, 0.0))
    (tmp_path / "timeline.jsonl").write_text("".join(r.to_json() + "\n" for r in records))
    assert main(["advise", str(tmp_path), "--json"]) == 0
    one_tier = json.loads(capsys.readouterr().out)
    assert main(["advise", str(tmp_path), "--placement", "2", "--local-bandwidth", "10GB/s", "--json"]) == 0
    two_tier = json.loads(capsys.readouterr().out)
    source = two_tier["model"]["network"]["source"]
    assert source.startswith("two tiers (nodes of 2 ranks): uplink latency 100 us, 1 GB/s; inside a node 100 us, 10 GB/s"), source
    assert "the uplink is this run's own network (probed when the hook was registered)" in source
    rows = {tier: {r["value"]: r["step_ms"] for r in advice["what_if"] if r["knob"] == "world_size"}
            for tier, advice in (("one", one_tier), ("two", two_tier))}
    assert 3 not in rows["two"] and rows["two"][4] == pytest.approx(rows["one"][4], rel=1e-6), rows
    assert rows["two"][2] < 0.95 * rows["one"][2], rows  # 2 ranks on one node: only the fast inside links
    assert main(["advise", str(tmp_path), "--placement", "2", "--latency", "5us"]) == 2  # half a network: refused
    assert "--latency and --bandwidth go together" in capsys.readouterr().err


@pytest.mark.fast
def test_two_tiers_from_a_one_tier_run_are_calibrated_on_the_network_they_were_laid_out_from(tmp_path, capsys):
    """The offset that makes the run's own setting exact is what the probe's network leaves
    unexplained, not what the run's bucket fit does: a layout that costs the ring what one tier
    costs (each rank a node of its own) predicts the run's own step. Calibrated on the bucket
    fit (here 4 times the probe's price), the lab's runs read +52% and +59% (nodes of 2 at p = 4)."""
    from ddp_ring_hooks.cli.__main__ import main

    records = _probed(timeline(ready=[2.0, 20.0], beta=4 * BETA_MS), probe_samples(ALPHA_MS * 1e-3, 1e3 / BETA_MS, 0.0))
    (tmp_path / "timeline.jsonl").write_text("".join(r.to_json() + "\n" for r in records))
    assert main(["advise", str(tmp_path), "--placement", "0,1", "--json"]) == 0
    advice = json.loads(capsys.readouterr().out)
    own = next(r for r in advice["what_if"] if r["knob"] == "world_size" and r["this_run"])
    assert own["step_ms"] == pytest.approx(records[1].step_ms, rel=0.02), own


@pytest.mark.fast
def test_two_tiers_laid_out_from_a_runs_probe_keep_its_own_link(tmp_path, capsys):
    """Two tiers laid out from a run's probe are the run's own links, placed: priced at the
    rate of the probe's two large blocks (here 25% slower than its fit), as one tier is. Each
    rank a node of its own (``--placement 0,1``) is one tier again: every row reads as one
    tier's. Priced at the fit instead, the lab's alternating nodes read -9% and -10%."""
    from ddp_ring_hooks.cli.__main__ import main

    records = _probed(timeline(ready=[2.0, 20.0]), _large_blocks_slowed(probe_samples(ALPHA_MS * 1e-3, 1e3 / BETA_MS, 0.0)))
    two_hosts = [dataclasses.replace(records[0], nodes=(0, 1), local_world_size=1), *records[1:]]
    (tmp_path / "timeline.jsonl").write_text("".join(r.to_json() + "\n" for r in two_hosts))
    assert main(["advise", str(tmp_path), "--json"]) == 0
    one_tier = json.loads(capsys.readouterr().out)
    assert main(["advise", str(tmp_path), "--placement", "0,1", "--json"]) == 0
    placed = json.loads(capsys.readouterr().out)
    assert placed["model"]["own_link"] == one_tier["model"]["own_link"] and one_tier["model"]["own_link"]["scale"] > 1.1
    alone = {(r["knob"], r["value"]): r["step_ms"] for r in one_tier["what_if"]}
    rows = {(r["knob"], r["value"]): r["step_ms"] for r in placed["what_if"] if r["knob"] != "world_size"}
    assert len(rows) > 15  # (a node per rank has a shape for 2 ranks only: no other world size)
    assert rows == pytest.approx({row: alone[row] for row in rows}, rel=1e-6)


# -- the wait for the latest rank (advisor/latest_rank.py) ----------------------------------------


def _arrivals(lateness_ms: list[float], first_step: int = 1):
    """Arrivals of 2 ranks: in each step rank 1 hands its last bucket over ``d`` ms after rank 0."""
    from ddp_ring_hooks.telemetry.timeline_records import TimelineArrivals

    return [TimelineArrivals(step=first_step + i, last_ms=(0.0, d)) for i, d in enumerate(lateness_ms)]


@pytest.mark.fast
def test_the_latest_of_p_normal_draws_has_its_closed_forms_and_two_ranks_differences_scale_to_one_ranks_lateness():
    from ddp_ring_hooks.advisor.latest_rank import (
        NORMAL_MEDIAN_DISTANCE, arrival_lateness, expected_latest_of_normals, lateness_scale_ms, latest_rank_wait_ms,
    )

    e = expected_latest_of_normals
    # The closed forms for 1 to 4 draws; then it grows like sqrt(2 ln p), never past it.
    assert e(1) == pytest.approx(0.0, abs=1e-9)
    assert e(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-9)
    assert e(3) == pytest.approx(3 / (2 * math.sqrt(math.pi)), rel=1e-9)
    assert e(4) == pytest.approx(3 / math.sqrt(math.pi) * (0.5 + math.asin(1 / 3) / math.pi), rel=1e-9)
    assert e(4) < e(8) < e(64) < e(512) < math.sqrt(2 * math.log(512))
    for bad in (0, -2, 2.5):
        with pytest.raises(ValueError, match="ranks must be a whole number of at least 1"):
            e(bad)
    # Draws -a and +a: each a from 0, so sigma is a over a normal's median distance.
    a = 7.0
    sigma = a / NORMAL_MEDIAN_DISTANCE
    assert NORMAL_MEDIAN_DISTANCE == pytest.approx(0.6745, abs=1e-4)
    assert lateness_scale_ms([-a, a]) == pytest.approx(sigma)
    assert latest_rank_wait_ms([-a, a], 8, 2) == pytest.approx(sigma * (e(8) - e(2)))
    assert latest_rank_wait_ms([-a, a], 2, 2) == 0.0 and latest_rank_wait_ms(None, 8, 2) == 0.0
    assert latest_rank_wait_ms([-a, a], 1, 2) == pytest.approx(-sigma * e(2))  # one rank waits for nobody
    # Two ranks apart by d: each is d/2 from their mean, which moves with them; one rank's own
    # lateness scatters by sqrt(2) more: d/sqrt(2).
    d = 10.0
    lateness = arrival_lateness(_arrivals([d, -d, d, d]), world_size=2, first_step=1)
    assert lateness == pytest.approx(sorted([d / 2 ** 0.5, -d / 2 ** 0.5] * 4))
    # The steps before the measured ones, a step with a rank unknown (NaN) or of another group
    # size are left out; fewer than three steps price nothing.
    from ddp_ring_hooks.telemetry.timeline_records import TimelineArrivals

    mixed = [*_arrivals([d, d, d], first_step=2), TimelineArrivals(step=9, last_ms=(0.0, float("nan"))),
             TimelineArrivals(step=10, last_ms=(0.0, 1.0, 2.0)), *_arrivals([100.0])]
    assert len(arrival_lateness(mixed, world_size=2, first_step=2)) == 6
    assert arrival_lateness(mixed[:2], world_size=2, first_step=2) is None
    assert arrival_lateness(_arrivals([d] * 5), world_size=1, first_step=1) is None


@pytest.mark.fast
def test_one_stalled_step_among_a_dozen_barely_moves_the_wait_of_a_larger_world():
    """A lab run (the fourteenth series) had one rank stalled 652 ms in one of its 13 gathered
    steps; priced over the draws as they were, that step alone put +132 ms on 8 ranks. The
    median that sigma is read from moves by one draw's rank, not its size."""
    from ddp_ring_hooks.advisor.latest_rank import arrival_lateness, latest_rank_wait_ms

    dozen = [11.7, -7.4, 7.1, -1.7, 28.8, -6.2, 1.7, -1.6, 6.8, -8.0, 8.2, -7.2]  # a quiet lab run's differences
    quiet = arrival_lateness(_arrivals(dozen), world_size=2, first_step=1)
    stalled = arrival_lateness(_arrivals([*dozen, 652.0]), world_size=2, first_step=1)
    assert 0 < latest_rank_wait_ms(quiet, 8, 2) < latest_rank_wait_ms(stalled, 8, 2) < 1.2 * latest_rank_wait_ms(quiet, 8, 2)


@pytest.mark.fast
def test_a_larger_world_waits_for_its_latest_rank_in_the_world_size_rows_only():
    """With the run's arrivals, every world-size row's exposed time (and step) moves by the
    closed form's difference over the same run without them; the run's own row and every other
    knob stay as they were; the advice names the term, and says when it is not priced."""
    from ddp_ring_hooks.advisor.latest_rank import NORMAL_MEDIAN_DISTANCE, expected_latest_of_normals

    plain = timeline(ready=[2.0, 20.0], steps=6)
    d = 12.0
    gathered = [*plain, *_arrivals([d, -d, d, -d, d, -d], first_step=2)]
    with_wait, without = advise(gathered), advise(plain)
    lateness = d / 2 ** 0.5
    sigma = lateness / NORMAL_MEDIAN_DISTANCE
    for row, base in zip(with_wait["what_if"], without["what_if"]):
        assert (row["knob"], row["value"]) == (base["knob"], base["value"])
        if row["knob"] == "world_size":
            wait = sigma * (expected_latest_of_normals(row["value"]) - expected_latest_of_normals(2))
            assert row["exposed_ms"] - base["exposed_ms"] == pytest.approx(wait, abs=1e-9)
            assert row["step_ms"] - base["step_ms"] == pytest.approx(wait, abs=1e-9)
        else:
            assert row["step_ms"] == pytest.approx(base["step_ms"]), row
    assert with_wait["model"]["reproduced_error"] == pytest.approx(0.0, abs=1e-12)
    found = json.loads(json.dumps(with_wait))["model"]["latest_rank"]
    assert found["samples"] == 12 and found["latest_seen_ms"] == pytest.approx(lateness)
    assert found["scale_ms"] == pytest.approx(sigma)
    assert {"world_size": 8, "wait_ms": pytest.approx(sigma * (expected_latest_of_normals(8) - expected_latest_of_normals(2)))} \
        in found["waits"]
    assert any("the wait for the latest rank, from 6 steps' arrivals of this run's 2 ranks" in n
               for n in with_wait["model"]["notes"])
    assert without["model"]["latest_rank"] is None
    assert any("the wait for the latest of more ranks is not priced" in n and "diagnose=True" in n
               for n in without["model"]["notes"])
