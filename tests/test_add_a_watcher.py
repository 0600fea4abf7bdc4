"""Add a watcher in 2 steps (``docs/architecture.md``), and find what it writes everywhere.

A dummy watcher, ``Answer``, is added for one test the way the docs say, and nothing else is
written for it: step 1 is the class (a :class:`~ddp_ring_hooks.telemetry.Watcher` that, after
every logged step, writes one scalar through the recorder's one protocol: a
:class:`~ddp_ring_hooks.telemetry.records.Scalars` record); step 2 is its entry in the
observation's table of watchers (``observation.WATCHERS``, swapped for a copy in each rank while
the test runs). On real gloo ranks with DDP, its scalar must then be in TensorBoard (the event
files read back), in the Chrome trace (a counter track), in the summary (its latest value) and
in a memory sink, on the steps it was written at.
"""

from __future__ import annotations

import json
import os

import pytest

from tests._dist import run_ranks

TAG = "dummy/answer"
STEPS = 4
TRACE_WINDOW = (2, 4)  # optimizer steps 2 and 3


def _train_with_a_watcher_of_its_own(rank: int, world_size: int, log_dir: str) -> dict:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import ddp_ring_hooks
    from ddp_ring_hooks.telemetry import MemorySink, Watcher, observation
    from ddp_ring_hooks.telemetry.records import Scalars

    class Answer(Watcher):  # step 1: the watcher
        """After every logged step, one number: 40 plus the step."""

        def __init__(self, recorder) -> None:
            self.recorder = recorder

        def wants_marks(self, step: int) -> bool:
            return step % self.recorder.options.log_every == 0

        def on_step_done(self, step) -> None:
            self.recorder.record(Scalars(step.step, {TAG: 40.0 + step.step}, rank=step.rank), group=step.group)

    # step 2: its entry in the table of watchers
    observation.WATCHERS = (*observation.WATCHERS, observation.WatcherEntry("answer", lambda options, r: Answer(r)))

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)))
    memory = MemorySink()
    state = ddp_ring_hooks.register(model, log_dir=log_dir, trace_steps=TRACE_WINDOW, sinks=[memory])
    for _ in range(STEPS):
        model(torch.randn(8, 16)).sum().backward()
    summary = state.summary()
    state.close()
    return {
        "summary": summary,
        "memory": [(r.step, dict(r.scalars())) for r in memory.watched if TAG in r.scalars()],
        "answer": type(state.observation.by_name["answer"]).__name__,
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    log_dir = str(tmp_path_factory.mktemp("a_watcher_of_its_own"))
    return log_dir, run_ranks(_train_with_a_watcher_of_its_own, 2, log_dir, timeout=150)


@pytest.mark.timeout(180)
def test_its_scalar_is_in_tensorboard(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir, _ = trained
    events = EventAccumulator(log_dir, size_guidance={"scalars": 0}).Reload()  # rank 0's run
    assert TAG in events.Tags()["scalars"], events.Tags()["scalars"]
    assert [(e.step, e.value) for e in events.Scalars(TAG)] == [(step, 40.0 + step) for step in range(1, STEPS + 1)]


@pytest.mark.timeout(180)
def test_its_scalar_is_a_counter_in_the_trace_of_every_rank(trained):
    log_dir, _ = trained
    with open(os.path.join(log_dir, "comm_trace.json")) as file:  # rank 0's, every rank merged in
        trace = json.load(file)
    counters = sorted((e["pid"], e["args"]["value"]) for e in trace["traceEvents"] if e["ph"] == "C" and e["name"] == TAG)
    # The window's steps, on both ranks (rank 1's arrive in rank 0's merged file).
    assert counters == [(rank, 40.0 + step) for rank in (0, 1) for step in range(*TRACE_WINDOW)], counters


@pytest.mark.timeout(180)
def test_its_scalar_is_in_the_summary_and_in_a_memory_sink(trained):
    _, results = trained
    for rank, result in enumerate(results):
        assert result["answer"] == "Answer"
        assert f"{TAG}: {40 + STEPS} (step {STEPS})" in result["summary"], result["summary"]
        assert result["memory"] == [(step, {TAG: 40.0 + step}) for step in range(1, STEPS + 1)], (rank, result)
