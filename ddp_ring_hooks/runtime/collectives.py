"""Small host-side helpers around collectives, shared by the hook's checks, ``auto``'s probe
and the benchmark: on which device a group communicates (and whether it can carry a tensor of
a given device at all), gathering a few integers from every rank, and timing calls the way
nccl-tests does (the slowest rank's time)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist


def device_of(group: dist.ProcessGroup | None, device: torch.device | str | None = None) -> torch.device:
    """The device whose tensors ``group`` communicates.

    ``device`` (the model's or the bucket's) wins when given: on a GPU node every rank has its
    own GPU, and ``torch.cuda.current_device()`` is cuda:0 on every rank whose script relies
    on ``DDP(device_ids=[local_rank])`` without ``torch.cuda.set_device`` (NCCL then reports
    "Duplicate GPU detected" or hangs). Without one: the CPU unless the group has NCCL; with
    NCCL, GPU ``LOCAL_RANK`` (set by torchrun) when this process sees that many GPUs, else the
    current GPU (one GPU visible per process, or call ``torch.cuda.set_device`` first).
    """
    if device is not None:
        return torch.device(device)
    if "nccl" not in str(dist.get_backend(group)):
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", -1))
    if 0 <= local_rank < torch.cuda.device_count():
        return torch.device("cuda", local_rank)
    return torch.device("cuda", torch.cuda.current_device())


def backend_for(backend: str, device_type: str) -> str | None:
    """The backend that carries ``device_type`` tensors in a group whose backend reads
    ``backend``: ``"gloo"`` and ``"nccl"`` carry one device type each here (gloo: CPU, since
    its point-to-point path has no CUDA support; NCCL: CUDA), and a mixed group names one per
    device (``"cpu:gloo,cuda:nccl"``). ``None`` when no backend of the group carries it."""
    parts = [part.strip() for part in backend.split(",") if part.strip()]
    if len(parts) == 1 and ":" not in parts[0]:
        native_device = {"gloo": "cpu", "nccl": "cuda"}.get(parts[0])
        return parts[0] if native_device in (None, device_type) else None
    for part in parts:
        device, _, name = part.partition(":")
        if device == device_type:
            return name
    return None


def check_device_backend(device_type: str, backend: str) -> None:
    """Refuse tensors on a device the group's backend cannot carry, with the fix.

    gloo's point-to-point operations would read CUDA memory as host memory (a crash or
    garbage), and NCCL cannot move CPU tensors at all; both fail far from the cause.
    """
    if backend_for(backend, device_type) is not None:
        return
    if device_type == "cuda":
        raise ValueError(
            f"a CUDA tensor reached a process group whose backend is {backend!r}, which carries CPU "
            "tensors only here: create the group with backend='nccl' (or 'cpu:gloo,cuda:nccl'), or "
            "keep the model on the CPU"
        )
    raise ValueError(
        f"a {device_type} tensor reached a process group whose backend is {backend!r}, which carries "
        "CUDA tensors only: move the model to its GPU (model.to(local_rank)) before wrapping it in "
        "DDP, or create the group with backend='gloo' (or 'cpu:gloo,cuda:nccl')"
    )


def all_gather_ints(
    values: Sequence[int], group: dist.ProcessGroup | None, *, device: torch.device | str | None = None
) -> list[list[int]]:
    """Every rank's ``values`` (the same length on every rank), by group rank. Collective.

    On CUDA the result is copied to the host (a sync): call it at registration, or on a gloo
    group (the hook's layout check uses its group context's control group)."""
    world_size = dist.get_world_size(group)
    row = torch.tensor(list(values), dtype=torch.int64, device=device_of(group, device))
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
