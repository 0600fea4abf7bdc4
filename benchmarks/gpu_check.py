"""One short check of the CUDA/NCCL path on a machine with one GPU; one line per check.

    python benchmarks/gpu_check.py [--log-dir runs/gpu_check] [--steps 8]

It starts an NCCL process group of world size 1 on cuda:0 (no torchrun needed) and trains a
small MLP through DDP with the hook, checking:

1. ``ring`` and ``native`` through the hook train exactly like DDP without a hook;
2. no host sync in the hook: ``torch.cuda.set_sync_debug_mode("error")`` around the steps
   after DDP's own first two (with the layout check and TensorBoard telemetry on);
3. CUDA-event telemetry reaches TensorBoard: per-bucket ``time_ms``, ``queue_ms``, ``bytes``,
   ``busbw_GBps`` read back from the event files;
4. ``native`` timing: NCCL's own all-reduce per bucket, from those events;
5. ``all_reduce(t, algorithm="auto")`` and ``"native"`` on NCCL;
6. the hook's own cost on the GPU (``--overhead-rounds``, INFO lines, no pass/fail): ms per
   step of one DDP model (6 x 4096², DDP's 25 MiB buckets: 16 of them) with no hook,
   ``native``, ``native`` with TensorBoard telemetry every step and every 10th step, and
   ``ring``, timed in alternating blocks. At world size 1 no bytes move, so what differs is
   the hook itself: Python per bucket, events, the hand-over to the communication stream, and
   the telemetry's writing (TensorBoard's event writer checksums every record in pure Python).

At world size 1 the schedules move no bytes (the executor only scales), so this checks the
plumbing (streams, events, futures, devices, no sync), not the point-to-point transfers: those
need 2 GPUs (``python -m pytest -m gpu tests/test_gpu_nccl.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist


def line(ok: bool, name: str, detail: str) -> bool:
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)
    return ok


def train(algorithm: str | None, steps: int, log_dir: str | None, strict_after: int = 2):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddp_ring_hooks

    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    net = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(6))).to(device)
    model = DDP(net, device_ids=[0], bucket_cap_mb=1)  # several buckets
    state = None
    if algorithm is not None:
        state = ddp_ring_hooks.register(model, algorithm=algorithm, log_dir=log_dir, check_layout_steps=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [torch.randn(64, 512, generator=torch.Generator().manual_seed(i)).to(device) for i in range(steps)]
    synced_error = None
    try:
        for index, batch in enumerate(batches):
            if index == strict_after:  # DDP's own first iterations (bucket rebuild) may sync
                torch.cuda.synchronize(device)
                torch.cuda.set_sync_debug_mode("error")
            optimizer.zero_grad()
            model(batch).square().mean().backward()
            optimizer.step()
    except RuntimeError as error:  # a sync under "error" mode raises here
        synced_error = str(error).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize(device)
    if state is not None:
        state.close()
    return [p.detach().cpu() for p in model.parameters()], synced_error


# arm -> (algorithm, log_every); no algorithm: DDP without a hook; no log_every: no telemetry
OVERHEAD_ARMS = {
    "no-hook": (None, None),
    "native": ("native", None),
    "native+telemetry": ("native", 1),
    "native+telemetry/10": ("native", 10),
    "ring": ("ring", None),
}


def overhead(rounds: int, steps: int, log_dir: str) -> dict[str, list[float]]:
    """Milliseconds per step of each arm, one block of ``steps`` per arm per round, in an order
    rotated every round (drift hits every arm alike)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddp_ring_hooks

    device = torch.device("cuda", 0)
    batch = torch.randn(256, 4096, device=device)
    arms = {}
    for arm, (algorithm, log_every) in OVERHEAD_ARMS.items():
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(*(torch.nn.Linear(4096, 4096) for _ in range(6))).to(device), device_ids=[0])
        state = None
        if algorithm is not None:
            telemetry = {"log_dir": os.path.join(log_dir, "overhead", str(log_every)), "log_every": log_every}
            state = ddp_ring_hooks.register(model, algorithm=algorithm, **(telemetry if log_every else {}))
        arms[arm] = (model, torch.optim.SGD(model.parameters(), lr=1e-4), state)

    def block(arm: str, count: int) -> None:
        model, optimizer, state = arms[arm]
        for _ in range(count):
            optimizer.zero_grad()
            model(batch).square().mean().backward()
            optimizer.step()
        if state is not None:
            # The writer's backlog is this arm's work: write it now, inside the timed block,
            # not during the next arm's block.
            state.telemetry.flush()

    for arm in OVERHEAD_ARMS:
        block(arm, 3)  # DDP's bucket rebuild, cuBLAS warm-up
    times: dict[str, list[float]] = {arm: [] for arm in OVERHEAD_ARMS}
    names = list(OVERHEAD_ARMS)
    for round_index in range(rounds):
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for arm in order:
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            block(arm, steps)
            torch.cuda.synchronize(device)
            times[arm].append((time.perf_counter() - start) / steps * 1e3)
    return times


def scalars(log_dir: str) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: {e.step: e.value for e in accumulator.Scalars(tag)} for tag in accumulator.Tags()["scalars"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-dir", default=None, help="TensorBoard runs (default: a temporary directory)")
    parser.add_argument("--steps", type=int, default=8, help="training steps per arm (default: 8)")
    parser.add_argument("--overhead-rounds", type=int, default=7,
                        help="rounds of the hook-cost timing, 20 steps per arm each; 0 skips it (default: 7)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("SKIP  no CUDA device here: run this on a machine with a GPU", flush=True)
        return 2
    log_root = args.log_dir or tempfile.mkdtemp(prefix="gpu_check_")
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    import ddp_ring_hooks

    results = [line(True, "nccl", f"world size 1 on {torch.cuda.get_device_name(0)}, torch {torch.__version__}")]
    plain, _ = train(None, args.steps, None)
    for algorithm in ("ring", "native"):
        log_dir = os.path.join(log_root, algorithm)
        params, sync_error = train(algorithm, args.steps, log_dir)
        same = all(torch.equal(a, b) for a, b in zip(params, plain))
        results.append(line(same, f"{algorithm} parity", "bit-identical to DDP without a hook" if same else "differs from DDP without a hook"))
        results.append(line(sync_error is None, f"{algorithm} no host sync",
                            f"steps 3-{args.steps} under set_sync_debug_mode('error')" if sync_error is None else sync_error))
        logged = scalars(log_dir)
        times = sorted(tag for tag in logged if tag.startswith("comm/bucket_") and tag.endswith("/time_ms"))
        last = max(logged[times[0]]) if times else None
        # At world size 1 a schedule moves nothing, so its communication takes 0 ms; NCCL's own
        # all-reduce still runs a kernel, which the events time.
        moves = algorithm == "native"
        ok = bool(times) and all(logged[t][last] > 0 if moves else logged[t][last] == 0 for t in times) and all(
            logged[t.replace("time_ms", "queue_ms")][last] >= 0 for t in times)
        detail = (f"{len(times)} buckets at step {last}: time_ms "
                  + ", ".join(f"{logged[t][last]:.3f}" for t in times)
                  + "; queue_ms " + ", ".join(f"{logged[t.replace('time_ms', 'queue_ms')][last]:.3f}" for t in times)) if times else "no bucket tags written"
        results.append(line(ok, f"{algorithm} TensorBoard (CUDA events)", detail))
        if algorithm == "native" and times:
            per_step = [sum(logged[t][s] for t in times if s in logged[t]) for s in sorted(logged[times[0]])]
            nbytes = sum(logged[t.replace("time_ms", "bytes")][last] for t in times)
            results.append(line(True, "native timing", f"{nbytes / 1e6:.1f} MB of buckets per step, NCCL time "
                                f"median {statistics.median(per_step):.3f} ms per step over {len(per_step)} steps"))
    for algorithm in ("native", "auto"):
        tensor = torch.arange(1 << 20, dtype=torch.float32, device="cuda:0")
        expected = tensor.clone()
        ddp_ring_hooks.all_reduce(tensor, algorithm=algorithm)
        same = torch.equal(tensor, expected)  # world size 1: the sum is the tensor itself
        results.append(line(same, f"all_reduce(algorithm={algorithm!r})", "on NCCL, 4 MB" if same else "wrong result"))
    if args.overhead_rounds:
        times = overhead(args.overhead_rounds, 20, log_root)
        base = statistics.median(times["no-hook"])
        for arm in OVERHEAD_ARMS:
            ratios = [t / b for t, b in zip(times[arm], times["no-hook"])]
            print(f"INFO  hook cost {arm:>19}: {statistics.median(times[arm]):7.3f} ms/step, "
                  f"x{statistics.median(ratios):.3f} of no-hook (rounds {min(ratios):.3f}-{max(ratios):.3f}; "
                  f"no-hook median {base:.3f} ms)", flush=True)
    dist.destroy_process_group()
    print(f"{sum(results)}/{len(results)} checks passed", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    raise SystemExit(main())
