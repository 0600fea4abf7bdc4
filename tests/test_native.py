"""``algorithm="native"`` and ``auto`` with native, on real gloo ranks.

- native trains *bit-identically* to DDP without any hook (DDP's reducer multiplies by
  ``1/world_size``; PyTorch's ``allreduce_hook`` divides, and at 3 ranks that already differs in
  the last bit: the test shows it, so it can tell the two apart);
- its per-bucket telemetry reaches TensorBoard (time_ms, bytes, busbw, queue_ms, exposed);
- ``all_reduce(t, algorithm="auto")`` and ``"native"`` work, ``auto`` has native among its
  default candidates and logs the winner's margin; ``candidates=`` can leave it out;
- the device/backend refusal names the fix (pure function on backend strings).
"""

from __future__ import annotations

import logging

import pytest
import torch

from ddp_ring_hooks.runtime.collectives import backend_for, check_device_backend
from tests._dist import run_ranks
from tests.conftest import Net, native_and_ring_in_one_backward, sgd_steps
from tests.test_telemetry import _scalars

STEPS = 4


def _train(rank: int, hook: str, **ddp_options) -> list[torch.Tensor]:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddp_ring_hooks

    torch.manual_seed(0)
    model = DDP(Net(), bucket_cap_mb=0.01, **ddp_options)  # several buckets
    if hook == "native":
        state = ddp_ring_hooks.register(model, algorithm="native")
    elif hook == "allreduce_hook":
        model.register_comm_hook(dist.group.WORLD, allreduce_hook)
    params = sgd_steps(model, rank, STEPS)
    if hook == "native":
        state.close()
    return params


def _train_three_ways(rank: int, world_size: int) -> dict:
    return {hook: _train(rank, hook) for hook in ("plain", "native", "allreduce_hook")}


@pytest.mark.parametrize("world_size", [2, 3])
def test_native_is_bit_identical_to_ddp_without_a_hook(world_size):
    reports = run_ranks(_train_three_ways, world_size, timeout=180)
    for rank, report in enumerate(reports):
        assert all(torch.equal(a, b) for a, b in zip(report["native"], report["plain"])), f"rank {rank}"
        assert all(torch.equal(a, b) for a, b in zip(report["native"], reports[0]["native"]))
    if world_size == 3:  # 1/3 is inexact: dividing (allreduce_hook) is not DDP's multiplying
        divided = reports[0]["allreduce_hook"]
        assert not all(torch.equal(a, b) for a, b in zip(divided, reports[0]["plain"]))


def _native_with_telemetry(rank: int, world_size: int, log_dir: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddp_ring_hooks

    torch.manual_seed(0)
    model = DDP(Net(), bucket_cap_mb=0.01)
    seen: dict[int, int] = {}
    state = ddp_ring_hooks.register(model, algorithm="native", log_dir=log_dir, spread_every=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(STEPS):
        optimizer.zero_grad()
        model(torch.randn(8, 32)).square().mean().backward()
        optimizer.step()
    for bucket in model.reducer._get_zeros_like_grad_buckets():
        seen[bucket.index()] = bucket.buffer().numel() * bucket.buffer().element_size()
    summary = state.summary()
    state.close()
    return {"buckets": seen, "summary": summary}


def test_native_telemetry_reaches_tensorboard(tmp_path):
    reports = run_ranks(_native_with_telemetry, 2, str(tmp_path), timeout=180)
    scalars = _scalars(str(tmp_path))
    buckets = reports[0]["buckets"]
    assert len(buckets) >= 2, "the model should have several buckets"
    for index, nbytes in buckets.items():
        prefix = f"comm/bucket_{index}"
        assert scalars[f"{prefix}/bytes"][STEPS] == nbytes
        time_ms = scalars[f"{prefix}/time_ms"][STEPS]
        assert time_ms > 0
        assert scalars[f"{prefix}/busbw_GBps"][STEPS] == pytest.approx(nbytes / (time_ms * 1e-3) / 1e9, rel=1e-4)
        assert scalars[f"{prefix}/queue_ms"][STEPS] >= 0
        assert scalars[f"{prefix}/all-reduce_ms"][STEPS] == pytest.approx(time_ms, rel=1e-3)
    assert scalars["comm/step/exposed_ms"][STEPS] > 0
    assert sorted(scalars["comm/ranks/total_ms_spread"]) == [2, 4]  # spread works from gloo's callback
    assert "native" in reports[0]["summary"]


def _all_reduce_by_name(rank: int, world_size: int) -> dict:
    import ddp_ring_hooks
    from ddp_ring_hooks.runtime.selection import selector_for

    logger = logging.getLogger("ddp_ring_hooks.auto")
    logger.setLevel(logging.INFO)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger.addHandler(handler)
    report = {}
    for name, options in [("native", {}), ("auto", {}), ("auto", {"candidates": ("ring", "tree")})]:
        tensor = torch.arange(1000, dtype=torch.float32) * (rank + 1)
        ddp_ring_hooks.all_reduce(tensor, algorithm=name, **options)
        report[(name, tuple(options.get("candidates", ())))] = tensor
    report["default_candidates"] = selector_for().candidates
    report["narrow_candidates"] = selector_for(candidates=("ring", "tree")).candidates
    report["log"] = lines
    return report


def test_all_reduce_takes_native_and_auto_and_auto_can_leave_native_out():
    reports = run_ranks(_all_reduce_by_name, 2, timeout=180)
    expected = torch.arange(1000, dtype=torch.float32) * 3
    for report in reports:
        for key in [("native", ()), ("auto", ()), ("auto", ("ring", "tree"))]:
            assert torch.equal(report[key], expected), key
        assert "native" in report["default_candidates"]
        assert report["narrow_candidates"] == ("ring", "tree")
    decided = [line for line in reports[0]["log"] if "-byte bucket on 2 ranks ->" in line]
    assert decided and all(" wins by " in line and "x over " in line for line in decided)


@pytest.mark.fast
def test_native_and_auto_are_known_names():
    from ddp_ring_hooks.runtime.names import check_algorithm_name

    with pytest.raises(ValueError, match="unknown algorithm 'rign'"):
        check_algorithm_name("rign")
    check_algorithm_name("native")
    check_algorithm_name("auto")
    with pytest.raises(ValueError, match="unknown algorithm 'auto'"):
        check_algorithm_name("auto", allow_auto=False)


@pytest.mark.parametrize("backend, device, carried", [
    ("gloo", "cpu", "gloo"), ("gloo", "cuda", None), ("nccl", "cuda", "nccl"), ("nccl", "cpu", None),
    ("cpu:gloo,cuda:nccl", "cuda", "nccl"), ("cpu:gloo,cuda:nccl", "cpu", "gloo"),
])
def test_which_backend_carries_which_device(backend, device, carried):
    assert backend_for(backend, device) == carried
    if carried is None:
        with pytest.raises(ValueError, match="backend='nccl'" if device == "cuda" else "model.to"):
            check_device_backend(device, backend)
    else:
        check_device_backend(device, backend)


@pytest.mark.fast
def test_model_says_native_has_no_formula(capsys):
    from ddp_ring_hooks.cli.__main__ import main

    assert main(["model", "--size", "1MB", "--world-sizes", "2,8", "--algorithms", "ring,native"]) == 0
    out = capsys.readouterr().out
    native_row = next(line for line in out.splitlines() if line.startswith("native "))
    assert native_row.split()[1:] == ["n/a", "n/a"]
    assert "native: no formula" in out


@pytest.mark.fast
def test_a_worker_runs_its_start_hook_on_its_thread_and_fails_jobs_if_it_raises():
    # What a CUDA lane relies on: on_start sets the thread's device and stream before any job.
    import threading

    from ddp_ring_hooks.runtime.worker import CommWorker

    started: list[str] = []
    worker = CommWorker("probe", on_start=lambda: started.append(threading.current_thread().name))
    assert worker.submit(lambda: threading.current_thread().name).wait() == "probe"
    worker.close()
    assert started == ["probe"]

    def broken() -> None:
        raise RuntimeError("no such device")

    failing = CommWorker("broken", on_start=broken)
    with pytest.raises(RuntimeError, match="could not start: no such device"):
        failing.submit(lambda: 1).wait()
    failing.close()


def _native_and_ring_on_cpu(rank: int, world_size: int) -> dict:
    return native_and_ring_in_one_backward(rank, torch.device("cpu"))


def test_auto_runs_native_and_ring_buckets_of_one_backward_and_ranks_agree():
    """native on the hook thread and the ring on the worker lanes, in the same backward."""
    reports = run_ranks(_native_and_ring_on_cpu, 2, timeout=120)
    assert reports[0]["chosen"] == ["native", "ring"]
    assert all(torch.equal(a, b) for a, b in zip(reports[0]["params"], reports[1]["params"]))

