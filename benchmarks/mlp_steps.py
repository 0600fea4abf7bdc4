"""The workload and the clock shared by the DDP step benchmarks (``ddp_step``, ``telemetry_overhead``).

A stack of ``width x width`` linear layers: big enough gradients for several DDP buckets,
cheap enough to time many blocks on a CPU. A block of steps is timed on the slowest rank,
in wall time and in CPU time of every thread of the process (the hook's worker, gloo's and
the telemetry writer's too): the CPU time shows the extra work an arm costs, which is what
slows it when ranks share cores.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def build_mlp(*, layers: int, width: int) -> torch.nn.Sequential:
    """The benchmark MLP, with the same initial weights on every call (both arms start equal)."""
    torch.manual_seed(0)
    modules: list[torch.nn.Module] = []
    for _ in range(layers):
        modules += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*modules)


def build_mlp_ddp(*, layers: int, width: int, bucket_cap_mb: float) -> DistributedDataParallel:
    """:func:`build_mlp` in DDP."""
    return DistributedDataParallel(build_mlp(layers=layers, width=width), bucket_cap_mb=bucket_cap_mb)


def time_steps(
    model: DistributedDataParallel,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    steps: int,
    *,
    before_stop: Callable[[], None] = lambda: None,
) -> tuple[float, float]:
    """Wall and CPU milliseconds per step of ``steps`` DDP steps, on the slowest rank.

    ``before_stop`` runs inside the timed block, after the steps (e.g. a telemetry flush, so
    an arm pays for the backlog it made).
    """
    dist.barrier()
    began, began_cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        model(inputs).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    before_stop()
    elapsed = torch.tensor(
        [time.perf_counter() - began, time.process_time() - began_cpu], dtype=torch.float64
    ) * (1e3 / steps)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank decides
    return float(elapsed[0]), float(elapsed[1])
