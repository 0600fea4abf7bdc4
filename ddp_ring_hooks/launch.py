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

Ranks start from a *fork server* (:func:`rank_context`) that imported torch once:

1. The first rank started in a process starts the server: a fresh interpreter that imports
   torch and this package, then waits. It is this module's own server, not multiprocessing's
   shared one, so the preload list a user gave ``multiprocessing.set_forkserver_preload`` for
   their DataLoaders is neither changed nor served by it (:class:`_RankPopen`).
2. Each rank is a fork of that server: a fork, not a fresh interpreter importing torch (about
   2.5 s of CPU each, most of a small test's time), and, unlike a plain ``fork`` of the caller,
   nothing of the caller's threads, OpenMP pool or CUDA context comes along.
3. The rank takes the caller's environment and standard output and error as they are now (as
   a spawned process would), not the server's (:func:`rank_process_kwargs`), with
   ``LOCAL_RANK`` set to its rank, as torchrun sets it: on NCCL rank ``i`` uses ``cuda:i``.
4. :func:`started_ranks` starts them all and kills every one already started when a later
   start fails, when the caller stops waiting, or when a rank fails: none is left running.

Importing this module does not import torch (the command line asks ``under_torchrun``
before it knows whether any rank will run); the functions that need it import it.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import io
import os
import pickle
import queue as queue_module
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing import context as mp_context
from multiprocessing import forkserver, popen_forkserver, reduction, spawn, util
from typing import Any


def under_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (or another launcher that sets the env)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def default_backend() -> str:
    """``nccl`` when this process can use a GPU under torchrun, else ``gloo``."""
    import torch
    import torch.distributed as dist

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
    # torchrun's default for several ranks per machine: one thread each and LOCAL_RANK
    # (spawn_ranks sets both), and LOCAL_WORLD_SIZE / GROUP_RANK (one node), which some options
    # read, as torchrun sets them.
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))
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
    with started_ranks(fn, world_size, args, pg_timeout=pg_timeout or timeout or 600.0, backend=backend) as (
        processes, results,
    ):
        collected = _collect(results, processes, timeout)
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


@contextlib.contextmanager
def started_ranks(
    fn: Callable[..., Any], world_size: int, args: tuple = (), *, pg_timeout: float, backend: str = "gloo",
) -> Iterator[tuple[list, Any]]:
    """Start ``world_size`` ranks running ``fn(rank, world_size, *args)`` in a process group
    (timeout ``pg_timeout`` seconds) that meets through a file store in a temporary directory;
    yield the processes, by rank, and the queue each reports ``(rank, ok, pickled value or
    traceback)`` to. On leaving, every rank still running is killed: also those started before
    a later start failed (its error is raised), and all of them when the caller raises."""
    context = rank_context()
    results = context.Queue()
    processes: list = []
    with tempfile.TemporaryDirectory(prefix="ddp_ring_hooks_") as directory:
        store = os.path.join(directory, "store")
        try:
            for rank in range(world_size):
                process = context.Process(
                    target=_rank_main, args=(fn, rank, world_size, store, pg_timeout, results, args, backend),
                    kwargs=rank_process_kwargs(), daemon=True,
                )
                process.start()
                processes.append(process)
            yield processes, results
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
                process.join(5)


# What the fork server imports before it forks any rank: what every rank imports anyway.
_FORK_SERVER_PRELOAD = ("torch", "torch.distributed", "ddp_ring_hooks")


@functools.cache
def _rank_fork_server() -> forkserver.ForkServer:
    """This module's fork server (one per process, started with the first rank), apart from
    multiprocessing's shared one, whose preload list belongs to the user."""
    server = forkserver.ForkServer()
    server.set_forkserver_preload(list(_FORK_SERVER_PRELOAD))
    return server


class _RankPopen(popen_forkserver.Popen):
    """Starts a process from :func:`_rank_fork_server` rather than multiprocessing's shared
    server. The body is ``popen_forkserver.Popen._launch`` (the same from Python 3.10 to 3.13),
    which names the shared server's ``connect_to_new_process``; this names this module's."""

    def _launch(self, process_obj) -> None:
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        mp_context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            mp_context.set_spawning_popen(None)
        self.sentinel, w = _rank_fork_server().connect_to_new_process(self._fds)
        # As the standard library does: a duplicate of the data pipe's write end tells the
        # child that its parent is alive.
        _parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _RankProcess(mp_context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj):
        return _RankPopen(process_obj)


class _RankContext(mp_context.ForkServerContext):
    """multiprocessing's forkserver context, its processes started from this module's server."""

    Process = _RankProcess

    def set_forkserver_preload(self, module_names) -> None:  # the shared server's: not ours to change
        raise TypeError("the ranks' fork server preloads torch and ddp_ring_hooks; its list is fixed")


_RANK_CONTEXT = _RankContext()


def rank_context() -> _RankContext:
    """The multiprocessing context local ranks start from: a fork server with torch and this
    package imported (see the module docstring). Its ``Queue()`` and ``Process`` work as
    multiprocessing's; start a rank with :func:`_rank_main` and ``kwargs=rank_process_kwargs()``,
    or all of them with :func:`started_ranks`."""
    return _RANK_CONTEXT


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
    import torch
    import torch.distributed as dist

    if environment is not None:  # the caller's, not the fork server's (started earlier)
        os.environ.clear()
        os.environ.update(environment)
    # Per rank, as torchrun sets it (a caller's own LOCAL_RANK, under torchrun, is not this
    # rank's): on NCCL it picks the rank's GPU (_run_in_group).
    os.environ["LOCAL_RANK"] = str(rank)
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
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **init_kwargs)
    try:
        if "store" in init_kwargs:  # spawned ranks (under torchrun a fn's first collective waits instead)
            _wait_for_every_rank(init_kwargs["store"], init_kwargs["world_size"], timeout_s)
        return fn(*args)
    finally:
        dist.destroy_process_group()


def _wait_for_every_rank(store, world_size: int, timeout_s: float) -> None:
    """Return once every rank's ``init_process_group`` has returned.

    Gloo's full-mesh connect can return on one rank while a peer is still reading that rank's
    handshake; a rank whose ``fn`` is quick then exits and closes the socket under the peer,
    which fails with "Connection closed by peer" or waits out its timeout (about 1 start in
    80 on two busy cores). Counting the ranks through the store, not the group, leaves the
    group's own traffic (what some tests count) untouched."""
    key = "ddp_ring_hooks/ranks-in-group"
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every rank joined the group within {timeout_s:.0f}s")
        time.sleep(0.005)
