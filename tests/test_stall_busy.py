"""A rank that is alive and elsewhere is *busy*, never *stalled*; a paused one is not judged.

Issue 32's case first, scaled down by half in time (the issue: busy 12 s with ``stall_after=2``,
``stall_timeout=8``): rank 0 of 3 gloo ranks is busy in Python for 6 s at step 5 (a
checkpoint, an evaluation) while ranks 1 and 2 wait in bucket 0, with ``stall_after=1``,
``stall_timeout=4`` and a group timeout of 60 s: busy for 6x ``stall_after`` and beyond
``stall_timeout``, as in the issue. Before this change ranks 1 and 2 called rank 0 stalled
after ``stall_after`` and every rank failed at ``stall_timeout``. Now:

1. busy in Python (its watchdog keeps reporting): "rank 0 is busy outside the all-reduce
   (iteration 4, 6 s)" once, no "stalled", no abort, training goes on with identical weights;
2. busy holding the GIL (its watchdog cannot report: a C call that never lets go, as
   pickling a large checkpoint does): the others see its process running on this host, so
   it is busy too, not silent;
3. the same two under ``with state.paused("checkpoint")``: no line at all;
4. busy for longer than the group's own timeout: ``stall_timeout`` did not abort, the
   backend's timeout did, and the error names the busy rank.

One launch walks through 1-3 (one phase per step); 4 is a second, short one. The reports
themselves (records, the chain, the message's size, the store's round trips) are checked
without ranks below.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import Counter

import pytest
import torch

from ddp_ring_hooks.telemetry.stall_report import RankRecord, Sightings, diagnose
from tests._dist import run_ranks

#: Half the issue's seconds (2 s and 8 s there): every phase keeps its ratio to them, and the
#: walk takes half as long. The watchdog polls every max(stall_after / 10, 0.1 s) = 0.1 s.
STALL_AFTER = 1.0
STALL_TIMEOUT = 4.0
PG_TIMEOUT = 60.0  # far behind stall_timeout: an abort before it would be the watchdog's
BUSY_RANK = 0
#: step (0-based iteration after which rank 0 is busy) -> (how, seconds, paused)
PHASES = {
    5: ("python", 6 * STALL_AFTER, False),  # the reproduction: 6x stall_after, beyond stall_timeout
    7: ("gil", 3 * STALL_AFTER, False),
    9: ("python", 3 * STALL_AFTER, True),
    11: ("gil", 3 * STALL_AFTER, True),
}
STEPS = 13


def _busy_in_python(seconds: float) -> None:
    """Python work for ``seconds``: the interpreter lets other threads run every few ms."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(1000))


def _hold_the_gil(seconds: float, *, prelude: float) -> float:
    """One C call that holds the GIL for at least ``seconds`` on a CPU (as pickling a large
    object does): ``sum`` over a ``range`` never returns to the interpreter loop. Calibrated
    on a short run first; returns how long it held. Before it, ``prelude`` seconds of Python
    (a checkpoint's dict being built): unpaused, the watchdog publishes "after the all-reduce"
    within half a poll (0.05 s here), and a hold that starts sooner leaves the others the record of the step
    before; ``paused()`` publishes before it returns, so under it the hold starts at once."""
    _busy_in_python(prelude)
    started = time.perf_counter()
    sum(range(2_000_000))
    rate = 2_000_000 / max(time.perf_counter() - started, 1e-6)
    started = time.perf_counter()
    while (left := seconds - (time.perf_counter() - started)) > 0:  # rarely twice: the machine got faster
        sum(range(int(rate * left * 1.3)))
    return time.perf_counter() - started


def _hear() -> list[tuple[float, str, str]]:
    """What the ``ddp_ring_hooks`` logger says from now on: (time, level, message)."""
    heard: list[tuple[float, str, str]] = []

    class Heard(logging.Handler):
        def emit(self, record):
            heard.append((time.time(), record.levelname, record.getMessage()))

    logging.getLogger("ddp_ring_hooks").addHandler(Heard())
    return heard


def _walk_through_busy_phases(rank: int, world_size: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    import ddp_ring_hooks

    heard = _hear()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                                        torch.nn.Linear(64, 32)), bucket_cap_mb=0.004)
    state = ddp_ring_hooks.register(model, algorithm="ring", stall_after=STALL_AFTER, stall_timeout=STALL_TIMEOUT)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    outcome: dict = {"rank": rank, "errors": [], "held": {}}
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for step in range(STEPS):
            generator = torch.Generator().manual_seed(100 * step + rank)
            try:
                model(torch.randn(8, 32, generator=generator)).square().mean().backward()
            except RuntimeError as error:
                outcome["errors"].append((step, str(error)))
                break
            optimizer.step()
            optimizer.zero_grad()
            if rank == BUSY_RANK and step in PHASES:
                how, seconds, paused = PHASES[step]
                started = time.perf_counter()
                with state.paused("checkpoint") if paused else _nothing():
                    if how == "gil":
                        _hold_the_gil(seconds, prelude=0.0 if paused else 0.2)
                    else:
                        _busy_in_python(seconds)
                outcome["held"][step] = time.perf_counter() - started
    state.close()
    outcome["heard"] = heard
    outcome["warned"] = [(str(w.message), w.category.__name__) for w in warned]
    outcome["params"] = torch.cat([p.detach().view(-1) for p in model.parameters()])
    return outcome


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture(scope="module")
def busy_walk():
    return run_ranks(_walk_through_busy_phases, 3, timeout=200, pg_timeout=PG_TIMEOUT)


@pytest.mark.timeout(260)
def test_a_rank_busy_outside_the_all_reduce_is_busy_not_stalled_and_nothing_aborts(busy_walk):
    for outcome in busy_walk:
        assert outcome["errors"] == [], f"rank {outcome['rank']} failed: {outcome['errors']}"
        stalled = [message for _, _, message in outcome["heard"] if "stalled" in message or "silent" in message]
        assert stalled == [], f"rank {outcome['rank']} called a busy rank stalled: {stalled}"
        assert not [message for message, category in outcome["warned"] if category == "RankStalledWarning"]
    held = busy_walk[BUSY_RANK]["held"]
    for step, (_, seconds, _) in PHASES.items():  # busy indeed, at least as long as planned
        assert held[step] >= seconds, (step, held)
    assert all(torch.equal(busy_walk[0]["params"], other["params"]) for other in busy_walk[1:])


@pytest.mark.timeout(260)
def test_a_busy_line_names_the_rank_once_per_wait_and_only_without_paused(busy_walk):
    for outcome in busy_walk[1:]:  # the waiting ranks
        lines = [message for _, _, message in outcome["heard"] if "busy outside the all-reduce" in message]
        by_step = {step: [line for line in lines if f"rank {BUSY_RANK} is busy outside the all-reduce (iteration {step}, "
                          in line] for step in PHASES}
        for step, (how, _, paused) in PHASES.items():
            if paused:
                assert by_step[step] == [], (step, lines)
            else:
                assert len(by_step[step]) == 1, f"rank {outcome['rank']}, {how} at step {step}: {lines}"
                assert by_step[step][0].startswith(f"rank {outcome['rank']}: bucket "), lines
                assert f" of iteration {step + 1} " in by_step[step][0].split(";")[0], lines
        assert sum(map(len, by_step.values())) == len(lines), lines
        print(f"rank {outcome['rank']}: {lines}")


# -- busy for longer than the group's own timeout: the backend ends the wait, not stall_timeout --

#: The group's timeout, short (the ranks meet at once: spawned together by the fork server), yet
#: twice stall_timeout; busy for longer than it, by enough for the bound below.
BACKSTOP_PG_TIMEOUT, BACKSTOP_STALL_TIMEOUT, BACKSTOP_BUSY = 6.0, 3.0, 10.0


def _busy_past_the_group_timeout(rank: int, world_size: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    import ddp_ring_hooks

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(16, 16))
    state = ddp_ring_hooks.register(model, stall_after=1.0, stall_timeout=BACKSTOP_STALL_TIMEOUT)
    outcome: dict = {"rank": rank}
    for step in range(4):
        started = time.monotonic()
        try:
            model(torch.randn(4, 16)).sum().backward()
        except RuntimeError as error:
            outcome.update(failed_after=time.monotonic() - started, error=str(error), step=step)
            break
        if rank == BUSY_RANK and step == 1:
            _busy_in_python(BACKSTOP_BUSY)
    outcome["failure"] = str(state.observation.watchdog.failure)
    state.close()
    return outcome


@pytest.mark.timeout(120)
def test_stall_timeout_never_aborts_for_a_busy_rank_the_groups_own_timeout_does_naming_it():
    waiting = run_ranks(_busy_past_the_group_timeout, 2, timeout=90, pg_timeout=BACKSTOP_PG_TIMEOUT)[1]
    assert waiting["failure"] == "None", waiting["failure"]  # the watchdog never timed out
    assert waiting["step"] == 2 and "RankStalledError" not in waiting["error"], waiting
    # Not at stall_timeout (3 s): at the group's own timeout (6 s), from gloo itself.
    assert BACKSTOP_PG_TIMEOUT - 1 < waiting["failed_after"] < BACKSTOP_BUSY - 1, waiting["failed_after"]
    assert "The stall watchdog had found: rank 1: bucket 0 of iteration 2" in waiting["error"], waiting["error"]
    assert f"rank {BUSY_RANK} is busy outside the all-reduce (iteration 1, " in waiting["error"], waiting["error"]
    print(f"busy past the group's timeout: rank 1 failed after {waiting['failed_after']:.1f} s "
          f"(stall_timeout={BACKSTOP_STALL_TIMEOUT:g} s, group timeout {BACKSTOP_PG_TIMEOUT:g} s)")


# -- without ranks: the verdicts, the clocks, the message's size, the store's round trips ------

def _record(rank: int, *, peer: int | None = None, reducing: bool = True, since: float = 88.0, reported: float = 99.9,
            **fields) -> RankRecord:
    what = {"doing": "all-reduce", "bucket": 0, "algorithm": "ring", "phase": "reduce-scatter"} if reducing else {
        "doing": "after the all-reduce"}
    if peer is not None:
        what.update(step_index=0, num_steps=2 * 63, peer=peer)
    return RankRecord(rank=rank, iteration=99, since=since, reported=reported, silent_after=1.0, **{**what, **fields})


@pytest.mark.fast
def test_the_verdicts_busy_paused_stalled_and_moving_data():
    me = _record(1, peer=0)
    busy = diagnose(me, {0: _record(0, reducing=False, since=35.0)}, world_size=2, now=100.0)
    assert busy.text.endswith("rank 0 is busy outside the all-reduce (iteration 99, 65 s)"), busy.text
    assert (busy.kind, busy.busy, busy.aborts) == ("busy", (0,), False)
    paused = diagnose(me, {0: _record(0, reducing=False, since=35.0, paused="checkpoint")}, world_size=2, now=100.0)
    assert paused.text.endswith("rank 0 is paused (checkpoint) outside the all-reduce (iteration 99, 65 s)")
    assert (paused.kind, paused.paused, paused.aborts) == ("paused", (0,), False)
    # Paused and silent (a checkpoint holding the GIL on another host): still no verdict ...
    quiet = _record(0, reducing=False, since=35.0, reported=90.0, paused="checkpoint")
    assert diagnose(me, {0: quiet}, world_size=2, now=100.0).kind == "paused"
    # ... unless the kernel shows it stopped; silent without a word from the kernel is stalled.
    stopped = diagnose(me, {0: RankRecord(**{**vars(quiet), "process": "stopped"})}, world_size=2, now=100.0)
    assert stopped.stalled == (0,) and stopped.aborts and "(its process is stopped (SIGSTOP, job control))" in stopped.text
    silent = diagnose(me, {0: _record(0, reducing=False, reported=90.0)}, world_size=2, now=100.0)
    assert silent.stalled == (0,) and silent.text.endswith("rank 0 is stalled")
    # Silent, but running on a CPU of this host: busy (holding the GIL), not stalled.
    running = diagnose(me, {0: _record(0, reducing=False, since=95.0, reported=96.0, process="running")},
                       world_size=2, now=100.0)
    assert running.kind == "busy" and "holding Python's GIL?" in running.text and not running.aborts
    # native, every rank in it and reporting: the data is moving (or the network stuck), no verdict.
    native = dict(algorithm="native", phase="all-reduce")
    moving = diagnose(_record(0, **native), {r: _record(r, **native) for r in (1, 2)}, world_size=3, now=100.0)
    assert moving.kind == "in flight" and not moving.aborts and moving.stalled == ()


@pytest.mark.fast
def test_the_verdict_reads_no_other_hosts_clock_only_how_long_a_records_number_stays_unchanged():
    """Records of a host whose monotonic clock is 10^6 s ahead of this one (a reboot apart),
    placed on this rank's clock: durations survive, and "silent" is N of *my* seconds."""
    sightings = Sightings()
    ahead = 1e6
    busy_for_20 = _record(0, reducing=False, since=ahead + 480.0, reported=ahead + 500.0, seq=7)
    placed = sightings.place({0: busy_for_20}, seen_at=100.0)[0]
    assert (placed.reported, placed.since) == (100.0, 80.0)
    me = _record(1, peer=0, since=95.0, reported=105.0)
    assert diagnose(me, {0: placed}, world_size=2, now=100.5).kind == "busy"
    # The same number seen again 2 s later: unchanged for 2 of my seconds (silent_after=1): stalled.
    again = sightings.place({0: busy_for_20}, seen_at=102.0)[0]
    assert again.reported == 100.0 and diagnose(me, {0: again}, world_size=2, now=102.0).stalled == (0,)
    # A new number resets it, whatever its clock says.
    newer = sightings.place({0: RankRecord(**{**vars(busy_for_20), "seq": 8, "reported": ahead - 5.0})}, seen_at=103.0)[0]
    assert newer.reported == 103.0 and diagnose(me, {0: newer}, world_size=2, now=103.5).kind == "busy"


@pytest.mark.fast
def test_at_64_ranks_the_message_names_the_chain_and_counts_the_rest_under_1_kb():
    # A ring: rank 5 waits for rank 4, ..., rank 0 for rank 63, which froze.
    records = {rank: _record(rank, peer=(rank - 1) % 64) for rank in range(63)}
    records[63] = _record(63, reducing=False, reported=80.0)
    finding = diagnose(records[5], {r: rec for r, rec in records.items() if r != 5}, world_size=64, now=100.0)
    assert finding.stalled == (63,) and finding.chain == (5, 4, 3, 2, 1, 0, 63), finding.chain
    assert finding.text.startswith("rank 5: bucket 0 of iteration 99 (reduce-scatter step 1/126) has waited 12 s for rank 4; "
                                   "rank 4 waits for rank 3; rank 3 waits for rank 2; ... (2 more waits) ...; "
                                   "rank 0 waits for rank 63; rank 63 has not reported for 20 s"), finding.text
    assert "of the other 57 ranks, 57 in the all-reduce" in finding.text and finding.text.endswith(": rank 63 is stalled")
    assert len(finding.text.encode()) < 1024, len(finding.text.encode())
    # native, 40 ranks silent: six named, the rest counted.
    native = dict(algorithm="native", phase="all-reduce")
    many = {rank: _record(rank, **native) for rank in range(64)}
    many.update({rank: _record(rank, reducing=False, reported=80.0) for rank in range(24, 64)})
    finding = diagnose(many[0], {r: rec for r, rec in many.items() if r}, world_size=64, now=100.0)
    assert len(finding.stalled) == 40 and len(finding.text.encode()) < 1024, (len(finding.text.encode()), finding.text)
    assert finding.text.endswith("rank 24, rank 25, rank 26, rank 27, rank 28, rank 29 are stalled (and 34 more ranks)")
    print(f"at p=64: {len(finding.text.encode())} bytes")


class _CountingStore:
    """A real store (``HashStore``) that counts the calls made on it: the round trips."""

    def __init__(self, store) -> None:
        self.store = store
        self.calls: Counter = Counter()

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return method(*args, **kwargs)

        return counted


@pytest.mark.fast
def test_a_report_at_64_ranks_is_one_store_round_trip_and_the_last_rank_to_close_deletes_every_key():
    import torch.distributed as dist

    from ddp_ring_hooks.telemetry.stall import _StoreBoard

    store = dist.HashStore()
    counting = _CountingStore(store)
    world = 64
    boards = [_StoreBoard(None, rank=rank, world_size=world, store=counting if rank == 0 else store, prefix="s")
              for rank in range(world)]
    try:
        for rank, board in enumerate(boards):
            board.publish(_record(rank, peer=(rank - 1) % world, seq=1))
        deadline = time.monotonic() + 10
        while not store.check([f"s/{rank}" for rank in range(world)]):
            assert time.monotonic() < deadline, "the boards did not publish"
            time.sleep(0.01)
        first = boards[0].read(timeout=5)  # once: are they all there? then the one multi_get
        assert sorted(first) == list(range(1, world)) and first[63].peer == 62
        counting.calls.clear()
        for report in range(3):
            assert boards[0].read(timeout=5) is not None
        assert counting.calls == Counter(multi_get=3), counting.calls  # one round trip per report
    finally:
        for board in boards[1:]:
            board.close()
        assert store.check(["s/0", "s/63"])  # 63 of 64 closed: the keys stay for the last reader
        boards[0].close()
    left = [key for key in [*(f"s/{rank}" for rank in range(world)), "s/closed/0"] if store.check([key])]
    assert left == [], left


# -- CUDA (NCCL): written against PyTorch's sources; this project's CI has no GPU ----------------


def _gpu_rank_busy(rank: int, world_size: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    import ddp_ring_hooks

    heard = _hear()
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(256, 256).to(device), device_ids=[rank])
    state = ddp_ring_hooks.register(model, stall_after=STALL_AFTER, stall_timeout=STALL_TIMEOUT)
    torch.cuda.set_sync_debug_mode("error")  # the watchdog only queries events: any host sync raises
    for step in range(8):
        model(torch.randn(32, 256, device=device)).square().mean().backward()
        if rank == BUSY_RANK and step in (2, 5):  # the others' buckets wait on the GPU meanwhile
            with state.paused("checkpoint") if step == 5 else _nothing():
                _busy_in_python(3 * STALL_AFTER)
    torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize(device)
    failure = state.observation.watchdog.failure
    state.close()
    return {"heard": [message for _, _, message in heard], "failure": None if failure is None else str(failure)}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs and NCCL; this machine has none (CPU-only CI)")
@pytest.mark.timeout(200)
def test_on_nccl_a_busy_rank_is_busy_from_event_queries_and_a_paused_one_is_not_named():
    waiting = run_ranks(_gpu_rank_busy, 2, timeout=150, pg_timeout=PG_TIMEOUT, backend="nccl")[1]
    assert waiting["failure"] is None, waiting["failure"]
    assert not [line for line in waiting["heard"] if "stalled" in line], waiting["heard"]
    busy = [line for line in waiting["heard"] if f"rank {BUSY_RANK} is busy outside the all-reduce (iteration 2, " in line]
    assert len(busy) == 1 and not [line for line in waiting["heard"] if "(iteration 5, " in line], waiting["heard"]
