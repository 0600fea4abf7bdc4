"""Long runs: memory and threads stay flat, and the telemetry reaches the disk however it ends.

1. Two gloo ranks make 10,000 hook calls (small buckets, one per iteration) with TensorBoard
   telemetry on. Resident memory (``/proc/self/statm``) after a warm-up must not grow, the
   number of threads must not change, and ``state.close()`` must stop the worker thread.
2. A training script that dies from an uncaught exception, without ``state.close()``, must
   still leave its TensorBoard events on disk, up to the last logged step.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from ddp_ring_hooks.telemetry import TelemetryOptions
from tests._dist import run_ranks

CALLS = 10_000
LOG_EVERY = 10
WARM_UP = 2_000
SAMPLE_EVERY = 1_000
MAX_RSS_GROWTH = 4 * 2**20  # bytes after the warm-up; a leak of 500 B per call would be 4 MB


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _make_many_calls(rank: int, world_size: int, log_dir: str) -> dict:
    from ddp_ring_hooks import HookState

    state = HookState(log_dir=log_dir, log_every=LOG_EVERY)
    bucket = torch.ones(64)
    rss, threads = {}, {}
    for call in range(1, CALLS + 1):
        state.reduce_bucket(bucket, is_last=True).wait()
        if call % SAMPLE_EVERY == 0:
            rss[call], threads[call] = _rss_bytes(), threading.active_count()
    state.close()
    worker_names = [t.name for t in threading.enumerate() if t.name.startswith("ddp-ring-hooks")]
    return {
        "rss": rss, "threads": threads, "after_close": worker_names,
        "iteration": state.iteration, "average": bucket, "dropped": state.telemetry.dropped,
    }


@pytest.mark.timeout(240)
def test_ten_thousand_hook_calls_keep_memory_and_threads_flat(tmp_path):
    outcomes = run_ranks(_make_many_calls, 2, str(tmp_path), timeout=220)
    for rank, outcome in enumerate(outcomes):
        assert outcome["iteration"] == CALLS
        assert torch.equal(outcome["average"], torch.ones(64))  # the average of ones, every time
        rss = outcome["rss"]
        growth = max(rss.values()) - rss[WARM_UP]
        assert growth < MAX_RSS_GROWTH, f"rank {rank}: RSS grew {growth / 2**20:.1f} MiB: {rss}"
        assert len(set(outcome["threads"].values())) == 1, f"rank {rank}: threads {outcome['threads']}"
        assert outcome["after_close"] == [], f"rank {rank}: threads left after close"
    # The writer's queue (TelemetryOptions.capacity, 1024 steps) holds every logged step of this
    # run (1,000): none may be dropped, and every one, the last included, is on disk.
    assert CALLS // LOG_EVERY <= TelemetryOptions().capacity
    assert [outcome["dropped"] for outcome in outcomes] == [0, 0]
    assert _logged_steps(tmp_path) - {0} == set(range(LOG_EVERY, CALLS + 1, LOG_EVERY))


_DIES_WITH_AN_EXCEPTION = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    import ddp_ring_hooks
    log_dir, store = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
    model = DistributedDataParallel(torch.nn.Linear(4, 4))
    ddp_ring_hooks.register(model, log_dir=log_dir)
    for step in range(5):
        model(torch.randn(2, 4)).sum().backward()
    raise RuntimeError("training crashed after 5 steps")
    """
)


@pytest.mark.timeout(90)
def test_tensorboard_events_reach_disk_after_an_uncaught_exception(tmp_path):
    log_dir = tmp_path / "runs"
    run = subprocess.run(
        [sys.executable, "-c", _DIES_WITH_AN_EXCEPTION, str(log_dir), str(tmp_path / "store")],
        capture_output=True, text=True, timeout=80,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert run.returncode == 1 and "training crashed after 5 steps" in run.stderr, run.stderr[-3000:]
    steps = _logged_steps(log_dir) - {0}  # step 0: the run's settings, written at the start
    assert steps == {1, 2, 3, 4, 5}


def _logged_steps(log_dir: Path) -> set[int]:
    """Steps of every scalar in every event file under ``log_dir``."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    steps = set()
    for path in log_dir.rglob("events.out.tfevents.*"):
        for event in EventFileLoader(str(path)).Load():
            if event.HasField("summary") and event.summary.value:
                steps.add(event.step)
    return steps
