"""Start a function on every rank: under ``torchrun``, or by spawning local gloo ranks.

Benchmarks and commands run the same way in both worlds::

    torchrun --standalone --nproc_per_node=4 -m ddp_ring_hooks bench    # torchrun sets RANK, ...
    python -m ddp_ring_hooks bench --nproc 4                            # spawns 4 local ranks

:func:`run_on_ranks` looks for torchrun's ``RANK`` and ``WORLD_SIZE``; with them it joins
that job, without them it spawns ``nproc`` processes that meet through a file store in a
temporary directory (no port to pick, nothing leaves the machine). Either way ``fn(*args)``
runs once per rank inside an initialised process group, which is destroyed afterwards, and
its return value comes back: this rank's under torchrun, rank 0's in the spawning process. A
rank that raises makes the spawning call raise too (``torch.multiprocessing`` stops the
others), so nothing is left running.
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def under_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (or another launcher that sets the env)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def default_backend() -> str:
    """``nccl`` when this process can use a GPU under torchrun, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def run_on_ranks(
    fn: Callable[..., Any],
    *args: Any,
    nproc: int,
    backend: str | None = None,
    timeout_s: float = 600.0,
) -> Any:
    """Run ``fn(*args)`` on every rank of a process group; return its value (see the module docstring).

    Under torchrun the group is torchrun's (``nproc`` is ignored) and ``backend`` defaults to
    :func:`default_backend`; otherwise ``nproc`` local ranks are spawned on gloo. ``fn``
    must be a module-level function when ranks are spawned (they import it by name).
    """
    if under_torchrun():
        return _run_in_group(fn, args, backend or default_backend(), timeout_s, init_kwargs={})
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    if backend not in (None, "gloo"):
        raise ValueError(f"spawned local ranks use gloo; run under torchrun to use {backend!r}")
    with tempfile.TemporaryDirectory(prefix="ddp_ring_hooks_") as directory:
        store = os.path.join(directory, "store")
        result = os.path.join(directory, "rank0.pickle")
        mp.start_processes(
            _spawned_rank, args=(fn, args, nproc, store, result, timeout_s), nprocs=nproc, join=True,
            start_method="spawn",
        )
        with open(result, "rb") as file:
            return pickle.load(file)


def _spawned_rank(rank: int, fn, args, nproc: int, store_path: str, result_path: str, timeout_s: float) -> None:
    # torchrun's default for several ranks per machine: one thread each, so ranks do not fight
    # over cores (and LOCAL_WORLD_SIZE, which some schedules read, as torchrun sets it).
    torch.set_num_threads(1)
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(nproc))
    os.environ.setdefault("LOCAL_RANK", str(rank))
    store = dist.FileStore(store_path, nproc)
    value = _run_in_group(fn, args, "gloo", timeout_s, init_kwargs={"store": store, "rank": rank, "world_size": nproc})
    if rank == 0:
        with open(result_path, "wb") as file:
            pickle.dump(value, file)


def _run_in_group(fn, args, backend: str, timeout_s: float, *, init_kwargs: dict) -> Any:
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **init_kwargs)
    try:
        return fn(*args)
    finally:
        dist.destroy_process_group()
