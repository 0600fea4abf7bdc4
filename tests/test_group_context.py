"""One context per process group (``runtime/group_context.py``), on real gloo ranks: abort lets
every blocked thread go, close gives back every socket and thread it made, and a hook on a
subgroup makes nothing the other ranks must match.

1. **Abort.** A state is built with every side resource a CPU group gets (the 2-rank ring's
   pair transport, two bucket lanes, the exchange worker, the link probe's group); rank 1 goes
   silent and rank 0 leaves a thread blocked in a transfer on each of them: a schedule on lane 0
   (the group), a receive on the pair's own transport on lane 1 (the transport an abort once
   missed), a receive on the probe group on lane 2, a receive on the exchange worker.
   ``abort()`` must end all four (each job ended with an error, asserted,
   not just joined), and rank 1 must see its own transfers with rank 0 fail at once.
2. **Teardown.** Around a state that trained a few steps: after ``close()`` the rank's threads
   and open sockets are what they were before it was built; while it lives, the ring at 2 ranks
   added exactly one socket (its pair) and ``native`` none (one with ``links=True``: the link
   probe's group), and no thread but the watchers'.
3. **A subgroup.** A hook on ranks 1..3 of 4 with every side resource, rank 0 never building
   one; then a hook on all 4 ranks with pair transports that include rank 0: no hang (a side
   group made with ``dist.new_group`` on the subgroup's members would have given rank 0 other
   names for the next ones than the others).

CUDA and mixed ``"cpu:gloo,cuda:nccl"`` groups: the same abort on NCCL's communicators, marked
``gpu`` (skipped without 2 GPUs).
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_ranks
from tests.conftest import Net

#: How long an aborted transfer may take to let its thread go.
LET_GO_S = 10.0


def _sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # closed while listing (the listing's own fd)
            pass
    return count


def _threads() -> list[str]:
    return sorted(thread.name for thread in threading.enumerate())


def _ended(futures: dict, timeout: float) -> dict:
    """Each job's outcome once its Future completed: its error's text, ``None`` for a value,
    ``"still blocked"`` when it did not complete within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not all(future.done() for future in futures.values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    outcome = {}
    for name, future in futures.items():
        if not future.done():
            outcome[name] = "still blocked"
            continue
        try:
            future.wait()
            outcome[name] = None
        except RuntimeError as error:
            outcome[name] = str(error)
    return outcome


def _abort_everything(rank: int, world_size: int) -> dict:
    import ddp_ring_hooks
    from ddp_ring_hooks.runtime import run_schedule
    from ddp_ring_hooks.runtime.lanes import EXCHANGE, bucket_lane
    from ddp_ring_hooks.schedules import checked_schedule

    torch.set_num_threads(1)
    store = dist.distributed_c10d._get_default_store()
    state = ddp_ring_hooks.HookState(algorithm="ring", spread_every=1, concurrent_buckets=2)
    group = state.group
    context = state.plan.context(group)
    report = {"pair_peers": sorted(context.upward())}
    probe = context.probe_group()  # the link probe's side group (native's links), collective
    if rank == 1:  # silent: it posts nothing until rank 0 has aborted
        store.wait(["aborted"])
        seen = {}
        for name, transport, source in (("group", group, 0), ("pair", context.upward()[0], 0), ("probe", probe, 0)):
            try:
                transport.recv([torch.empty(4)], source if transport is group else 0, 0).wait()
                seen[name] = None
            except RuntimeError as error:
                seen[name] = str(error)
        report["peer_saw"] = seen
        state.close()
        return report
    pair = context.upward()[1]
    schedule = checked_schedule("ring", 2)
    futures = {
        "lane 0 (a schedule, on the group)": context.worker(bucket_lane(0)).submit(
            lambda: run_schedule(schedule, torch.ones(1000), group=group, context=context)),
        "lane 2 (the probe group)": context.worker(bucket_lane(2)).submit(
            lambda: probe.recv([torch.empty(4)], 1, 0).wait()),
        "lane 1 (the pair's transport)": context.worker(bucket_lane(1)).submit(
            lambda: pair.recv([torch.empty(4)], 1, bucket_lane(1).tag).wait()),
        "exchange (the group)": context.worker(EXCHANGE).submit(
            lambda: group.recv([torch.empty(4)], 1, EXCHANGE.tag).wait()),
    }
    time.sleep(0.5)  # every job blocked in its wait
    report["blocked_before"] = [name for name, future in futures.items() if not future.done()]
    started = time.monotonic()
    context.abort(peer=1)
    report["outcome"] = _ended(futures, LET_GO_S)
    report["let_go_s"] = time.monotonic() - started
    report["aborted"] = context.aborted
    store.set("aborted", "1")
    if "still blocked" not in report["outcome"].values():  # close joins the workers: only when they can end
        state.close()
        report["threads_left"] = [name for name in _threads() if name.startswith("ddp-ring-hooks-comm")
                                  or name == "ddp-ring-hooks-exchange"]
    return report


@pytest.mark.timeout(120)
def test_abort_lets_every_thread_blocked_in_a_side_resource_go():
    rank0, rank1 = run_ranks(_abort_everything, 2, timeout=90)
    assert rank0["pair_peers"] == [1] and rank1["pair_peers"] == [0]  # the 2-rank ring's pair was made
    assert len(rank0["blocked_before"]) == 4, rank0
    for name, outcome in rank0["outcome"].items():
        assert outcome is not None and outcome != "still blocked", (name, rank0["outcome"])
    assert rank0["let_go_s"] < LET_GO_S and rank0["aborted"]
    assert rank0["threads_left"] == [], rank0
    # What the other rank sees: its transfers with the aborted rank fail at once, on both transports.
    assert all(text is not None for text in rank1["peer_saw"].values()), rank1


def _teardown(rank: int, world_size: int, algorithm: str, links: bool = False) -> dict:
    import ddp_ring_hooks
    from torch.nn.parallel import DistributedDataParallel

    from ddp_ring_hooks.runtime import context_of
    from ddp_ring_hooks.runtime.lanes import EXCHANGE

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DistributedDataParallel(Net(), bucket_cap_mb=0.01)  # ~10 KB buckets: several, both lanes
    before = {"sockets": _sockets(), "threads": _threads()}
    state = ddp_ring_hooks.register(model, algorithm=algorithm, spread_every=1, concurrent_buckets=2, links=links)
    for _ in range(3):
        model(torch.randn(8, 32)).square().mean().backward()
    state.telemetry.flush()
    context_of(state.group).worker(EXCHANGE).submit(lambda: None).wait()  # the steps' exchanges (the probe) done
    alive = {"sockets": _sockets(), "threads": _threads()}
    state.close()
    deadline = time.monotonic() + 5  # a closed socket's fd goes as its last reference does
    while _sockets() != before["sockets"] and time.monotonic() < deadline:
        time.sleep(0.05)
    after = {"sockets": _sockets(), "threads": _threads()}
    return {"before": before, "alive": alive, "after": after}


#: Threads of the watchers (started by the observation, not by the group's context).
WATCHER_THREADS = {"ddp-ring-hooks-stall", "ddp-ring-hooks-stall-store", "ddp-ring-hooks-telemetry",
                   "ddp-ring-hooks-exchange"}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("algorithm, links, sockets_added", [("ring", False, 1), ("native", False, 0), ("native", True, 1)])
def test_close_gives_back_every_socket_and_thread(algorithm, links, sockets_added):
    # native with links=True: the link probe's side group (one socket at 2 ranks), closed with the context
    for result in run_ranks(_teardown, 2, algorithm, links, timeout=120):
        before, alive, after = result["before"], result["alive"], result["after"]
        assert alive["sockets"] - before["sockets"] == sockets_added, result  # ring at 2 ranks: its pair
        added = set(alive["threads"]) - set(before["threads"])
        if algorithm == "native":
            assert added <= WATCHER_THREADS, added  # no lane: native runs on the hook thread
        else:
            assert {"ddp-ring-hooks-comm-0", "ddp-ring-hooks-comm-1"} <= added, added
        assert after == before, result


def _train(model, steps: int = 3) -> list[torch.Tensor]:
    for _ in range(steps):
        model(torch.randn(8, 32)).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def _hook_on_ranks_1_to_3(rank: int, world_size: int) -> dict:
    import ddp_ring_hooks
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    sub = dist.new_group([1, 2, 3])  # every rank makes it (new_group's rule); only 1..3 use it
    report = {}
    if rank > 0:
        torch.manual_seed(0)
        model = DistributedDataParallel(Net(), bucket_cap_mb=0.01, process_group=sub)
        # halving-doubling at 3 ranks: group ranks 1 and 2 exchange (a pair transport), two lanes,
        # the exchange worker, the stall watchdog's board
        state = ddp_ring_hooks.register(model, algorithm="halving_doubling", spread_every=1, concurrent_buckets=2)
        report["sub_pairs"] = sorted(state.plan.context(sub).upward())
        report["sub_grads"] = _train(model)
        state.close()
    # Then every rank: a hook on the whole group, with pair transports that include rank 0. Had
    # the subgroup's hook made a group that rank 0 must match (dist.new_group over its members,
    # whose name counts each process's groups), rank 0 would name this one's side groups
    # differently from the others, and wait for ever.
    torch.manual_seed(1)
    model = DistributedDataParallel(Net(), bucket_cap_mb=0.01)
    state = ddp_ring_hooks.register(model, algorithm="halving_doubling", spread_every=1, concurrent_buckets=2)
    report["pairs"] = sorted(state.plan.context(None).upward())
    report["grads"] = _train(model)
    state.close()
    return report


@pytest.mark.timeout(150)
def test_a_hook_on_a_subgroup_makes_nothing_the_other_ranks_must_match():
    reports = run_ranks(_hook_on_ranks_1_to_3, 4, timeout=120)
    assert [r["sub_pairs"] for r in reports[1:]] == [[1], [0, 2], [1]], reports  # rank 1 of sub (global 2): both
    assert [r["pairs"] for r in reports] == [[1, 2], [0, 3], [0, 3], [1, 2]]  # halving-doubling at 4
    for other in reports[1:]:
        assert all(torch.equal(a, b) for a, b in zip(reports[0]["grads"], other["grads"]))
    for other in reports[2:]:
        assert all(torch.equal(a, b) for a, b in zip(reports[1]["sub_grads"], other["sub_grads"]))


# -- CUDA: NCCL's communicators (marked gpu; skipped without 2 GPUs) ------------------------------


def _abort_on_cuda(rank: int, world_size: int, mixed: bool) -> dict:
    import ddp_ring_hooks
    from ddp_ring_hooks.runtime.lanes import bucket_lane

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = dist.distributed_c10d._get_default_store()
    group = dist.new_group([0, 1], backend="cpu:gloo,cuda:nccl") if mixed else dist.group.WORLD
    state = ddp_ring_hooks.HookState(group, algorithm="ring", device=device)
    context = state.plan.context(group)
    side = context.cuda_lane(device)
    report = {}
    if rank == 1:
        store.wait(["aborted"])
        state.close()
        return report
    futures = {}
    # A host thread blocked in a transfer on the dedicated group: a receive nobody sends,
    # waited for on the host (synchronize), on the lane's worker.
    def blocked_on_gpu():
        received = torch.empty(1 << 20, device=device)
        side.group.recv([received], 1, 0)
        torch.cuda.synchronize(device)

    futures["the dedicated NCCL group"] = side.worker.submit(blocked_on_gpu)
    if mixed:  # and a CPU transfer on the group's gloo side, which NCCL's abort does not reach
        futures["the mixed group's gloo side"] = context.worker(bucket_lane(0)).submit(
            lambda: group.recv([torch.empty(4)], 1, 0).wait())
    time.sleep(1.0)
    report["blocked_before"] = [name for name, future in futures.items() if not future.done()]
    context.abort(peer=1)
    report["outcome"] = _ended(futures, 30.0)
    store.set("aborted", "1")
    return report


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs and NCCL; this machine has none (CPU-only CI)")
@pytest.mark.timeout(200)
@pytest.mark.parametrize("mixed", [False, True], ids=["nccl", "cpu:gloo,cuda:nccl"])
def test_abort_on_cuda_lets_the_waiting_threads_go(mixed):
    rank0, _ = run_ranks(_abort_on_cuda, 2, mixed, timeout=150, backend="nccl")
    assert len(rank0["blocked_before"]) == (2 if mixed else 1), rank0
    for name, outcome in rank0["outcome"].items():
        assert outcome != "still blocked", (name, rank0["outcome"])


# -- what prepare makes, from the schedules alone (no process) ------------------------------------


@pytest.mark.fast
def test_the_two_way_pairs_of_an_algorithm_do_not_change_with_the_buffer():
    """The hook prepares its pairs once, from the smallest size's schedule; every other size's
    schedule (deeper pipelines) must need no other pair."""
    from ddp_ring_hooks.runtime.group_context import two_way_pairs
    from ddp_ring_hooks.schedules import algorithm_examples, build_schedule, resolve_options

    for world_size in range(2, 13):
        for algorithm, options in algorithm_examples(world_size, scheduled_only=True):
            sizes = {
                two_way_pairs([build_schedule(algorithm, world_size, **resolve_options(algorithm, options, nbytes=n))])
                for n in (0, 1 << 10, 1 << 20, 25 << 20, 1 << 30)
            }
            assert len(sizes) == 1, (algorithm, world_size, options, sizes)


@pytest.mark.fast
def test_the_ring_beyond_two_ranks_and_native_need_no_pair():
    from ddp_ring_hooks.runtime.group_context import two_way_pairs
    from ddp_ring_hooks.schedules import build_schedule

    assert two_way_pairs([build_schedule("ring", 2)]) == {(0, 1)}
    assert all(two_way_pairs([build_schedule("ring", p)]) == frozenset() for p in range(3, 65))
    assert two_way_pairs([]) == frozenset()  # native: no schedule
    # a tree reduces up and broadcasts down: every edge both ways
    assert two_way_pairs([build_schedule("tree", 4, segments=1)]) == {(0, 1), (0, 2), (2, 3)}
