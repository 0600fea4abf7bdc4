"""One observation per hook state: every telemetry option reaches every watcher, an option is
given one way only, one hand-over mark feeds every watcher, and a pickled state keeps its options.

On real gloo ranks: a ``telemetry=Telemetry(log_dir=d, spread_every=1)`` object writes the
advisor's timeline under ``d`` (it once went nowhere) next to the straggler tags; an option
given both in ``telemetry=`` and as a keyword is refused naming it (it was once dropped)."""

from __future__ import annotations

import json
import os
import pickle

import pytest

from ._dist import run_ranks


def _telemetry_object_and_keywords(rank: int, world_size: int, log_dir: str):
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import ddp_ring_hooks
    from ddp_ring_hooks.telemetry import MemorySink, Telemetry

    refused = {}
    for name, build in {
        "HookState": lambda: ddp_ring_hooks.HookState(telemetry=Telemetry(), spread_every=3),
        "register": lambda: ddp_ring_hooks.register(
            DistributedDataParallel(torch.nn.Linear(4, 4)), telemetry=Telemetry(log_every=2), log_every=2,
        ),
    }.items():
        try:
            build()
        except ValueError as error:
            refused[name] = str(error)

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model = DistributedDataParallel(net, bucket_cap_mb=0.001)
    memory = MemorySink()
    state = ddp_ring_hooks.register(model, telemetry=Telemetry(log_dir=log_dir, spread_every=1, sinks=[memory]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(5):
        model(torch.randn(8, 16)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    state.close()
    return refused, [r.step for r in memory.ranks], [r.step for r in memory.records]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    log_dir = str(tmp_path_factory.mktemp("telemetry_object"))
    return log_dir, run_ranks(_telemetry_object_and_keywords, 2, log_dir, timeout=180)


def test_a_telemetry_object_writes_the_advisors_timeline_under_its_log_dir(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir, results = trained
    for _, gathered, recorded in results:
        assert gathered == recorded == [1, 2, 3, 4, 5]  # spread_every=1 reached the arrivals
    events = EventAccumulator(log_dir, size_guidance={"scalars": 0}).Reload()
    assert "comm/ranks/straggler_rank" in events.Tags()["scalars"]
    path = os.path.join(log_dir, "timeline.jsonl")
    assert os.path.exists(path), f"the timeline went elsewhere: {sorted(os.listdir(log_dir))}"
    with open(path) as file:
        lines = [json.loads(line) for line in file]
    assert lines[0]["type"] == "run" and lines[0]["world_size"] == 2
    steps = [line["step"] for line in lines[1:] if line["type"] == "step"]
    assert steps == [1, 2, 3, 4]  # the hook's steps; step 5 never ends
    # spread_every=1: every step's arrivals too, for the advisor's wait for the latest rank
    assert [line["step"] for line in lines[1:] if line["type"] == "arrivals"] == [1, 2, 3, 4, 5]


def test_a_telemetry_option_given_both_ways_is_refused_naming_it(trained):
    _, results = trained
    for refused, _, _ in results:
        assert set(refused) == {"HookState", "register"}, refused
        assert "telemetry option 'spread_every' given twice" in refused["HookState"]
        assert "telemetry option 'log_every' given twice" in refused["register"]


@pytest.mark.fast
def test_telemetry_options_are_one_definition_checked_once():
    from ddp_ring_hooks.telemetry import TELEMETRY_OPTIONS, Telemetry, TelemetryOptions
    from ddp_ring_hooks.telemetry.options import collect_telemetry_options

    assert TELEMETRY_OPTIONS == ("log_dir", "log_every", "trace_steps", "per_rank", "spread_every", "sinks",
                                 "capacity", "summary_window", "stall_after", "stall_timeout", "links", "diagnose")
    options = TelemetryOptions(spread_every=2, capacity=8)
    assert Telemetry(options).options is options
    assert collect_telemetry_options(None, {"spread_every": 2, "capacity": 8}) == options
    with pytest.raises(ValueError, match="options 'capacity', 'spread_every' given twice"):
        Telemetry(options, spread_every=2, capacity=8)
    with pytest.raises(TypeError, match="telemetry= takes TelemetryOptions"):
        collect_telemetry_options({"log_dir": "x"}, {})
    with pytest.raises(ValueError, match="summary_window must be a positive integer"):
        TelemetryOptions(summary_window=0)


@pytest.mark.fast
def test_a_state_pickles_its_options(tmp_path):
    """A pickle (a spawned process, a copy) keeps the options and counters; the durable,
    versioned format is state_dict() (test_frameworks checks it)."""
    from ddp_ring_hooks import HookState
    from ddp_ring_hooks.telemetry import MemorySink, TelemetryOptions

    state = HookState(algorithm="tree", segments=3, log_dir=str(tmp_path), spread_every=2, sinks=[MemorySink()])
    clone = pickle.loads(pickle.dumps(state))
    assert clone.observation.options == TelemetryOptions(log_dir=str(tmp_path), spread_every=2)  # no sinks
    assert clone.algorithm_options == {"segments": 3, "wire_dtype": "fp32"} and clone.observers == ()
    assert clone.observation.advice is state.observation.advice  # the advisor's, by name
    assert not os.path.exists(tmp_path / "timeline.jsonl")  # pickling and loading write nothing


def _a_watcher_of_its_own(rank: int, world_size: int):
    """A watcher added beside the others hears every bucket, phase, step and exchange."""
    import threading

    import torch
    from torch.nn.parallel import DistributedDataParallel

    import ddp_ring_hooks
    from ddp_ring_hooks.runtime import ExecutionObserver
    from ddp_ring_hooks.telemetry import Watcher

    heard: list[tuple] = []
    hook_thread = threading.get_ident()

    class Phases(ExecutionObserver):
        def __init__(self, index):
            self.index = index

        def on_phase(self, phase):
            heard.append(("phase", self.index, phase, threading.get_ident() != hook_thread))

        def on_finish(self):
            heard.append(("finish", self.index))

    class Probe(Watcher):
        def wants_marks(self, step):
            heard.append(("wants", step))
            return True

        def on_bucket(self, bucket):
            heard.append(("bucket", bucket.step, bucket.index, bucket.handed is not None))
            return Phases(bucket.index)

        def on_step_done(self, step):
            heard.append(("done", step.step, len(step.read())))

        def exchanges_after(self, step):
            return step % 2 == 0

        def exchange(self, step, peers):
            rows = peers.rows([float(peers.rank), float(step.step)])
            heard.append(("exchange", step.step, rows, threading.get_ident() != hook_thread))

        def close(self):
            heard.append(("close",))

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)))
    state = ddp_ring_hooks.register(model, concurrent_buckets=1)
    state.observation.watchers = (*state.observation.watchers, Probe())
    for _ in range(4):
        model(torch.randn(4, 8)).sum().backward()
    state.close()
    return heard


def test_a_watcher_added_beside_the_others_hears_every_bucket_step_and_exchange():
    for heard in run_ranks(_a_watcher_of_its_own, 2, timeout=120):
        assert [h[1] for h in heard if h[0] == "wants"] == [1, 2, 3, 4]  # once per step
        buckets = [h for h in heard if h[0] == "bucket"]
        assert [h[1] for h in buckets] == [1, 2, 3, 4] and all(h[3] for h in buckets)  # DDP's one bucket here
        phases = [h for h in heard if h[0] == "phase"]
        assert {h[2] for h in phases} == {"reduce-scatter", "all-gather"} and all(h[3] for h in phases)
        assert [h[1] for h in heard if h[0] == "done"] == [1, 2, 3, 4]
        assert all(h[2] == 1 for h in heard if h[0] == "done")  # the step's one bucket, read
        exchanges = [h for h in heard if h[0] == "exchange"]
        assert [h[1] for h in exchanges] == [2, 4] and all(h[3] for h in exchanges)  # off the hook thread
        assert all(h[2] == [[0.0, h[1]], [1.0, h[1]]] for h in exchanges)  # every rank's row
        assert heard[-1] == ("close",) and heard.count(("close",)) == 1
