"""The CUDA/NCCL path on 2 GPUs: correctness, DDP parity, no host sync, overlap.

Skipped where fewer than 2 GPUs are visible (this project's CI machine has none: these tests
were written against PyTorch's sources and have not run yet, see ``docs/gpu.md``). Run them on
a 2-GPU node with ``python -m pytest -q -m gpu tests/test_gpu_nccl.py``.

Every rank builds its model on ``cuda:rank`` *without* ``torch.cuda.set_device``, as a script
that relies on ``DDP(device_ids=[local_rank])`` does: the hook must take its device from the
bucket and the model, never from ``torch.cuda.current_device()`` (cuda:0 on every rank).
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_ranks
from tests.conftest import native_and_ring_in_one_backward

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs and NCCL; this machine has none (CPU-only CI)"
    ),
]

SIZES = [0, 1, 2, 3, 1000, 12_345, (1 << 20) + 7]  # uneven, fewer elements than ranks, a few MB
DTYPES = ("float32", "bfloat16", "float16")
ALGORITHMS = ("ring", "tree", "halving_doubling", "naive", "native", "auto")


def _correctness(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    import ddp_ring_hooks

    device = torch.device("cuda", rank)
    subgroup = dist.new_group([0, 1])  # a group of its own: schedules speak group ranks
    report = {}
    for group_name, group in (("world", None), ("subgroup", subgroup)):
        for dtype_name in DTYPES:
            dtype = getattr(torch, dtype_name)
            for size in SIZES:
                generator = torch.Generator().manual_seed(1000 * rank + size)
                inputs = torch.randn(size, generator=generator).to(dtype).to(device)
                reference = inputs.clone()
                dist.all_reduce(reference, group=group)
                magnitude = inputs.abs().float()
                dist.all_reduce(magnitude, group=group)
                # Both sums are within (p-1)·eps·Σ|x| of the exact one: of each other, twice that.
                bound = 2 * (world_size - 1) * torch.finfo(dtype).eps * magnitude
                for algorithm in ALGORITHMS:
                    ours = inputs.clone()
                    ddp_ring_hooks.all_reduce(ours, algorithm=algorithm, group=group)
                    gathered = [torch.empty_like(ours) for _ in range(world_size)]
                    dist.all_gather(gathered, ours, group=group)
                    report[(group_name, dtype_name, size, algorithm)] = (
                        all(torch.equal(gathered[0], other) for other in gathered[1:]),
                        bool(((ours.float() - reference.float()).abs() <= bound).all()),
                        ours.device == device,
                    )
    return report


def test_all_reduce_on_nccl_matches_dist_all_reduce_and_ranks_agree_bitwise():
    reports = run_ranks(_correctness, 2, timeout=600, backend="nccl")
    for key, (identical, within_bound, on_device) in reports[0].items():
        assert identical, f"{key}: ranks differ"
        assert within_bound, f"{key}: differs from dist.all_reduce beyond the rounding bound"
        assert on_device, key


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(6)))

    def forward(self, x):
        return self.layers(x)


def _train(rank: int, hook: str, steps: int = 4) -> list[torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddp_ring_hooks

    torch.manual_seed(0)
    device = torch.device("cuda", rank)
    model = DDP(_Net().to(device), device_ids=[rank], bucket_cap_mb=0.1)  # several buckets, no set_device
    state = ddp_ring_hooks.register(model, algorithm=hook) if hook != "plain" else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(32, 256, generator=generator).to(device)).square().mean().backward()
        optimizer.step()
    if state is not None:
        state.close()
    return [p.detach().cpu() for p in model.parameters()]


def _parity(rank: int, world_size: int) -> dict:
    return {hook: _train(rank, hook) for hook in ("plain", "ring", "native")}


def test_ddp_parity_with_ring_and_native_on_nccl():
    reports = run_ranks(_parity, 2, timeout=600, backend="nccl")
    for report in reports:
        assert all(torch.equal(a, b) for a, b in zip(report["native"], report["plain"]))  # bit for bit
        for ours, plain in zip(report["ring"], report["plain"]):
            torch.testing.assert_close(ours, plain, rtol=1e-5, atol=1e-6)
        for hook in ("ring", "native"):
            assert all(torch.equal(a, b) for a, b in zip(report[hook], reports[0][hook]))


def _no_host_sync(rank: int, world_size: int, log_dir: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddp_ring_hooks

    device = torch.device("cuda", rank)
    report = {}
    for algorithm in ("ring", "native", "auto"):
        torch.manual_seed(0)
        model = DDP(_Net().to(device), device_ids=[rank], bucket_cap_mb=0.1)
        # auto's probe synchronizes (at registration, not in the hook); the layout check runs
        # for 4 iterations, so 2 of them are inside the checked window below.
        state = ddp_ring_hooks.register(
            model, algorithm=algorithm, log_dir=f"{log_dir}/{algorithm}", check_layout_steps=4
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        batches = [torch.randn(32, 256).to(device) for _ in range(6)]

        def step(batch):
            optimizer.zero_grad()
            model(batch).square().mean().backward()
            optimizer.step()

        for batch in batches[:2]:  # DDP's own first iterations (bucket rebuild) may sync
            step(batch)
        torch.cuda.synchronize(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            for batch in batches[2:]:
                step(batch)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        state.close()
        report[algorithm] = state.telemetry.summary()
    return report


def test_no_host_sync_in_the_hook_with_telemetry_on(tmp_path):
    reports = run_ranks(_no_host_sync, 2, str(tmp_path), timeout=600, backend="nccl")
    assert all("bucket" in summary for summary in reports[0].values())


def _overlap(rank: int, world_size: int) -> dict:
    """Backward's compute stream must keep running while a bucket is in flight: right after
    the first (large) bucket is handed over, enqueue a known kernel on the compute stream and
    check, with events on the same device, that it started before the bucket finished."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddp_ring_hooks
    from ddp_ring_hooks.runtime import ExecutionObserver

    device = torch.device("cuda", rank)

    class Marks(ExecutionObserver):
        def __init__(self) -> None:
            self.finished: list[torch.cuda.Event] = []

        def on_finish(self) -> None:  # on the worker thread, whose current stream is the side stream
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.finished.append(event)

    marks = Marks()
    torch.manual_seed(0)
    big = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 4096)).to(device)  # 2 x 64 MB
    model = DDP(big, device_ids=[rank], bucket_cap_mb=64)
    state = ddp_ring_hooks.HookState(model.process_group, "ring", observers=(marks,), device=device)
    compute: list[torch.cuda.Event] = []

    def hook(hook_state, bucket):
        future = ddp_ring_hooks.ring_hook(hook_state, bucket)
        if bucket.index() == 0:
            event = torch.cuda.Event(enable_timing=True)
            event.record()  # the compute stream, right after the handover
            compute.append(event)
        return future

    model.register_comm_hook(state, hook)
    for _ in range(3):
        model(torch.randn(64, 4096, device=device)).sum().backward()
    torch.cuda.synchronize(device)
    state.close()
    # Buckets finish in DDP's order (one lane per device), the same number every iteration.
    per_iteration, left = divmod(len(marks.finished), len(compute))
    assert left == 0, (len(marks.finished), len(compute))
    last_bucket0_end = marks.finished[-per_iteration]
    # Positive when bucket 0 of the last iteration ended *after* the compute stream passed
    # the mark enqueued right after its handover: compute went on while it travelled. With
    # the ring on the compute stream (before the side stream) it was negative.
    return {"compute_ahead_ms": compute[-1].elapsed_time(last_bucket0_end)}


def test_backward_compute_overlaps_a_bucket_in_flight():
    reports = run_ranks(_overlap, 2, timeout=600, backend="nccl")
    for report in reports:
        assert report["compute_ahead_ms"] > 0, report


def _native_and_ring_in_one_backward(rank: int, world_size: int) -> dict:
    return native_and_ring_in_one_backward(rank, torch.device("cuda", rank))


def test_native_and_schedule_buckets_in_one_backward_do_not_deadlock():
    """``native`` issues on the hook thread on the model's communicator, the ring on the worker
    on the dedicated one: with one shared side stream the two could wait on each other in an
    order that differs between ranks (a deadlock); each communicator has its own stream now."""
    reports = run_ranks(_native_and_ring_in_one_backward, 2, timeout=300, backend="nccl")  # a deadlock times out
    assert reports[0]["chosen"] == ["native", "ring"]
    assert all(torch.equal(a, b) for a, b in zip(reports[0]["params"], reports[1]["params"]))


def _sparse_on_nccl(rank: int, world_size: int) -> dict:
    """A sparse embedding on NCCL: refused at registration and at the first backward (NCCL has no
    sparse all-reduce); with ``sparse="dense"`` it goes through the ring as a dense tensor."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddp_ring_hooks

    device = torch.device("cuda", rank)

    def model():
        torch.manual_seed(0)
        return DDP(torch.nn.Embedding(100, 8, sparse=True).to(device), device_ids=[device])

    def backward(ddp):
        ddp(torch.tensor([1, 2, 3 + rank], device=device)).sum().backward()

    report = {}
    try:
        ddp_ring_hooks.register(model())
    except TypeError as error:
        report["at registration"] = str(error)
    bypassing = model()
    bypassing.register_comm_hook(ddp_ring_hooks.HookState(bypassing.process_group, device=device),
                                 ddp_ring_hooks.ring_hook)
    try:
        backward(bypassing)
    except RuntimeError as error:
        report["at backward"] = str(error)
    densified = model()
    state = ddp_ring_hooks.register(densified, sparse="dense")
    backward(densified)
    grad = densified.module.weight.grad
    report["densified"] = (grad.is_sparse, tuple(grad.shape), grad.to_dense().cpu())
    state.close()
    return report


def test_a_sparse_bucket_on_nccl_is_refused_unless_densified():
    reports = run_ranks(_sparse_on_nccl, 2, timeout=300, backend="nccl")
    for report in reports:
        assert "no sparse all-reduce" in report["at registration"] and "sparse='dense'" in report["at registration"]
        assert "no sparse all-reduce" in report["at backward"]
        is_sparse, shape, values = report["densified"]
        assert is_sparse and shape == (100, 8)
        assert torch.equal(values, reports[0]["densified"][2])
