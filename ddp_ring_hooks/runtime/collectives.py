"""Small host-side helpers around collectives, shared by the hook's checks, ``auto``'s probe
and the benchmark: on which device a group communicates, gathering a few integers from
every rank, and timing calls the way nccl-tests does (the slowest rank's time)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist


def device_of(group: dist.ProcessGroup | None) -> torch.device:
    """The device whose tensors ``group`` communicates: the current GPU when it has NCCL
    (``"nccl"``, or ``"cpu:gloo,cuda:nccl"``), else the CPU."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_ints(values: Sequence[int], group: dist.ProcessGroup | None) -> list[list[int]]:
    """Every rank's ``values`` (the same length on every rank), by group rank. Collective."""
    world_size = dist.get_world_size(group)
    row = torch.tensor(list(values), dtype=torch.int64, device=device_of(group))
    if world_size == 1:
        return [row.tolist()]
    table = [torch.empty_like(row) for _ in range(world_size)]
    dist.all_gather(table, row, group=group)
    return torch.stack(table).tolist()


def time_calls(call: Callable[[], object], device: torch.device, *, warmup: int, iters: int, group) -> float:
    """Seconds per ``call()`` over ``iters`` calls after ``warmup`` untimed ones, on the
    slowest rank of ``group`` (a collective is over when its last rank is done).

    The calls start after a barrier; on CUDA the host waits for the GPU before reading the
    clock (a benchmark must; the hook never does). Collective.
    """
    for _ in range(warmup):
        call()
    _synchronize(device)
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(iters):
        call()
    _synchronize(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed.item())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
