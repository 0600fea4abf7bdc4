"""A stalled rank never hangs anyone silently: the others name it, fail at the timeout, resume after a thaw.

On real gloo ranks (3, one of them frozen with SIGSTOP by itself, thawed with SIGCONT by the
test), with ``stall_after`` and ``stall_timeout`` of a few seconds:

1. one launch of the ring walks through the cases in order: a rank slower than
   ``stall_after`` per bucket but progressing (nothing reported), a freeze thawed before the
   timeout (warnings naming the frozen rank, "resumed", training goes on with identical
   weights on every rank), a freeze never thawed (errors naming it from ``backward()``, later
   buckets refused at once, ``close()`` returns and the process exits);
2. ``torchrun --max-restarts=1`` with ``native`` (gloo's own all-reduce: no peer to follow, the
   store names the rank): after a stall-timeout the job restarts from its checkpoint and ends
   with the weights of an uninterrupted run;
3. on the emulated lab, a host's link pulled mid-training: the others name that host.

The diagnosis itself (who waits for whom) is pure and tested on records without ranks.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import queue
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from ddp_ring_hooks.launch import _rank_main, rank_context, rank_process_kwargs
from ddp_ring_hooks.runtime import ExecutionObserver
from ddp_ring_hooks.telemetry.stall_report import RankRecord, diagnose

STALL_AFTER = 2.0
STALL_TIMEOUT = 6.0
PG_TIMEOUT = 60.0  # the group's own: far behind stall_timeout, so any failure in time is the watchdog's
WORLD_SIZE = 3  # the ring's walk: a chain of waits (rank 1 waits for rank 0, which waits for rank 2)
VICTIM = WORLD_SIZE - 1  # the rank that freezes is always the last one
SLOW_RANK = 1
#: The iterations of the walk (DDP rebuilds its buckets after iteration 0: start after it).
SLOW_ITERATION, THAW_ITERATION, FREEZE_ITERATION = 2, 4, 7
THAW_AFTER = STALL_AFTER + 1.5  # seconds frozen before the test sends SIGCONT (the others then waited ~4 s)
#: For the torchrun and the lab cases, which freeze or cut a rank for good and wait for nothing
#: slow: half the walk's seconds, so each ends sooner (the walk keeps room for its slow rank and
#: its thaw, which must come between stall_after and stall_timeout).
SHORT_STALL_AFTER, SHORT_STALL_TIMEOUT = 1.0, 3.0


# -- the diagnosis, on records ---------------------------------------------------------------


def _record(rank: int, *, now: float = 100.0, age: float = 0.1, peer: int | None = None, reducing: bool = True,
            since: float = 88.0, **fields) -> RankRecord:
    described = {"doing": "all-reduce", "bucket": 3, "algorithm": "ring", "phase": "reduce-scatter"} if reducing else {
        "doing": "forward"}
    if peer is not None:
        described.update(step_index=0, num_steps=4, peer=peer)
    return RankRecord(rank=rank, iteration=20, since=since, reported=now - age, silent_after=1.5,
                      **{**described, **fields})


@pytest.mark.fast
def test_the_chain_of_waits_ends_at_the_silent_rank():
    me = _record(0, peer=2)
    others = {1: _record(1, peer=0), 2: _record(2, reducing=False, age=12.0)}
    finding = diagnose(me, others, world_size=3, now=100.0)
    assert finding.text == (
        "rank 0: bucket 3 of iteration 20 (reduce-scatter step 1/4) has waited 12 s for rank 2; rank 1 waits for "
        "rank 0; rank 2 has not reported for 12 s, since iteration 20 (forward): rank 2 is stalled"
    )
    assert (finding.stalled, finding.chain, finding.answered) == ((2,), (0, 2), True)
    # From rank 1, the chain goes through rank 0.
    assert diagnose(others[1], {0: me, 2: others[2]}, world_size=3, now=100.0).chain == (1, 0, 2)


@pytest.mark.fast
def test_a_live_rank_that_never_comes_to_the_all_reduce_is_named_busy_and_a_cycle_is_not_a_stall():
    busy = _record(2, reducing=False, doing="forward", since=70.0)  # reports, but stays in its forward
    finding = diagnose(_record(0, peer=2), {1: _record(1, peer=0), 2: busy}, world_size=3, now=100.0)
    # Alive and elsewhere is busy, never stalled (issue 32), and stall_timeout may not abort for it.
    assert finding.text.endswith(
        "rank 2 has been in iteration 20 (forward) for 30 s: rank 2 is busy outside the all-reduce (iteration 20, 30 s)")
    assert (finding.kind, finding.busy, finding.stalled, finding.aborts) == ("busy", (2,), (), False)
    cycle = diagnose(_record(0, peer=1), {1: _record(1, peer=0)}, world_size=2, now=100.0)
    assert cycle.stalled == () and not cycle.aborts
    assert "ranks 0, 1 wait for each other in a cycle, each reporting: a transfer in flight" in cycle.text


@pytest.mark.fast
def test_a_wait_without_a_peer_blames_whoever_is_not_in_it_and_a_silent_store_is_said():
    native = dict(algorithm="native", phase="all-reduce")
    me = _record(0, **native)
    finding = diagnose(me, {1: _record(1, **native), 2: _record(2, reducing=False, age=9.0)}, world_size=3, now=100.0)
    assert finding.text.startswith("rank 0: bucket 3 of iteration 20 (native all-reduce) has waited 12 s in it; rank 1 waits in the all-reduce")
    assert finding.stalled == (2,) and finding.text.endswith(": rank 2 is stalled")
    everyone = diagnose(me, {1: _record(1, **native), 2: _record(2, **native)}, world_size=3, now=100.0)
    assert everyone.stalled == () and "the transfers themselves are stuck" in everyone.text
    cut_off = diagnose(_record(2, peer=0), None, world_size=3, now=100.0)
    assert not cut_off.answered and "the store did not answer" in cut_off.text and "rank 0, or this rank's own network" in cut_off.text
    # A rank that has not reported in this attempt (a record left by the attempt before a restart).
    stale = diagnose(_record(0, peer=2, attempt=1), {1: _record(1, peer=0, attempt=1), 2: _record(2, peer=0)},
                     world_size=3, now=100.0)
    assert "rank 2 has not reported:" in stale.text + ":" and stale.stalled == (2,)


@pytest.mark.fast
def test_a_record_survives_its_json():
    record = _record(1, peer=0)
    assert RankRecord.from_json(record.to_json()) == record


# -- the options -----------------------------------------------------------------------------


@pytest.mark.fast
def test_the_options_are_checked_where_they_are_built():
    from ddp_ring_hooks import HookState
    from ddp_ring_hooks.telemetry import TelemetryOptions

    assert TelemetryOptions().stall_after == 60.0 and TelemetryOptions().stall_timeout is None
    with pytest.raises(ValueError, match="stall_after must be a positive number of seconds, got 0"):
        HookState(stall_after=0)
    with pytest.raises(ValueError, match="stall_timeout must be a positive number of seconds, got 'soon'"):
        TelemetryOptions(stall_timeout="soon")
    with pytest.raises(ValueError, match=r"stall_timeout=30 s must be longer than stall_after=60 s"):
        HookState(stall_timeout=30)
    with pytest.raises(ValueError, match="telemetry option 'stall_after' given twice"):
        HookState(telemetry=TelemetryOptions(stall_after=5), stall_after=5)
    assert HookState(stall_after=2, stall_timeout=8).observation.watchdog.stall_after == 2.0
    # The Lightning strategy checks them as it is built too (tests/test_lightning_integration.py);
    # a stall_timeout the group's own timeout would beat is refused on ranks (the walk below).


# -- real ranks: slow, frozen and thawed, frozen for good -------------------------------------


#: The walk's buckets are cut into slices of this size (the executor's pipelining, as for a
#: bucket of more than 4 MiB): a bucket is then dozens of transfers, not the ring's 4 steps.
SLICE_BYTES = 512
#: The slow rank's pause before each wait of one bucket: its dozens of waits add up to more
#: than stall_after, while the others, who progress with each of its transfers, never wait
#: more than about two pauses, an eighth of stall_after (was 0.8 s a step against 2 s).
SLOW_PAUSE = STALL_AFTER / 16
#: The pauses stop once they add up to this: the bucket takes at least 1.5x stall_after, the
#: check needs more than 1x (paused before all of its 48 waits, it took 6 s: 3x).
SLOW_FOR = 1.5 * STALL_AFTER


class _SlowSteps(ExecutionObserver):
    """An observer (on every rank, so the layout check agrees) that, on the slow rank while
    ``active``, pauses ``seconds`` before each wait of one bucket, until the pauses add up to
    ``budget``: the bucket takes longer than ``stall_after``, yet every wait of the others is
    far shorter."""

    def __init__(self, *, slow: bool, seconds: float, budget: float) -> None:
        self.slow = slow
        self.seconds = seconds
        self.budget = budget
        self.paused = 0.0
        self.active = False

    def on_wait(self, index, num_steps, peer):
        if self.slow and self.active and self.paused < self.budget:
            time.sleep(self.seconds)
            self.paused += self.seconds

    def on_finish(self):
        self.active = False


def _freeze(directory: str, name: str) -> None:
    """This process stops itself (as a debugger, a page storm or a hung driver would stop it),
    after half a second in its forward: its watchdog (polling every ``STALL_AFTER / 10``) has
    published that much."""
    time.sleep(0.5)
    Path(directory, name).write_text(f"{os.getpid()} {time.time()!r}")
    os.kill(os.getpid(), signal.SIGSTOP)


def _train_through_stalls(rank: int, world_size: int, directory: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    import ddp_ring_hooks

    heard: list[tuple[float, str, str]] = []

    class Heard(logging.Handler):
        def emit(self, record):
            heard.append((time.time(), record.levelname, record.getMessage()))

    logging.getLogger("ddp_ring_hooks").addHandler(Heard())
    warned = warnings.catch_warnings(record=True)
    warned_list = warned.__enter__()
    warnings.simplefilter("always")

    from ddp_ring_hooks.runtime import executor

    executor.SLICE_BYTES = SLICE_BYTES  # this rank's process only
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32))
    model = DistributedDataParallel(net, bucket_cap_mb=0.004)  # a few buckets
    slow = _SlowSteps(slow=rank == SLOW_RANK, seconds=SLOW_PAUSE, budget=SLOW_FOR)
    # No advisor probe (a log_dir asks for one): no check reads it, and through 512-byte slices
    # its 2 MiB all-reduces took 7 s of the walk.
    state = ddp_ring_hooks.register(
        model, algorithm="ring", stall_after=STALL_AFTER, stall_timeout=STALL_TIMEOUT,
        log_dir=os.path.join(directory, "runs"), observers=(slow,), network_probe=False,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    marks: dict[str, float] = {}
    outcome: dict = {"rank": rank}
    try:  # where the group is known, a stall_timeout its own timeout would beat is refused
        ddp_ring_hooks.HookState(stall_after=STALL_AFTER, stall_timeout=PG_TIMEOUT)
    except ValueError as error:
        outcome["refused"] = str(error)
    for iteration in range(FREEZE_ITERATION + 1):
        generator = torch.Generator().manual_seed(100 * iteration + rank)
        loss = model(torch.randn(8, 32, generator=generator)).square().mean()
        if rank == VICTIM and iteration == THAW_ITERATION:
            _freeze(directory, "frozen_then_thawed")
        if rank == VICTIM and iteration == FREEZE_ITERATION:
            _freeze(directory, "frozen_for_good")
        slow.active = iteration == SLOW_ITERATION
        started = time.time()
        try:
            loss.backward()
        except RuntimeError as error:
            outcome["errors"] = [(iteration, time.time(), str(error))]
            try:  # the next bucket, as DDP would hand it over: refused at once
                state.reduce_bucket(torch.ones(16), is_last=True).wait()
            except RuntimeError as refused:
                outcome["errors"].append((iteration, time.time(), str(refused)))
            break
        marks[f"backward {iteration}"] = time.time() - started
        optimizer.step()
        optimizer.zero_grad()
        if iteration == FREEZE_ITERATION - 1:
            outcome["params"] = torch.cat([p.detach().view(-1) for p in model.parameters()]).clone()
            torch.save(outcome["params"], os.path.join(directory, f"params_rank{rank}.pt"))
    started = time.time()
    state.close()  # the workers were let go at the timeout: this returns
    outcome["close_s"] = time.time() - started
    warned.__exit__(None, None, None)
    outcome["heard"] = heard
    outcome["warned"] = [(str(w.message), w.category.__name__) for w in warned_list]
    outcome["marks"] = marks
    return outcome


def _launch_with_a_victim(directory: str, *, timeout: float) -> tuple[dict, dict]:
    """Spawn the ranks; thaw the victim ``THAW_AFTER`` seconds after its first freeze; return
    the survivors' outcomes and the freeze times, after checking that the survivors exit by
    themselves. The victim is killed at the end."""
    context = rank_context()
    results = context.Queue()
    processes = [
        context.Process(target=_rank_main, daemon=True, kwargs=rank_process_kwargs(), args=(
            _train_through_stalls, rank, WORLD_SIZE, os.path.join(directory, "store"), PG_TIMEOUT, results,
            (directory,)))
        for rank in range(WORLD_SIZE)
    ]
    for process in processes:
        process.start()
    outcomes: dict[int, dict] = {}
    deadline = time.monotonic() + timeout
    thawed = False
    try:
        while len(outcomes) < WORLD_SIZE - 1:
            frozen = Path(directory, "frozen_then_thawed")
            if not thawed and frozen.exists() and time.time() > _frozen_at(frozen) + THAW_AFTER:
                os.kill(processes[VICTIM].pid, signal.SIGCONT)
                thawed = True
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                if time.monotonic() > deadline:
                    pytest.fail(f"ranks {sorted(set(range(WORLD_SIZE)) - {VICTIM} - set(outcomes))} hung for {timeout:.0f} s")
                continue
            assert ok, f"rank {rank} failed outside training:\n{value}"
            if rank == VICTIM:  # continued (SIGCONT) by the survivors at their timeout: it failed and ended
                continue
            outcomes[rank] = pickle.loads(value)
        for rank in outcomes:  # nothing blocked in gloo keeps a survivor from exiting
            processes[rank].join(20)
            assert processes[rank].exitcode == 0, f"rank {rank} did not exit by itself: {processes[rank].exitcode}"
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(5)
    freezes = {name: _frozen_at(Path(directory, name)) for name in ("frozen_then_thawed", "frozen_for_good")}
    return outcomes, freezes


def _frozen_at(path: Path) -> float:
    return float(path.read_text().split()[1])


def _naming_the_victim(heard, start: float, end: float = float("inf")):
    return [(at, level, message) for at, level, message in heard
            if start <= at <= end and f"rank {VICTIM} is stalled" in message]


@pytest.fixture(scope="module")
def ring_walk(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("stall_ring"))
    outcomes, freezes = _launch_with_a_victim(directory, timeout=180)
    return directory, outcomes, freezes


@pytest.mark.timeout(240)
def test_a_stall_timeout_the_groups_own_timeout_would_beat_is_refused(ring_walk):
    _, outcomes, _ = ring_walk
    for outcome in outcomes.values():
        assert f"stall_timeout={PG_TIMEOUT:g} s is not shorter than the process group's own timeout" in outcome.get(
            "refused", "accepted"), outcome.get("refused")


@pytest.mark.timeout(240)
def test_a_rank_slower_than_stall_after_per_bucket_but_progressing_is_not_called_stalled(ring_walk):
    _, outcomes, freezes = ring_walk
    for rank, outcome in outcomes.items():
        assert outcome["marks"][f"backward {SLOW_ITERATION}"] > STALL_AFTER, (rank, outcome["marks"])  # slow indeed
        before_any_freeze = [entry for entry in outcome["heard"] if entry[0] < freezes["frozen_then_thawed"]]
        assert before_any_freeze == [], f"rank {rank} reported a stall while every rank progressed: {before_any_freeze}"


@pytest.mark.timeout(240)
def test_a_frozen_rank_is_named_within_stall_after_and_a_thaw_resumes_training_identically(ring_walk):
    directory, outcomes, freezes = ring_walk
    frozen = freezes["frozen_then_thawed"]
    for rank, outcome in outcomes.items():
        named = _naming_the_victim(outcome["heard"], frozen, frozen + THAW_AFTER)
        assert named, f"rank {rank} did not name rank {VICTIM}: {outcome['heard']}"
        assert named[0][0] - frozen < STALL_AFTER + 5, (rank, named[0][0] - frozen)
        print(f"frozen rank {VICTIM}, rank {rank} names it after {named[0][0] - frozen:.1f} s")  # docs/reliability.md
        assert named[0][2].startswith(f"rank {rank}: bucket "), named[0][2]
        assert any(category == "RankStalledWarning" and f"rank {VICTIM} is stalled" in message
                   for message, category in outcome["warned"]), outcome["warned"]
        resumed = [message for at, _, message in outcome["heard"] if "resumed after" in message]
        assert resumed and resumed[0].startswith(f"rank {rank}: bucket "), outcome["heard"]
        assert f"backward {THAW_ITERATION + 1}" in outcome["marks"]  # training went on
    params = [torch.load(os.path.join(directory, f"params_rank{rank}.pt")) for rank in range(WORLD_SIZE)]
    assert all(torch.equal(params[0], other) for other in params[1:]), "the ranks' weights differ after the thaw"


@pytest.mark.timeout(240)
def test_a_rank_frozen_for_good_fails_the_others_at_the_timeout_naming_it(ring_walk):
    _, outcomes, freezes = ring_walk
    frozen = freezes["frozen_for_good"]
    own_timeout = f"stall_timeout={STALL_TIMEOUT:g} s"
    for rank, outcome in outcomes.items():
        assert _naming_the_victim(outcome["heard"], frozen, frozen + STALL_AFTER + 5), (rank, outcome["heard"])
        (iteration, failed_at, message), (_, refused_at, refused) = outcome["errors"]
        assert iteration == FREEZE_ITERATION, message
        assert STALL_TIMEOUT - 1 < failed_at - frozen < STALL_TIMEOUT + 10, (rank, failed_at - frozen)
        print(f"frozen rank {VICTIM} for good, rank {rank} fails after {failed_at - frozen:.1f} s")
        assert "ring_hook (ring): bucket " in message and f"of iteration {FREEZE_ITERATION}" in message, message
        # Its own watchdog's timeout; or, when the other survivor's fired first (the watchdogs
        # poll apart) and closed its connections, that error with this watchdog's finding.
        assert f"rank {VICTIM} is stalled" in message, message
        assert own_timeout in message or "The stall watchdog had found: " in message, message
        assert refused_at - failed_at < 2.0 and "not reduced because an earlier one failed" in refused, refused
        # Let go at the timeout: close() does not wait for the group's own (60 s); rank 0 also
        # runs the advisor for its comm/advice panel there (seconds on a busy machine).
        assert outcome["close_s"] < 30.0, outcome["close_s"]
    assert any(own_timeout in outcome["errors"][0][2] for outcome in outcomes.values()), outcomes  # one fired


@pytest.mark.timeout(240)
def test_the_stall_reaches_tensorboard_and_each_waiting_ranks_dump(ring_walk):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    directory, outcomes, _ = ring_walk
    runs = os.path.join(directory, "runs")
    events = EventAccumulator(runs, size_guidance={"tensors": 0}).Reload()
    texts = [event.tensor_proto.string_val[0].decode() for event in events.Tensors("comm/stall/text_summary")]
    assert any(f"rank {VICTIM} is stalled" in text for text in texts), texts
    assert any("resumed after" in text for text in texts), texts
    timed_out = []
    for rank in outcomes:
        dump = json.loads(Path(runs, f"stall_rank{rank}.json").read_text())
        assert dump["finding"]["stalled"] == [VICTIM] and dump["finding"]["aborts"], dump["finding"]
        assert dump["records"][str(VICTIM)]["iteration"] == FREEZE_ITERATION
        assert 0 < len(dump["last_buckets"]) <= 64 and dump["open_buckets"], dump
        timed_out.append(dump["timed_out"])
    # The last dump is the timeout's where this rank's watchdog fired; the other survivor may
    # have failed first on the connections that one closed (the watchdogs poll apart), its
    # last dump then its latest report's: one fired (a suite run: rank 0's report, rank 1's timeout).
    assert any(timed_out), timed_out
    assert not Path(runs, f"stall_rank{VICTIM}.json").exists()  # frozen: it never waited


# -- torchrun, native: a stall-timeout, then the elastic restart from the checkpoint -----------


@pytest.mark.timeout(200)
def test_torchrun_restarts_after_a_native_stall_timeout_and_ends_with_the_uninterrupted_weights(tmp_path):
    """A rank freezes for good (SIGSTOP). ``native``: the wait is gloo's own all-reduce, which
    names no peer, so the store alone names the frozen rank, and the abort must let gloo's own
    collective go (the ring's waits are let go in the walk above). The survivor sends the
    stopped rank SIGCONT, so the agent need not wait 30 s to SIGKILL it before it restarts.
    (A rank that merely hangs in its own code still reports: it is busy, and only the group's
    own timeout ends that wait: tests/test_stall_busy.py.)"""
    from tests.scripts.train_with_hook import free_port, loopback_environment, torchrun_command, uninterrupted_params

    steps, stalled_rank, stall_step = 5, 1, 2
    command = torchrun_command(
        out=tmp_path, port=free_port(), max_restarts=1,
        extra=(f"--steps={steps}", "--algorithm=native", f"--stall-rank={stalled_rank}", f"--stall-step={stall_step}",
               f"--stall-after={SHORT_STALL_AFTER:g}", f"--stall-timeout={SHORT_STALL_TIMEOUT:g}"),
    )
    started = time.monotonic()
    run = subprocess.run(command, env=loopback_environment(), capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-4000:]
    # The frozen rank stopped reporting; the kernel shows it stopped; the survivor continues it.
    assert "(native all-reduce) has waited" in run.stderr, run.stderr[-4000:]
    assert f"rank {stalled_rank} has not reported for" in run.stderr, run.stderr[-4000:]
    assert "(its process is stopped (SIGSTOP, job control))" in run.stderr, run.stderr[-4000:]
    assert f"sent SIGCONT to rank {stalled_rank}" in run.stderr, run.stderr[-4000:]
    assert "terminate called" not in run.stderr  # the failed rank exits, it does not abort
    assert f"rank {stalled_rank} is stalled" in run.stderr and "RankStalledError" in run.stderr, run.stderr[-4000:]

    results = [json.loads((tmp_path / f"result_rank{r}.json").read_text()) for r in range(2)]
    for result in results:
        assert (result["attempt"], result["resumed_from"], result["iteration"]) == (1, stall_step, steps)
        assert result["algorithm"] == "native"
    assert results[0]["params"] == results[1]["params"]
    torch.testing.assert_close(torch.tensor(results[0]["params"]), uninterrupted_params(steps), rtol=1e-5, atol=1e-6)
    print(f"torchrun with a stall-timeout and a restart: {time.monotonic() - started:.0f} s")


# -- the lab: a host's cable pulled mid-training ----------------------------------------------


@pytest.mark.timeout(240)
def test_a_host_cut_off_mid_training_is_named_by_the_others(lab_machine, tmp_path):
    from ddp_ring_hooks.lab import EmulatedCluster

    script = Path(__file__).resolve().parent / "scripts" / "stall_lab.py"
    cut = 2
    with EmulatedCluster(hosts=3, link="1Gbit") as lab:
        job = lab.start([sys.executable, str(script), f"--out={tmp_path}", f"--stall-after={SHORT_STALL_AFTER:g}",
                         f"--stall-timeout={SHORT_STALL_TIMEOUT:g}"])
        deadline = time.monotonic() + 150
        while not all(_steps_done(tmp_path, rank) >= 5 for rank in range(3)):
            assert time.monotonic() < deadline, "the ranks did not train on the lab"
            time.sleep(0.2)
        lab.disconnect(host=cut)  # packets are lost from now on; no socket is closed
        cut_at = time.time()
        results = job.wait(timeout=120, check=False)
    outcomes = {result.host: _last_json_line(result.stdout) for result in results}
    for host in (0, 1):
        outcome = outcomes[host]
        assert outcome is not None, results[host].stderr[-3000:]
        named = [at for at, message in outcome["heard"] if f"rank {cut} is stalled" in message and at >= cut_at]
        assert named and named[0] - cut_at < SHORT_STALL_AFTER + 5, (host, outcome["heard"])
        assert f"rank {cut} is stalled" in outcome["error"], outcome["error"]
        assert outcome["failed_at"] - cut_at < SHORT_STALL_TIMEOUT + 10, outcome["failed_at"] - cut_at
        print(f"host {cut} cut off, host {host} names it after {named[0] - cut_at:.1f} s, "
              f"fails after {outcome['failed_at'] - cut_at:.1f} s")


def _steps_done(directory: Path, rank: int) -> int:
    path = directory / f"progress_rank{rank}"
    return int(path.read_text() or -1) if path.exists() else -1


def _last_json_line(stdout: str) -> dict | None:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else None


# -- CUDA (NCCL): written against PyTorch's sources; this project's CI has no GPU ----------------


def _gpu_rank_frozen(rank: int, world_size: int, directory: str) -> dict:
    import threading

    from torch.nn.parallel import DistributedDataParallel

    import ddp_ring_hooks

    heard: list[tuple[float, str]] = []

    class Heard(logging.Handler):
        def emit(self, record):
            heard.append((time.time(), record.getMessage()))

    logging.getLogger("ddp_ring_hooks").addHandler(Heard())
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(256, 256).to(device), device_ids=[rank])
    state = ddp_ring_hooks.register(model, stall_after=STALL_AFTER, stall_timeout=STALL_TIMEOUT)
    torch.cuda.set_sync_debug_mode("error")  # the watchdog only queries events: any host sync raises
    for iteration in range(6):
        if rank == 1 and iteration == 4:
            _freeze(directory, "frozen_for_good")
        model(torch.randn(32, 256, device=device)).square().mean().backward()
    torch.cuda.set_sync_debug_mode("default")
    waiter = threading.Thread(target=torch.cuda.synchronize, args=(device,), daemon=True)
    waiter.start()  # the GPU waits for the frozen rank; the watchdog watches its events meanwhile
    waiter.join(STALL_TIMEOUT + 10)
    return {"heard": heard, "failure": str(state.observation.watchdog.failure), "waiter_ended": not waiter.is_alive()}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs and NCCL; this machine has none (CPU-only CI)")
@pytest.mark.timeout(200)
def test_on_nccl_the_watchdog_queries_events_and_names_the_frozen_rank_through_the_store(tmp_path):
    context = rank_context()
    results = context.Queue()
    processes = [context.Process(target=_rank_main, daemon=True, kwargs={**rank_process_kwargs(), "backend": "nccl"}, args=(
        _gpu_rank_frozen, rank, 2, str(tmp_path / "store"), PG_TIMEOUT, results, (str(tmp_path),))) for rank in range(2)]
    for process in processes:
        process.start()
    try:
        rank, ok, value = results.get(timeout=150)
    finally:
        for process in processes:
            process.kill()
    assert ok and rank == 0, value
    outcome = pickle.loads(value)
    frozen = _frozen_at(tmp_path / "frozen_for_good")
    named = [at for at, message in outcome["heard"] if "rank 1 is stalled" in message]
    assert named and named[0] - frozen < STALL_AFTER + 5, outcome["heard"]
    assert "rank 1 is stalled" in outcome["failure"], outcome
    # The abort reached the communicator the stuck kernels run on: the GPU, and the thread that
    # waited for it, are free again (before NCCL's own 10-minute watchdog).
    assert outcome["waiter_ended"], "torch.cuda.synchronize() still waits for the frozen rank after stall_timeout"
