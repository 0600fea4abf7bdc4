"""Telemetry that cannot write says so: a bad ``log_dir`` fails when the state is built, naming
the directory; a sink that fails later is counted and shown in ``summary()``; and the summary
explains the extra row DDP's first iteration leaves."""

from __future__ import annotations

import pytest
import torch

from ._dist import run_ranks


def _register_with_log_dir(rank: int, world_size: int, log_dir: str) -> str:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import ddp_ring_hooks

    model = DistributedDataParallel(torch.nn.Linear(4, 4))
    try:
        ddp_ring_hooks.register(model, log_dir=log_dir)
    except ValueError as error:
        return str(error)
    finally:
        dist.barrier()
    return "registered"


def test_an_unwritable_log_dir_fails_at_registration_naming_it(tmp_path):
    # A regular file where a directory should be: nobody, root included, can create log_dir
    # under it (like /proc/x, where training once ended rc 0 with nothing in TensorBoard).
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    log_dir = str(blocker / "runs")
    (message,) = run_ranks(_register_with_log_dir, 1, log_dir, timeout=120)
    assert message.startswith(f"log_dir={log_dir!r} cannot be written"), message


@pytest.mark.fast
def test_a_writable_log_dir_is_created_when_the_state_is_built(tmp_path):
    from ddp_ring_hooks.telemetry import Telemetry

    log_dir = tmp_path / "new" / "runs"
    Telemetry(log_dir=log_dir).close()
    assert log_dir.is_dir()


def _play_steps(rank: int, world_size: int, buckets_per_step: dict[int, list[int]], failing: bool):
    """The hook's side of the observer protocol, for the given buckets (bytes) of each step."""
    import warnings

    from ddp_ring_hooks.telemetry import MemorySink, Observation, Sink

    class DiskFullSink(Sink):
        def write(self, record):
            raise OSError(28, "No space left on device")

    observation = Observation(sinks=[DiskFullSink() if failing else MemorySink()])
    telemetry = observation.recorder
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for step, sizes in buckets_per_step.items():
            for index, nbytes in enumerate(sizes):
                observer = observation.hand_over(
                    torch.zeros(nbytes // 4), step=step, index=index, is_last=index == len(sizes) - 1,
                    algorithm="ring", group=None,
                )
                observer.on_phase("reduce-scatter")
                observer.on_finish()
        summary = telemetry.summary()
        failures = telemetry.sink_failures
        telemetry.close()
    return summary, failures


def test_a_sink_that_fails_later_is_counted_in_the_summary():
    (result,) = run_ranks(_play_steps, 1, {1: [64], 2: [64], 3: [64]}, True, timeout=120)
    summary, failures = result
    assert failures == 3
    assert "3 steps logged" in summary  # measured, and the summary says what did not reach the files:
    assert "WARNING: 3 telemetry sink failures" in summary and "No space left on device" in summary


def test_the_first_iterations_extra_bucket_row_explains_itself():
    from ddp_ring_hooks.telemetry.summary import FIRST_STEP_NOTE

    # DDP's step 1 reduces with its first bucket layout (here one bucket of everything), then
    # rebuilds: the summary gets a row for bucket 0 of step 1 beside the later bucket 0.
    steps = {1: [4096], 2: [2048, 2048], 3: [2048, 2048]}
    (result,) = run_ranks(_play_steps, 1, steps, False, timeout=120)
    summary, failures = result
    assert failures == 0
    rows = {tuple(line.split()[:2]): line for line in summary.splitlines()[2:-1]}
    assert rows[("0", "4,096")].endswith(FIRST_STEP_NOTE)
    assert FIRST_STEP_NOTE not in rows[("0", "2,048")] and FIRST_STEP_NOTE not in rows[("1", "2,048")]


def _two_data_parallel_groups(rank: int, world_size: int, log_dir: str) -> None:
    """Ranks 0-1 and 2-3 each train their own DDP model on their own group; every rank passes
    the same log_dir, as an SPMD script does."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import ddp_ring_hooks

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4)),
                                    process_group=group, bucket_cap_mb=0.001)
    state = ddp_ring_hooks.register(model, log_dir=log_dir, trace_steps=(2, 4), spread_every=1)
    for step in range(5):
        model(torch.randn(8, 32, generator=torch.Generator().manual_seed(step))).square().mean().backward()
    state.close()


def test_each_data_parallel_group_writes_its_own_run_from_its_own_rank0(tmp_path):
    """The group's rank 0 writes (global rank 2 for the second group, which has no global
    rank 0), into log_dir/group_{first}-{last}: TensorBoard events, the merged trace of the
    group's two ranks, and the timeline the advisor reads."""
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ddp_ring_hooks.telemetry.timeline import read_timeline

    run_ranks(_two_data_parallel_groups, 4, str(tmp_path), timeout=180)
    assert sorted(path.name for path in tmp_path.iterdir() if path.is_dir()) == ["group_0-1", "group_2-3"]
    for name in ("group_0-1", "group_2-3"):
        directory = tmp_path / name
        accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0})
        accumulator.Reload()
        tags = accumulator.Tags()["scalars"]
        assert "comm/step/total_ms" in tags and "comm/ranks/straggler_rank" in tags, (name, tags)
        assert {e.value for e in accumulator.Scalars("comm/ranks/straggler_rank")} <= {0.0, 1.0}  # group ranks
        trace = json.loads((directory / "comm_trace.json").read_text())
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        assert {event.get("pid") for event in events if event.get("ph") == "X"} == {0, 1}, name
        run = read_timeline(directory)[0]
        assert run.world_size == 2 and run.rank == 0, (name, run)
    with pytest.raises(FileNotFoundError, match="one run per process group .group_0-1, group_2-3.*pass one of them"):
        read_timeline(tmp_path)  # what `ddp-ring-hooks advise LOG_DIR` says for the top directory


@pytest.mark.fast
def test_group_directory_names_tell_groups_apart():
    from ddp_ring_hooks.telemetry.options import group_dir_name

    assert group_dir_name([1, 0]) == "group_0-1"
    assert group_dir_name([0, 8, 16, 24]) == "group_0-24_step8"  # a data-parallel group across tensor-parallel ones
    assert group_dir_name([5]) == "group_5"
    overlapping = {group_dir_name(ranks) for ranks in ([0, 1], [0, 2], [0, 2, 3], [0, 1, 3])}
    assert len(overlapping) == 4, overlapping  # groups that share their first rank do not share a directory
