"""Run a function on N real gloo ranks, each in its own process, and collect the results.

``run_ranks(fn, world_size, *args)`` spawns the ranks, joins them through a FileStore, calls
``fn(rank, world_size, *args)`` in each and returns the list of return values by rank. If a
rank raises, the error is re-raised here with that rank's traceback. If the ranks do not all
finish within ``timeout`` seconds (a deadlock), every rank is killed and the test fails with
``TimeoutError``: nothing in the suite can hang CI.

``fn`` must be a module-level function (spawned processes import it by name).
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_module
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    """A rank raised; the message holds its traceback."""


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    pg_timeout: float | None = None,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks (gloo unless ``backend``
    says otherwise, e.g. ``"nccl"`` for the GPU tests); return their results."""
    context = mp.get_context("spawn")
    results: queue_module.Queue = context.Queue()
    with tempfile.TemporaryDirectory() as directory:
        store = os.path.join(directory, "store")
        processes = [
            context.Process(
                target=_rank_main,
                args=(fn, rank, world_size, store, pg_timeout or timeout, results, args, backend),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        try:
            collected = _collect(results, processes, timeout)
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
                process.join(5)
    failures = [f"rank {rank} failed:\n{text}" for rank, (ok, text) in sorted(collected.items()) if not ok]
    if failures:
        raise RankFailed("\n".join(failures))
    return [pickle.loads(collected[rank][1]) for rank in range(world_size)]


def _collect(results, processes, timeout: float) -> dict[int, tuple[bool, Any]]:
    deadline = time.monotonic() + timeout
    collected: dict[int, tuple[bool, Any]] = {}
    while len(collected) < len(processes):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(len(processes))) - set(collected))
            raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f}s (deadlock?); killed them")
        try:
            rank, ok, value = results.get(timeout=min(remaining, 1.0))
        except queue_module.Empty:
            dead = [r for r, p in enumerate(processes) if r not in collected and p.exitcode not in (None, 0)]
            if dead:
                # Give the others a moment to report their own errors, then stop.
                time.sleep(0.5)
                while True:
                    try:
                        rank, ok, value = results.get_nowait()
                    except queue_module.Empty:
                        break
                    collected[rank] = (ok, value)
                for r in dead:
                    collected.setdefault(r, (False, f"process exited with code {processes[r].exitcode}"))
                return collected
            continue
        collected[rank] = (ok, value)
    return collected


def _rank_main(fn, rank, world_size, store_path, pg_timeout, results, args, backend="gloo") -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        value = fn(rank, world_size, *args)
        # Plain pickle copies tensors by value; torch's queue pickler would share them through
        # file descriptors that die with this process.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
