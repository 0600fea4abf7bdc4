"""``wire_dtype``: fewer bytes on the wire, on real gloo ranks, for every algorithm.

The bound (``docs/compression.md``): each partial sum of ``x_r / p`` is rounded once to the
wire dtype when it is sent and the result once more, so a chain of ``k`` ranks rounds ``k``
times; no schedule's chain is longer than ``p``, and each rounded value is at most
``Σ_r |x_r| / p``. So every element is within ``p · u_wire · Σ_r |x_r| / p`` (``u_wire``: the wire
dtype's unit roundoff, 2^-8 for bf16, 2^-11 for fp16) of the exact average, plus the fp32 bound
of the additions themselves. The residuals the executor keeps for error feedback are checked
against the same exact sum: the result plus every rank's residual is the exact average to fp32
accuracy (they are what the roundings lost, all of it).
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist

from ddp_ring_hooks.runtime.wire import bucket_bytes, wire_dtype_for
from ddp_ring_hooks.schedules import resolve_options
from tests._dist import run_ranks
from tests.conftest import UNIT_ROUNDOFF, algorithm_cases, digest, rank_input

WIRES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: Element counts: one, a few more than the ranks, many slices (with SLICE), one slice of a large prime.
SLICE = 256  # bytes: 1009 fp32 elements become several pipelined slices


def _counts(world_size: int) -> tuple[tuple[int, int | None], ...]:
    return ((1, None), (world_size + 1, None), (1009, SLICE), (100_003, None))


def _magnitude(inputs: list[torch.Tensor], world_size: int) -> torch.Tensor:
    """``Σ_r |x_r| / p`` per element: what no partial sum of the average exceeds."""
    return torch.stack([x.double().abs() / world_size for x in inputs]).sum(0)


#: Roundings on the longest chain: ``p`` for the schedules; PyTorch's way (native) also rounds
#: the cast and the division in the wire dtype before gloo's ``p - 1`` hops.
def _roundings(name: str, world_size: int) -> int:
    return world_size + 1 if name == "native" else world_size


def every_algorithm_on_every_wire(rank: int, world_size: int) -> dict:
    """Each schedule (and native) on each narrower wire, averaging as the hook does."""
    from ddp_ring_hooks import all_reduce
    from ddp_ring_hooks.runtime import run_schedule
    from ddp_ring_hooks.runtime.native import run_native
    from ddp_ring_hooks.schedules import checked_schedule

    torch.set_num_threads(1)
    report = {}
    for name, options in [*algorithm_cases(world_size), ("native", {})]:
        for wire_name, wire in WIRES.items():
            for numel, slice_bytes in _counts(world_size):
                inputs = [rank_input(r, numel, torch.float32) for r in range(world_size)]
                mine, residual = inputs[rank].clone(), torch.full((numel,), float("nan"))
                if name == "native":
                    run_native(mine, average=True, wire=wire, residual=residual).wait()
                else:
                    schedule = checked_schedule(name, world_size, wire_dtype=wire_name, **options)
                    run_schedule(schedule, mine, divisor=world_size, slice_bytes=slice_bytes, residual=residual)
                exact = torch.stack([x.double() / world_size for x in inputs]).sum(0)
                magnitude = _magnitude(inputs, world_size)
                bound = _roundings(name, world_size) * (UNIT_ROUNDOFF[wire] + 2 * UNIT_ROUNDOFF[torch.float32]) * magnitude
                residuals = [torch.empty(numel) for _ in range(world_size)]
                dist.all_gather(residuals, residual)
                accounted = mine.double() + torch.stack([r.double() for r in residuals]).sum(0)
                # Left over: only fp32's own roundings of the additions (each residual is exact).
                fp32_bound = 4 * world_size * UNIT_ROUNDOFF[torch.float32] * magnitude
                report[(name, repr(options), wire_name, numel)] = {
                    "digest": digest(mine),
                    "error": float(((mine.double() - exact).abs() / bound).max()),
                    "on_the_wire": bool((mine.to(wire).to(torch.float32) == mine).all()),  # every rank decodes wire values
                    "accounted": float(((accounted - exact).abs() / fp32_bound).max()),
                    "residual_finite": bool(residual.isfinite().all()),
                }
    # all_reduce's door, as a sum: a bf16 tensor on a bf16 wire travels as it is (the same bits
    # as the default), and an fp16 sum is guarded by nothing (only averages divide first).
    for name in ("ring", "native"):
        halves = rank_input(rank, 1000, torch.bfloat16)
        as_is, default = halves.clone(), halves.clone()
        all_reduce(as_is, algorithm=name, wire_dtype="bf16")
        all_reduce(default, algorithm=name)
        report[(name, "bf16 bucket")] = as_is.equal(default)
    # fp16's guard: an average whose addends overflow fp16 before the division (rank 0 sends
    # 100000, which fp16 cannot hold) stays finite when the schedule divides first in fp32;
    # PyTorch's order (native: cast, then divide) overflows.
    large = torch.full((8,), 100_000.0 if rank == 0 else 0.0)
    guarded, pytorch_order = large.clone(), large.clone()
    run_schedule(checked_schedule("ring", world_size, wire_dtype="fp16"), guarded, divisor=world_size)
    run_native(pytorch_order, average=True, wire=torch.float16).wait()
    report["fp16 guard"] = (guarded.tolist(), pytorch_order.isinf().all().item())
    return report


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_algorithm_and_wire_is_bit_identical_across_ranks_and_within_its_bound(world_size):
    reports = run_ranks(every_algorithm_on_every_wire, world_size, timeout=300)
    cases = [case for case in reports[0] if isinstance(case, tuple) and len(case) == 4]
    assert {case[0] for case in cases} >= {"ring", "tree", "naive", "halving_doubling", "double_binary_tree", "native"}
    for case in cases:
        found = reports[0][case]
        assert len({report[case]["digest"] for report in reports}) == 1, f"{case}: ranks differ bit-wise"
        assert found["error"] <= 1.0, f"{case}: off by {found['error']:.2f} x the documented bound"
        assert found["on_the_wire"], f"{case}: the result holds values the wire cannot carry"
        assert found["residual_finite"], f"{case}: a residual was left unwritten"
        if case[0] != "native":  # native keeps only its own cast's loss; gloo's hops are not seen
            assert found["accounted"] <= 1.0, f"{case}: result + residuals is not the exact sum ({found['accounted']:.2f})"
    assert reports[0][("ring", "bf16 bucket")] and reports[0][("native", "bf16 bucket")]
    guarded, pytorch_overflowed = reports[0]["fp16 guard"]
    assert guarded == [pytest.approx(100_000.0 / world_size, rel=1e-3)] * 8 and pytorch_overflowed


def native_and_pytorch_hooks_under_ddp(rank: int, world_size: int, directory: str) -> dict:
    """DDP steps with ``native`` on a narrower wire and with PyTorch's own compress hooks; ring
    on bf16 with error feedback, timed into TensorBoard and a trace."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook, fp16_compress_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddp_ring_hooks
    from ddp_ring_hooks.hooks.foreign import registrable
    from tests.conftest import Net, sgd_steps

    torch.set_num_threads(1)

    def trained(hook_setup, steps=3):
        torch.manual_seed(0)
        model = DDP(Net(), bucket_cap_mb=0.01)  # several buckets, rebuilt after the first step
        state = hook_setup(model)
        return [digest(p) for p in sgd_steps(model, rank, steps)], state

    results = {}
    for wire, theirs in (("bf16", registrable(bf16_compress_hook)), ("fp16", fp16_compress_hook)):
        ours, state = trained(lambda m: ddp_ring_hooks.register(m, algorithm="native", wire_dtype=wire))
        state.close()
        reference, _ = trained(lambda m: m.register_comm_hook(None, theirs))
        results[f"native {wire} == pytorch"] = ours == reference
    ring, state = trained(lambda m: ddp_ring_hooks.register(
        m, wire_dtype="bf16", error_feedback=True, log_dir=f"{directory}/ring_bf16", trace_steps=(2, 3)))
    results["ring digests"] = ring
    results["summary"] = state.summary()
    results["feedback_bytes"] = state.plan.feedback.nbytes
    results["gradient_bytes"] = sum(p.numel() * 4 for p in Net().parameters())
    state.close()
    return results


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("wire")
    return directory, run_ranks(native_and_pytorch_hooks_under_ddp, 3, str(directory), timeout=240)


def test_native_on_a_narrower_wire_is_pytorchs_compress_hook_bit_for_bit(ddp_runs):
    _, results = ddp_runs
    for found in results:
        assert found["native bf16 == pytorch"] and found["native fp16 == pytorch"]


def test_ring_on_bf16_with_error_feedback_trains_identically_on_every_rank(ddp_runs):
    _, results = ddp_runs
    assert len({tuple(found["ring digests"]) for found in results}) == 1
    # one residual per bucket: the model's gradients' size, after DDP's rebuild dropped the first layout's
    assert results[0]["feedback_bytes"] == results[0]["gradient_bytes"]
    assert "error feedback: residuals of" in results[0]["summary"]


def test_telemetry_counts_the_bytes_on_the_wire(ddp_runs):
    import json

    from tests.test_frameworks import scalars

    directory, results = ddp_runs
    assert "bf16 on the wire: 0.50x the bytes" in results[0]["summary"]
    tags = scalars(directory / "ring_bf16")
    bucket_tags = sorted(tag for tag in tags if tag.startswith("comm/bucket_0/"))
    assert "comm/bucket_0/wire_bytes" in bucket_tags and "comm/bucket_0/bytes" in bucket_tags, bucket_tags
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory / "ring_bf16")).Reload()
    nbytes = [e.value for e in events.Scalars("comm/bucket_0/bytes")]
    wire_bytes = [e.value for e in events.Scalars("comm/bucket_0/wire_bytes")]
    times = [e.value for e in events.Scalars("comm/bucket_0/time_ms")]
    busbw = [e.value for e in events.Scalars("comm/bucket_0/busbw_GBps")]
    algbw = [e.value for e in events.Scalars("comm/bucket_0/algbw_GBps")]
    assert wire_bytes == [n / 2 for n in nbytes]
    for n, w, t, bus, alg in zip(nbytes, wire_bytes, times, busbw, algbw):  # busbw on the wire's bytes
        assert bus == pytest.approx(w / (t * 1e-3) / 1e9 * 2 * 2 / 3, rel=1e-5)
        assert alg == pytest.approx(n / (t * 1e-3) / 1e9, rel=1e-5)
    trace = json.loads((directory / "ring_bf16" / "comm_trace.json").read_text())
    buckets = [e for e in trace["traceEvents"] if e.get("name", "").startswith("bucket ") and e.get("ph") == "X"]
    assert buckets and all(e["args"]["wire"] == "bfloat16" and e["args"]["wire_bytes"] * 2 == e["args"]["bytes"]
                           for e in buckets)


@pytest.mark.fast
def test_wire_dtype_is_checked_with_its_own_message_and_refused_when_not_narrower():
    from ddp_ring_hooks import HookState

    with pytest.raises(ValueError, match=r"ring: wire_dtype='bf8' is not a wire dtype; choose one of 'fp32', 'bf16', 'fp16'"):
        HookState(algorithm="ring", wire_dtype="bf8")
    with pytest.raises(ValueError, match="native: wire_dtype='int8'"):
        resolve_options("native", {"wire_dtype": "int8"})
    with pytest.raises(TypeError, match=r"wire_dtype='fp16' is not narrower than this bfloat16 \(bf16\) bucket.*"
                                        r"Pass wire_dtype='fp32'"):
        wire_dtype_for(torch.bfloat16, "fp16")
    with pytest.raises(TypeError, match="rounds floating-point values, and this buffer is int64"):
        wire_dtype_for(torch.int64, {"wire_dtype": "bf16"})
    assert wire_dtype_for(torch.bfloat16, "bf16") is None and wire_dtype_for(torch.float16, "fp32") is None
    assert wire_dtype_for(torch.float64, "fp16") is torch.float16
    size = bucket_bytes(torch.empty(10), torch.bfloat16)
    assert (size.nbytes, size.wire_bytes, size.wire, size.ratio) == (40, 20, "bfloat16", 0.5)


@pytest.mark.fast
def test_error_feedback_needs_a_narrower_wire_and_a_bool():
    from ddp_ring_hooks import HookState

    with pytest.raises(ValueError, match="error_feedback=True keeps what rounding.*sends buckets as they are.*"
                                         "pass wire_dtype='bf16'"):
        HookState(algorithm="ring", error_feedback=True)
    with pytest.raises(TypeError, match="error_feedback must be True or False, got 'yes'"):
        HookState(algorithm="ring", wire_dtype="bf16", error_feedback="yes")
    assert HookState(algorithm="native", wire_dtype="fp16", error_feedback=True).plan.feedback is not None
    # pickled (spawn, a copy), a state keeps error feedback on, with no residuals of this process
    clone = pickle.loads(pickle.dumps(HookState(algorithm="ring", wire_dtype="bf16", error_feedback=True)))
    assert clone.plan.feedback is not None and clone.plan.feedback.nbytes == 0


def registering_refuses_a_wider_wire(rank: int, world_size: int) -> list[str]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddp_ring_hooks
    from ddp_ring_hooks.cost_model import Calibration
    from tests.conftest import Net

    messages = []
    for algorithm, options in (("ring", {}), ("native", {}), ("auto", {"calibration": Calibration(1e-5, 1e-9)})):
        model = DDP(Net().to(torch.bfloat16))
        try:
            ddp_ring_hooks.register(model, algorithm=algorithm, wire_dtype="fp16", **options)
        except TypeError as error:
            messages.append(str(error))
    # Ranks that send different wire dtypes are stopped by the layout check before any message
    # of the wrong size reaches gloo (which would abort the process).
    model = DDP(Net())
    ddp_ring_hooks.register(model, wire_dtype="bf16" if rank == 0 else "fp32")
    try:
        model(torch.randn(4, 32)).sum().backward()
    except RuntimeError as error:
        messages.append(str(error))
    return messages


def test_register_refuses_a_wire_dtype_wider_than_the_gradients_and_ranks_that_disagree():
    for messages in run_ranks(registering_refuses_a_wider_wire, 2, timeout=120):
        assert len(messages) == 4 and all("not narrower than this bfloat16 (bf16) bucket" in m for m in messages[:3])
        assert "dtype on the wire differs: rank 0: bfloat16, rank 1: as the bucket" in messages[3]
        assert "Every rank must pass the same wire_dtype" in messages[3]
