"""Run a function on N real gloo ranks, each in its own process, and collect the results.

``run_ranks(fn, world_size, *args)`` spawns the ranks, joins them through a FileStore, calls
``fn(rank, world_size, *args)`` in each and returns the list of return values by rank. If a
rank raises, the error is re-raised here with that rank's traceback. If the ranks do not all
finish within ``timeout`` seconds (a deadlock), every rank is killed and the test fails with
``TimeoutError``: nothing in the suite can hang CI.

It is the library's own spawner (:func:`ddp_ring_hooks.launch.spawn_ranks`, also behind the
benchmarks' ``--nproc``), so the tests exercise the code users run.
``fn`` must be a module-level function (spawned processes import it by name).
"""

from __future__ import annotations

from ddp_ring_hooks.launch import RankFailed, _rank_main, rank_context, rank_process_kwargs, spawn_ranks

run_ranks = spawn_ranks

__all__ = ["RankFailed", "_rank_main", "rank_context", "rank_process_kwargs", "run_ranks"]
