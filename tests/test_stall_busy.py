"""A rank that is alive and elsewhere is *busy*, never *stalled*; a paused one is not judged.

Issue 32's case first: rank 0 of 3 gloo ranks is busy in Python for 12 s at step 5 (a
checkpoint, an evaluation) while ranks 1 and 2 wait in bucket 0, with ``stall_after=2``,
``stall_timeout=8`` and a group timeout of 60 s. Before this change ranks 1 and 2 called
rank 0 stalled after 2 s and every rank failed at 8 s. Now:

1. busy in Python (its watchdog keeps reporting): "rank 0 is busy outside the all-reduce
   (iteration 4, 12 s)" once, no "stalled", no abort, training goes on with identical weights;
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
import os
import time
import warnings

import pytest
import torch

from tests._dist import run_ranks

STALL_AFTER = 2.0
STALL_TIMEOUT = 8.0
PG_TIMEOUT = 60.0  # far behind stall_timeout: an abort before it would be the watchdog's
BUSY_RANK = 0
#: step (0-based iteration after which rank 0 is busy) -> (how, seconds, paused)
PHASES = {
    5: ("python", 12.0, False),  # the reproduction: 6x stall_after, beyond stall_timeout
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


def _hold_the_gil(seconds: float) -> float:
    """One C call that holds the GIL for at least ``seconds`` on a CPU (as pickling a large
    object does): ``sum`` over a ``range`` never returns to the interpreter loop. Calibrated
    on a short run first; returns how long it held. Before it, a fifth of a second of Python
    (a checkpoint's dict being built): the watchdog publishes "after the all-reduce" within a
    poll, and a hold that starts sooner leaves the others the record of the step before."""
    _busy_in_python(0.2)
    started = time.perf_counter()
    sum(range(2_000_000))
    rate = 2_000_000 / max(time.perf_counter() - started, 1e-6)
    started = time.perf_counter()
    sum(range(int(rate * seconds * 1.3)))  # a margin: the machine may be faster now
    return time.perf_counter() - started


def _walk_through_busy_phases(rank: int, world_size: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    import ddp_ring_hooks

    heard: list[tuple[float, str, str]] = []

    class Heard(logging.Handler):
        def emit(self, record):
            heard.append((time.time(), record.levelname, record.getMessage()))

    logging.getLogger("ddp_ring_hooks").addHandler(Heard())
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
                        _hold_the_gil(seconds)
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

BACKSTOP_PG_TIMEOUT, BACKSTOP_STALL_TIMEOUT, BACKSTOP_BUSY = 8.0, 3.0, 14.0


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
    # Not at stall_timeout (3 s): at the group's own timeout (8 s), from gloo itself.
    assert BACKSTOP_PG_TIMEOUT - 1 < waiting["failed_after"] < BACKSTOP_BUSY - 1, waiting["failed_after"]
    assert "The stall watchdog had found: rank 1: bucket 0 of iteration 2" in waiting["error"], waiting["error"]
    assert f"rank {BUSY_RANK} is busy outside the all-reduce (iteration 1, " in waiting["error"], waiting["error"]
    print(f"busy past the group's timeout: rank 1 failed after {waiting['failed_after']:.1f} s "
          f"(stall_timeout={BACKSTOP_STALL_TIMEOUT:g} s, group timeout {BACKSTOP_PG_TIMEOUT:g} s)")
