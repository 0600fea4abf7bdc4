"""Recording a real gloo run and replaying it: the trace rebuilds the schedule that ran.

One 3-rank spawn runs every algorithm (plus an empty and a tiny buffer) with a
``TraceRecorder`` each; the parent saves and reloads the per-rank trace files, rebuilds the
schedule, and checks its frames (and pixels) against the in-memory simulation.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ddp_ring_hooks
from ddp_ring_hooks.cli.__main__ import main
from ddp_ring_hooks.runtime.recording import (
    TraceError,
    TraceRecorder,
    load_recordings,
    save_recordings,
    schedule_from_recordings,
)
from ddp_ring_hooks.schedules import ALGORITHMS, checked_schedule
from ddp_ring_hooks.viz import simulate, split_sizes
from ddp_ring_hooks.viz.layout import choose_layout
from tests._dist import run_ranks
from tests.conftest import algorithm_cases

WORLD_SIZE = 3
ELEMENTS = (10, 2, 0)  # even-ish, fewer than the chunks (empty chunks), empty


def options_for(algorithm: str) -> dict:
    """The registry's first example for ``algorithm`` at ``WORLD_SIZE`` ranks."""
    return next(o for name, o in algorithm_cases(WORLD_SIZE, flat_hierarchies=True) if name == algorithm)


def record_every_algorithm(rank: int, world_size: int) -> dict:
    """Per algorithm: this rank's recording of one all-reduce per element count, and the results."""
    report = {}
    for algorithm in ALGORITHMS:
        recorder = TraceRecorder(algorithm=algorithm, options=options_for(algorithm))
        results = []
        for numel in ELEMENTS:
            tensor = torch.full((numel,), float(rank + 1))
            ddp_ring_hooks.all_reduce(tensor, algorithm=algorithm, observer=recorder, **options_for(algorithm))
            results.append(tensor.tolist())
        report[algorithm] = (recorder.recording(), results)
    report["ddp"] = record_ddp_training(rank)
    return report


def record_ddp_training(rank: int):
    """Two optimizer steps of a small DDP model whose hook feeds a recorder, as a user would."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 300), torch.nn.Linear(300, 5)),
                                    bucket_cap_mb=0.005)
    recorder = TraceRecorder(algorithm="ring")
    ddp_ring_hooks.register(model, observers=(recorder,))
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
    return recorder.recording()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Trace files of every rank, per algorithm, from one real 3-rank gloo run."""
    reports = run_ranks(record_every_algorithm, WORLD_SIZE, timeout=180)
    directory = tmp_path_factory.mktemp("traces")
    files = {}
    for algorithm in ALGORITHMS:
        files[algorithm] = [
            save_recordings([report[algorithm][0]], directory / f"{algorithm}.rank{rank}.json")
            for rank, report in enumerate(reports)
        ]
    return reports, files


def test_the_recorded_runs_really_all_reduced(recorded):
    reports, _ = recorded
    total = WORLD_SIZE * (WORLD_SIZE + 1) / 2
    for algorithm in ALGORITHMS:
        for report in reports:
            assert report[algorithm][1] == [[total] * numel for numel in ELEMENTS], algorithm


def test_a_recorded_trace_replays_to_the_same_frames_as_the_simulation(recorded):
    _, files = recorded
    for algorithm in ALGORITHMS:
        recordings = load_recordings(files[algorithm])
        assert [r.rank for r in recordings] == list(range(WORLD_SIZE))
        expected = checked_schedule(algorithm, WORLD_SIZE, **options_for(algorithm))
        for run, numel in enumerate(ELEMENTS[:2]):
            replayed = schedule_from_recordings(recordings, run=run)
            assert (replayed.world_size, replayed.num_chunks, len(replayed.steps)) == (
                expected.world_size, expected.num_chunks, len(expected.steps)
            )
            assert simulate(replayed, elements=numel).frames == simulate(expected, elements=numel).frames, algorithm
        # The empty buffer returns before any step: a run with nothing in it.
        assert schedule_from_recordings(recordings, run=2).steps == ()


def test_recorded_bytes_are_the_chunks_the_executor_moved(recorded):
    reports, _ = recorded
    for algorithm in ALGORITHMS:
        expected = checked_schedule(algorithm, WORLD_SIZE, **options_for(algorithm))
        for rank, report in enumerate(reports):
            recording = report[algorithm][0]
            for run, numel in zip(recording.runs[:2], ELEMENTS):
                sizes = [4 * n for n in split_sizes(numel, expected.num_chunks)]  # fp32
                assert run.chunk_bytes == tuple(sizes)
                plan = expected.plan_for(rank)
                assert [len(step.ops) for step in run.steps] == [len(s.sends) + len(s.receives) for s in plan]
                assert all(op.bytes == sizes[op.chunk] for step in run.steps for op in step.ops)


def test_animate_renders_the_trace_pixel_for_pixel_like_the_schedule(recorded, tmp_path):
    from PIL import Image, ImageSequence

    from ddp_ring_hooks.viz.animate import render_animation

    _, files = recorded
    replayed = schedule_from_recordings(load_recordings(files["ring"]))
    expected = checked_schedule("ring", WORLD_SIZE)
    a = render_animation(simulate(replayed), choose_layout(replayed), tmp_path / "trace.gif", progress=False)
    b = render_animation(simulate(expected), choose_layout(expected), tmp_path / "schedule.gif", progress=False)
    with Image.open(a) as first, Image.open(b) as second:
        ours = [f.convert("RGB").tobytes() for f in ImageSequence.Iterator(first)]
        theirs = [f.convert("RGB").tobytes() for f in ImageSequence.Iterator(second)]
    assert len(ours) == len(expected.steps) + 2
    assert ours == theirs

    output = tmp_path / "cli.gif"
    assert main(["animate", "--trace", *map(str, files["ring"]), "--output", str(output), "--no-progress"]) == 0
    with Image.open(output) as image:
        assert sum(1 for _ in ImageSequence.Iterator(image)) == len(expected.steps) + 2


def test_recordings_that_do_not_fit_together_are_rejected(recorded, tmp_path):
    _, files = recorded
    recordings = load_recordings(files["ring"])
    with pytest.raises(TraceError, match=r"needs one from each of 0\.\.2"):
        schedule_from_recordings(recordings[:2])
    with pytest.raises(TraceError, match="run 5 is not one of them"):
        schedule_from_recordings(recordings, run=5)
    # Rank 1 claims a different size for one receive: no matching send.
    run = recordings[1].runs[0]
    step = run.steps[0]
    receive = next(i for i, op in enumerate(step.ops) if op.kind == "receive")
    ops = list(step.ops)
    ops[receive] = dataclasses.replace(ops[receive], bytes=ops[receive].bytes + 4)
    tampered = dataclasses.replace(
        recordings[1], runs=(dataclasses.replace(run, steps=(dataclasses.replace(step, ops=tuple(ops)), *run.steps[1:])),)
    )
    with pytest.raises(TraceError, match="step 0: rank 1 received chunk"):
        schedule_from_recordings([recordings[0], tampered, recordings[2]])
    not_a_trace = tmp_path / "x.json"
    not_a_trace.write_text('{"hello": 1}')
    with pytest.raises(TraceError, match="not a ddp_ring_hooks trace"):
        load_recordings([not_a_trace])
    assert main(["animate", "--trace", str(not_a_trace), "--output", str(tmp_path / "x.gif")]) == 2


def test_a_ddp_training_run_records_every_bucket_it_reduced(recorded, tmp_path):
    reports, _ = recorded
    paths = [save_recordings([report["ddp"]], tmp_path / f"ddp.rank{rank}.json") for rank, report in enumerate(reports)]
    recordings = load_recordings(paths)
    runs = len(recordings[0].runs)
    assert runs >= 3  # step 1 reduces one big bucket; step 2 the rebuilt, smaller ones
    ring = checked_schedule("ring", WORLD_SIZE)
    for run in range(runs):
        replayed = schedule_from_recordings(recordings, run=run)
        assert simulate(replayed, elements=7).frames == simulate(ring, elements=7).frames
