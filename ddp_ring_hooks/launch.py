"""Start a function on every rank: under ``torchrun``, or by spawning local gloo ranks.

Benchmarks and commands run the same way in both worlds::

    torchrun --standalone --nproc_per_node=4 -m ddp_ring_hooks bench    # torchrun sets RANK, ...
    python -m ddp_ring_hooks bench --nproc 4                            # spawns 4 local ranks

:func:`run_on_ranks` looks for torchrun's ``RANK`` and ``WORLD_SIZE``; with them it joins
that job, without them it spawns ``nproc`` processes that meet through a file store in a
temporary directory (no port to pick, nothing leaves the machine). Either way ``fn(*args)``
runs once per rank inside an initialised process group, which is destroyed afterwards, and
its return value comes back: this rank's under torchrun, rank 0's in the spawning process.

:func:`spawn_ranks` is the spawning underneath, also what the test suite runs its ranks with:
it returns every rank's value, re-raises a rank's exception with that rank's traceback
(:class:`RankFailed`), and kills every rank when they do not finish in time (a deadlock fails
fast instead of hanging).

Ranks start from multiprocessing's *fork server* (:func:`rank_context`), which imports torch
once: a rank then costs a fork, not a fresh interpreter importing torch (about 2.5 s of CPU
each, most of a small test's time), and, unlike a plain ``fork`` of the caller, nothing of the
caller's threads, OpenMP pool or CUDA context comes along. Each rank takes the caller's
environment and standard output and error as they are at the start (as a spawned process
would), not the fork server's: :func:`rank_process_kwargs`.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_module
import tempfile
import time
import traceback
from multiprocessing import reduction
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
    return spawn_ranks(_as_torchrun_would, nproc, fn, args, timeout=None, pg_timeout=timeout_s)[0]


def _as_torchrun_would(rank: int, world_size: int, fn, args) -> Any:
    # torchrun's default for several ranks per machine: one thread each (spawn_ranks sets it),
    # and LOCAL_WORLD_SIZE / LOCAL_RANK / GROUP_RANK (one node), which some options read, as
    # torchrun sets them.
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("GROUP_RANK", "0")
    return fn(*args)


class RankFailed(RuntimeError):
    """A spawned rank raised; the message holds its traceback."""


def spawn_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float | None = 60.0,
    pg_timeout: float | None = None,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks (``backend="nccl"``:
    NCCL, for the GPU tests); return their values.

    The ranks meet through a file store in a temporary directory. A rank that raises makes
    this raise :class:`RankFailed` with its traceback (after the others report or die); ranks
    still running after ``timeout`` seconds (``None``: no limit) are all killed and this
    raises ``TimeoutError``. ``pg_timeout`` is the process group's own timeout (default
    ``timeout``, or 600 s). ``fn`` must be a module-level function (ranks import it by name).
    """
    context = rank_context()
    results: queue_module.Queue = context.Queue()
    with tempfile.TemporaryDirectory(prefix="ddp_ring_hooks_") as directory:
        store = os.path.join(directory, "store")
        processes = [
            context.Process(
                target=_rank_main,
                args=(fn, rank, world_size, store, pg_timeout or timeout or 600.0, results, args, backend),
                kwargs=rank_process_kwargs(),
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


def _collect(results, processes, timeout: float | None) -> dict[int, tuple[bool, Any]]:
    deadline = None if timeout is None else time.monotonic() + timeout
    collected: dict[int, tuple[bool, Any]] = {}
    while len(collected) < len(processes):
        remaining = 1.0 if deadline is None else deadline - time.monotonic()
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


# What the fork server imports before it forks any rank: what every rank imports anyway.
_FORK_SERVER_PRELOAD = ("torch", "torch.distributed", "ddp_ring_hooks")


def rank_context():
    """The multiprocessing context local ranks start from: the fork server, with torch and this
    package imported (see the module docstring). Start a rank with :func:`_rank_main` and
    ``kwargs=rank_process_kwargs()``."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(_FORK_SERVER_PRELOAD))
    return context


def rank_process_kwargs() -> dict:
    """What a rank takes from its caller now: the environment, and standard output and error
    (a test capturing output, a redirected command), which the fork server, started earlier,
    may not share."""
    return {"environment": dict(os.environ), "streams": (_CallerStream(1), _CallerStream(2))}


class _CallerStream:
    """The caller's file descriptor ``fd``, sent to the rank with its arguments (multiprocessing
    passes descriptors to a fork server's child only while pickling them: ``DupFd``)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _attach_stream, (self.fd, reduction.DupFd(self.fd))


def _attach_stream(fd: int, duplicate) -> int:
    """In the rank: make ``fd`` the caller's stream."""
    os.dup2(duplicate.detach(), fd)
    return fd


def _rank_main(
    fn, rank, world_size, store_path, pg_timeout, results, args, backend: str = "gloo", *,
    environment: dict[str, str] | None = None, streams: tuple = (),
) -> None:
    # ``streams`` did their work when they were unpickled (_attach_stream).
    if environment is not None:  # the caller's, not the fork server's (started earlier)
        os.environ.clear()
        os.environ.update(environment)
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world_size)
        value = _run_in_group(
            fn, (rank, world_size, *args), backend, pg_timeout,
            init_kwargs={"store": store, "rank": rank, "world_size": world_size},
        )
        # Plain pickle copies tensors by value; torch's queue pickler would share them through
        # file descriptors that die with this process.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, False, traceback.format_exc()))


def _run_in_group(fn, args, backend: str, timeout_s: float, *, init_kwargs: dict) -> Any:
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **init_kwargs)
    try:
        return fn(*args)
    finally:
        dist.destroy_process_group()
