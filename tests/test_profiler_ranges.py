"""Our communication in the PyTorch profiler: ranges per bucket and phase, recorded from the
communication workers, read back from an exported profiler trace on real gloo ranks."""

from __future__ import annotations

import json
import os

from ._dist import run_ranks


def _profile_steps(rank: int, world_size: int, directory: str):
    import threading

    import torch
    from torch._C._profiler import _ExperimentalConfig
    from torch.nn.parallel import DistributedDataParallel

    import ddp_ring_hooks
    from ddp_ring_hooks.telemetry.profiling import profiler_active

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)),
                                    bucket_cap_mb=0.001)
    state = ddp_ring_hooks.register(model, algorithm="ring")

    def step():
        model(torch.randn(4, 16)).sum().backward()

    step()  # DDP's first step (provisional buckets), outside the profiler
    assert not profiler_active()
    path = os.path.join(directory, f"profile.rank{rank}.json")
    config = _ExperimentalConfig(profile_all_threads=True)  # the workers are threads of their own
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], experimental_config=config) as prof:
        for _ in range(2):
            step()
        state.close()  # every bucket done before the profiler stops
    prof.export_chrome_trace(path)
    with open(path) as file:
        events = [e for e in json.load(file)["traceEvents"] if e.get("ph") == "X"]
    ours = [(e["name"], e["tid"], e["ts"], e["dur"]) for e in events if e["name"].startswith("ddp_ring_hooks/")]
    return ours, threading.get_native_id(), profiler_active()


def test_bucket_and_phase_ranges_come_from_the_comm_workers(tmp_path):
    results = run_ranks(_profile_steps, 2, str(tmp_path), timeout=180)
    for ours, main_tid, active_after in results:
        assert not active_after
        names = {name for name, *_ in ours}
        assert {"ddp_ring_hooks/bucket_0", "ddp_ring_hooks/bucket_0/reduce-scatter",
                "ddp_ring_hooks/bucket_0/all-gather"} <= names, names
        assert {tid for _, tid, _, _ in ours} - {main_tid}, "ranges on a worker thread"
        buckets = [(tid, ts, ts + dur) for name, tid, ts, dur in ours if name.count("/") == 1]
        # Every phase range sits inside a bucket range of its own thread.
        for name, tid, ts, dur in ours:
            if name.count("/") == 2:
                assert any(t == tid and start <= ts and ts + dur <= end + 1 for t, start, end in buckets), name
        # Two profiled steps: each bucket's phases twice.
        assert sum(name == "ddp_ring_hooks/bucket_0/reduce-scatter" for name, *_ in ours) == 2
