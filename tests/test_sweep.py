"""The accumulation sweep end to end, as a user runs it: torchrun, two gloo ranks, a tiny model;
and the arithmetic that turns its rounds into one result (or a warning that there is none)."""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("lightning")

from .conftest import (
    MAIN_JOB_ACCUMULATE as ACCUMULATE,
    MAIN_JOB_MICRO_BATCH as MICRO_BATCH,
    MAIN_JOB_MIN_MICRO_BATCHES as MIN_MICRO_BATCHES,
    MAIN_JOB_STEPS as STEPS,
    MAIN_JOB_WARMUP_STEPS as WARMUP_STEPS,
    main_job_command,
    checkout_environment,
)

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "train_examples" / "accumulation_sweep.py"
ENVIRONMENT = checkout_environment()


def measured(k: int) -> int:
    return max(STEPS, -(-MIN_MICRO_BATCHES // k))  # k=1 measures 6 steps, k=2 3 (at least STEPS)


def samples_per_s_from_events(run_dir: Path, k: int) -> float:
    """One fit's samples/s, recomputed from the per-step times its TensorBoard run holds
    (``throughput/step_ms``): all samples of one optimizer step (2 ranks x micro-batch x k) over
    the median measured step, the definition in accumulation_sweep.py's docstring."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    step_ms = [e.value for e in sorted(events.Scalars("throughput/step_ms"), key=lambda e: e.step)][WARMUP_STEPS:]
    assert len(step_ms) == measured(k), step_ms
    return 2 * MICRO_BATCH * k / (statistics.median(step_ms) / 1e3)


RESULT_KEYS = {"accumulate_grad_batches", "samples_per_s", "comm_ms_per_optimizer_step", "comm_fraction", "speedup",
               "samples_per_s_spread", "speedup_by_round", "speedup_spread", "warnings"}


@pytest.fixture(scope="module")
def sweep(main_job_run) -> dict:
    """Two runs into one output directory: two rounds (the session's), then a second run that
    Ctrl-C stops in its first fit (the fresh directory it made is seen while it trains; one
    launch serves both checks). What a run of one round prints is checked without ranks below."""
    output = main_job_run["output"]
    first_events = sorted(p.relative_to(output) for p in output.rglob("events.out.tfevents.*"))
    return {"output": output, "first": main_job_run["stdout"], "first_events": first_events,
            "interrupted": interrupt_a_run(output)}


def interrupt_a_run(output: Path) -> dict:
    """Start the short main job into ``output`` (3 rounds, no warm-up fit: its first timed fit
    starts sooner), wait until its first fit writes event files, then Ctrl-C it, as a terminal
    does: SIGINT to torchrun's process group, and torchrun forwards it to each rank (each runs
    in a session of its own), one after another. Returns its output,
    the run directories its new event files were in, and what ``output`` holds after it ended.

    Its fits train 30 steps, so the signal lands while one trains, not between two fits. With
    fits of 3 steps, one CI run in many had the signal land as the second fit began, and
    neither rank took it (a rank waiting in C++, in a collective or a group's connect, runs no
    Python handler): torchrun killed both 30 s later, and rank 0 had printed nothing. (Such a
    rank now ends 10 s after the signal: ``ddp_ring_hooks/interrupts.py``.)"""
    before = set(output.rglob("events.out.tfevents.*"))
    run = subprocess.Popen(main_job_command(output, "--rounds", "3", "--warmup-fit-steps", "0", "--steps", "30"),
                           env=ENVIRONMENT, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    written: set[Path] = set()
    try:
        deadline = time.monotonic() + 180
        while not written and run.poll() is None and time.monotonic() < deadline:  # a fit is under way
            written = set(output.rglob("events.out.tfevents.*")) - before
            time.sleep(0.2)
        if written:
            os.killpg(run.pid, signal.SIGINT)
        out, _ = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    return {"out": out, "written_in": sorted({p.relative_to(output).parts[0] for p in written}),
            "left": sorted(p.name for p in output.iterdir())}


def test_results_json_holds_one_sane_record_per_setting(sweep):
    assert "speedup vs k=1" in sweep["first"]
    records = json.loads((sweep["output"] / "version_0" / "results.json").read_text())
    assert [r["accumulate_grad_batches"] for r in records] == list(ACCUMULATE)
    for record in records:
        assert RESULT_KEYS <= record.keys()
        assert record["samples_per_s"] > 0
        assert record["comm_ms_per_optimizer_step"] > 0
        assert 0 < record["comm_fraction"] < 1
        assert record["comm_hook"] == "ring_hook"  # what DDP reported after the strategy attached it
        assert record["world_size"] == 2
        assert record["buckets_per_step"] > 1
        k = record["accumulate_grad_batches"]
        # Every k measures at least STEPS steps and at least MIN_MICRO_BATCHES micro-batches.
        assert record["measured_steps"] == measured(k)
        assert record["micro_batches"] == (measured(k) + WARMUP_STEPS) * k
    # The medians, spreads and paired speedups against the same numbers computed here, from
    # each fit's own per-step times in TensorBoard (TensorBoard keeps float32: rel=1e-5).
    by_round = {k: [samples_per_s_from_events(sweep["output"] / "version_0" / f"accumulate_{k}" / f"round_{r}", k)
                    for r in range(2)] for k in ACCUMULATE}
    for record in records:
        rounds = by_round[record["accumulate_grad_batches"]]
        speedups = [run / baseline for run, baseline in zip(rounds, by_round[ACCUMULATE[0]])]
        assert record["samples_per_s_by_round"] == pytest.approx(rounds, rel=1e-5)
        assert record["samples_per_s"] == pytest.approx(statistics.median(rounds), rel=1e-5)
        assert record["samples_per_s_spread"] == pytest.approx([min(rounds), max(rounds)], rel=1e-5)
        assert record["speedup_by_round"] == pytest.approx(speedups, rel=1e-5)
        assert record["speedup"] == pytest.approx(statistics.median(speedups), rel=1e-5)
        assert record["speedup_spread"] == pytest.approx([min(speedups), max(speedups)], rel=1e-5)
    # Paired within a round: k=1 against itself is exactly 1 in every round (it once read 0.685).
    assert records[0]["speedup"] == 1.0 and records[0]["speedup_by_round"] == [1.0, 1.0]


def test_the_run_reports_the_machines_load_next_to_its_verdict(sweep):
    out = sweep["first"]
    verdict = out.index("These rounds do not agree") if "These rounds do not agree" in out else out.index("speedup vs k=1")
    machine = out.index("machine: load average ")
    assert machine > verdict and "at start" in out[machine:] and "on " in out[machine:] and " cores" in out[machine:]
    records = json.loads((sweep["output"] / "version_0" / "results.json").read_text())
    load = records[0]["machine"]
    assert {"load_average_start", "load_average_end", "cores", "steal_fraction", "busy_at_start"} <= load.keys()
    assert load["cores"] >= 1 and load["load_average_start"] >= 0
    assert all(record["machine"] == load for record in records)


def test_every_run_writes_the_timeline_and_advise_reads_the_version_directory(sweep, capsys):
    from ddp_ring_hooks.cli.__main__ import main

    run = sweep["output"] / "version_0"
    for k in ACCUMULATE:
        for round_index in range(2):
            lines = (run / f"accumulate_{k}" / f"round_{round_index}" / "timeline.jsonl").read_text().splitlines()
            assert json.loads(lines[0])["type"] == "run" and len(lines) == 1 + measured(k) + WARMUP_STEPS - 1
    assert f"advice: ddp-ring-hooks advise {run}" in sweep["first"]
    assert main(["advise", str(run)]) == 0
    out, err = capsys.readouterr()
    assert "holds 4 runs with a timeline: accumulate_1/round_0, accumulate_1/round_1, accumulate_2/round_0" in err
    assert "accumulate 1," in out and "  1 (this run) " in out and "recommendation:" in out


def test_the_hparams_experiment_says_which_settings_differ(sweep):
    """TensorBoard's HParams tab takes its columns from one experiment summary; Lightning wrote
    one per run, each with differs=false, accumulate_grad_batches included."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    experiments = []
    for k in ACCUMULATE:
        for round_index in range(2):
            events = EventAccumulator(str(sweep["output"] / "version_0" / f"accumulate_{k}" / f"round_{round_index}"))
            events.Reload()
            content = events.PluginTagToContent("hparams")
            assert "_hparams_/session_start_info" in content
            if "_hparams_/experiment" in content:
                experiments.append(plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment)
    assert len(experiments) == 1
    differs = {info.name: info.differs for info in experiments[0].hparam_infos}
    assert differs["accumulate_grad_batches"] and differs["round"] and differs["measured_steps"]
    assert not differs["micro_batch"] and not differs["algorithm"] and not differs["world_size"]
    assert {m.name.tag for m in experiments[0].metric_infos} >= {"sweep/samples_per_s", "sweep/speedup"}


@pytest.mark.fast
def test_one_process_is_refused_before_training(tmp_path, capsys, monkeypatch):
    # The script's own main, in this process (one process, as `python accumulation_sweep.py` is):
    # a process of its own would spend its seconds importing Lightning. Without the warm-up fit,
    # training would create the output directory first.
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    sys.path.insert(0, str(SWEEP.parent))
    try:
        import accumulation_sweep
    finally:
        sys.path.remove(str(SWEEP.parent))
    with pytest.raises(SystemExit) as finished:
        accumulation_sweep.main(["--output-dir", str(tmp_path / "runs"), "--warmup-fit-steps", "0"])
    out, err = capsys.readouterr()
    assert finished.value.code == 2
    assert ("this measures communication between ranks, but only 1 process runs: launch it with "
            "`torchrun --standalone --nproc_per_node=2 train_examples/accumulation_sweep.py`") in err
    assert "--allow-single-process" in err
    assert not (tmp_path / "runs").exists() and not out  # refused before any fit


def test_ctrl_c_removes_the_partial_run_and_the_ranks_exit_without_a_traceback(sweep):
    """Ctrl-C reaches torchrun (the terminal signals its process group), which forwards it to
    every rank, one after another."""
    interrupted, output = sweep["interrupted"], sweep["output"]
    out = interrupted["out"]
    assert interrupted["written_in"], f"the second run never started its first fit:\n{out[-3000:]}"
    # The signal lands during a fit: the first, of 30 steps (with 3, a fit once ended between the
    # poll that saw its event file and the signal: "after 1 of 6"); never after all 6.
    said = re.search(rf"interrupted after (\d) of 6 fits: removed the partial run {re.escape(str(output / 'version_1'))}", out)
    assert said and int(said.group(1)) < 6, out[-3000:]
    # TensorBoard has no half run to list, and the complete run beside it is untouched.
    assert interrupted["left"] == ["version_0"]
    assert sorted(p.relative_to(output) for p in output.rglob("events.out.tfevents.*")) == sweep["first_events"]
    assert "[rank0]: Traceback" not in out and "[rank1]: Traceback" not in out, out[-3000:]


def test_ctrl_c_that_reaches_rank_1_after_rank_0_has_left_still_ends_it_without_a_traceback(tmp_path):
    """torchrun forwards Ctrl-C to one rank after another; on a loaded machine rank 0 once took
    its signal and left before rank 1's came (one CI run), and rank 1's next collective died
    with "Connection closed by peer" and a traceback. Here the ranks are plain processes with
    torchrun's variables, so the test decides the order: SIGINT to rank 0 during the first fit,
    and to rank 1 one second after rank 0 has exited."""
    from tests.scripts.train_with_hook import env_rank_variables, free_port

    command = main_job_command(tmp_path, "--rounds", "3", "--warmup-fit-steps", "0", "--steps", "30")
    script = command[command.index("--nproc_per_node=2") + 1:]
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, *script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**ENVIRONMENT, **env_rank_variables(rank, port), "LOCAL_RANK": "0",
                                   "GROUP_RANK": str(rank), "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "late-ctrl-c"})
             for rank in range(2)]
    try:
        deadline = time.monotonic() + 180
        while not any(tmp_path.rglob("events.out.tfevents.*")) and time.monotonic() < deadline:
            assert all(rank.poll() is None for rank in ranks), [rank.communicate()[0][-3000:] for rank in ranks]
            time.sleep(0.2)
        ranks[0].send_signal(signal.SIGINT)
        first, _ = ranks[0].communicate(timeout=60)
        time.sleep(1.0)
        ranks[1].send_signal(signal.SIGINT)
        second, _ = ranks[1].communicate(timeout=60)
    finally:
        for rank in ranks:
            rank.kill()
    assert ranks[0].returncode == 130 and f"removed the partial run {tmp_path / 'version_0'}" in first, first[-3000:]
    assert ranks[1].returncode == 130 and "Traceback" not in second, second[-3000:]
    assert list(tmp_path.iterdir()) == []


def test_plot_is_a_png(sweep):
    assert (sweep["output"] / "version_0" / "accumulation_sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_setting_and_round_is_its_own_tensorboard_run_with_hparams(sweep):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for k in ACCUMULATE:
        for round_index in range(2):
            events = EventAccumulator(str(sweep["output"] / "version_0" / f"accumulate_{k}" / f"round_{round_index}"))
            events.Reload()
            scalars = set(events.Tags()["scalars"])
            assert {"train/loss", "comm/step/total_ms", "throughput/samples_per_s", "sweep/samples_per_s"} <= scalars
            # Every optimizer step has its comm timing, once: a later run never appends to this
            # run's event files (it once showed 2x the points).
            assert len(events.Scalars("comm/step/total_ms")) == measured(k) + WARMUP_STEPS
            plugins = events.PluginTagToContent("hparams")  # the experiment: in one run only (below)
            assert "_hparams_/session_start_info" in plugins and "_hparams_/session_end_info" in plugins
            assert b"accumulate_grad_batches" in plugins["_hparams_/session_start_info"]


def test_a_second_run_gets_a_fresh_version_directory(sweep):
    # The interrupted second run trained into version_1, never into the first run's version_0
    # (whose event files it once appended to: 2x the points), and said where.
    assert sweep["interrupted"]["written_in"] == ["version_1"], sweep["interrupted"]
    assert str(sweep["output"] / "version_1") in sweep["interrupted"]["out"]
    assert sorted(p.relative_to(sweep["output"]) for p in sweep["output"].rglob("events.out.tfevents.*")) == sweep["first_events"]


# -- the arithmetic, on the numbers of a run that misled a user ---------------------------------


@pytest.fixture(scope="module")
def sweep_module():
    sys.path.insert(0, str(SWEEP.parent))  # the sweep's statistics, beside it
    try:
        import sweep_rounds
    finally:
        sys.path.remove(str(SWEEP.parent))
    return sweep_rounds


def _records(module, by_round: dict[int, list[float]]):
    ks = sorted(by_round)
    rounds = len(by_round[ks[0]])
    runs = {
        (r, k): {"accumulate_grad_batches": k, "round": r, "samples_per_s": by_round[k][r], "step_ms": 100.0,
                 "comm_ms_per_optimizer_step": 40.0, "exposed_comm_ms_per_optimizer_step": 10.0,
                 "buckets_per_step": 7, "measured_steps": 10, "world_size": 2, "comm_hook": "ring_hook",
                 "final_loss": 3.0}
        for k in ks for r in range(rounds)
    }
    module.paired_speedups(runs, ks, rounds)
    return [module.combine_rounds([runs[r, k] for r in range(rounds)], settings={"micro_batch": 4, "algorithm": "ring"},
                                  tokens_per_sample=64, warmup_steps=1) for k in ks]


@pytest.mark.fast
def test_two_disagreeing_rounds_are_flagged_not_averaged(sweep_module):
    # The first run on a fresh clone: k=1 measured 45 and 87 samples/s in its two rounds.
    records = _records(sweep_module, {1: [45.0, 87.0], 8: [80.0, 118.0]})
    warnings = sweep_module.agreement_warnings(records, tolerance=0.10)
    assert any(w.startswith("NOISY: k=8 speedup ranged 1.36x-1.78x") for w in warnings), warnings
    assert records[1]["warnings"] and "NOISY" in records[1]["warnings"][0]
    table = sweep_module.format_table(records, warnings)
    assert "WARNING: NOISY" in table and "do not agree" in table


@pytest.mark.fast
def test_an_uncertain_order_is_named(sweep_module):
    records = _records(sweep_module, {1: [80.0, 82.0, 81.0], 4: [120.0, 130.0, 125.0], 8: [125.0, 126.0, 124.0]})
    warnings = sweep_module.agreement_warnings(records, tolerance=0.10)
    assert [w for w in warnings if w.startswith("ORDER UNCERTAIN: k=8 vs k=4")], warnings
    assert not [w for w in warnings if "k=4 vs k=1" in w or "k=8 vs k=1" in w]


@pytest.mark.fast
def test_one_round_says_it_has_no_spread_instead_of_presenting_one_sample_as_a_result(sweep_module):
    records = _records(sweep_module, {1: [80.0], 2: [90.0]})
    assert [r["rounds"] for r in records] == [1, 1] and records[1]["speedup"] == pytest.approx(90 / 80)
    warnings = sweep_module.agreement_warnings(records, tolerance=0.10)
    assert warnings == ["one round only: no spread to judge agreement by; use --rounds 3 or more"]
    table = sweep_module.format_table(records, warnings)
    assert "WARNING: one round only" in table
    assert "do not agree" not in table and "rounds" not in table.splitlines()[0]  # no spread columns either


@pytest.mark.fast
def test_rounds_that_agree_raise_no_warning(sweep_module):
    records = _records(sweep_module, {1: [80.0, 90.0, 85.0], 2: [100.0, 112.0, 106.0], 8: [110.0, 124.0, 117.0]})
    assert sweep_module.agreement_warnings(records, tolerance=0.10) == []
    assert [r["speedup"] for r in records][0] == 1.0


def test_the_readme_picture_is_drawn_from_a_runs_event_files(sweep, tmp_path):
    sys.path.insert(0, str(SWEEP.parent))
    try:
        import plot_tensorboard_run
    finally:
        sys.path.remove(str(SWEEP.parent))
    run = sweep["output"] / "version_0"
    scalars = plot_tensorboard_run.read_scalars(run / "accumulate_2" / "round_0")
    assert set(scalars) == set(plot_tensorboard_run.TAGS)
    assert [step for step, _ in scalars["comm/step/total_ms"]] == list(range(measured(2) + WARMUP_STEPS))
    image = tmp_path / "scalars.png"
    plot_tensorboard_run.main([str(run), "--output", str(image)])
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
