"""The accumulation sweep end to end, as a user runs it: torchrun, two gloo ranks, a tiny model;
and the arithmetic that turns its rounds into one result (or a warning that there is none)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "train_examples" / "accumulation_sweep.py"
ACCUMULATE = (1, 2)
STEPS, WARMUP_STEPS = 3, 1
MIN_MICRO_BATCHES = 6  # k=1 measures 6 steps, k=2 3 (at least STEPS)


def measured(k: int) -> int:
    return max(STEPS, -(-MIN_MICRO_BATCHES // k))
RESULT_KEYS = {"accumulate_grad_batches", "samples_per_s", "comm_ms_per_optimizer_step", "comm_fraction", "speedup",
               "samples_per_s_spread", "speedup_by_round", "speedup_spread", "warnings"}


def _run_sweep(output: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(SWEEP),
        "--accumulate", ",".join(map(str, ACCUMULATE)), "--steps", str(STEPS), "--warmup-steps", str(WARMUP_STEPS),
        "--min-micro-batches", str(MIN_MICRO_BATCHES),
        "--warmup-fit-steps", "1", "--micro-batch", "2", "--seq-len", "16", "--width", "32", "--layers", "2",
        "--heads", "2", "--bucket-cap-mb", "0.02", "--accelerator", "cpu", "--output-dir", str(output), *extra,
    ]
    # The checkout need not be installed: the package is found from the repository root.
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    finished = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=240)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    return finished


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> dict:
    """Two runs into one output directory: two rounds, then one round."""
    output = tmp_path_factory.mktemp("sweep")
    first = _run_sweep(output, "--rounds", "2")
    first_events = sorted(p.name for p in (output / "version_0").rglob("events.out.tfevents.*"))
    second = _run_sweep(output, "--rounds", "1")
    return {"output": output, "first": first, "second": second, "first_events": first_events}


def test_results_json_holds_one_sane_record_per_setting(sweep):
    assert "speedup vs k=1" in sweep["first"].stdout
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
        low, high = record["samples_per_s_spread"]
        assert low <= record["samples_per_s"] <= high
        assert len(record["speedup_by_round"]) == 2
    # Paired within a round: k=1 against itself is exactly 1 in every round (it once read 0.685).
    assert records[0]["speedup"] == 1.0 and records[0]["speedup_by_round"] == [1.0, 1.0]
    low, high = records[1]["speedup_spread"]
    assert low <= records[1]["speedup"] <= high


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
            plugins = events.PluginTagToContent("hparams")
            assert "_hparams_/experiment" in plugins and "_hparams_/session_start_info" in plugins
            assert b"accumulate_grad_batches" in plugins["_hparams_/session_start_info"]


def test_a_second_run_gets_a_fresh_version_directory(sweep):
    output = sweep["output"]
    assert sorted(p.name for p in output.iterdir()) == ["version_0", "version_1"]
    assert sorted(p.name for p in (output / "version_0").rglob("events.out.tfevents.*")) == sweep["first_events"]
    records = json.loads((output / "version_1" / "results.json").read_text())
    assert [r["rounds"] for r in records] == [1, 1]
    assert str(output / "version_1") in sweep["second"].stdout
    # One round has no spread: the run says so instead of presenting one sample as a result.
    assert "WARNING: one round only" in sweep["second"].stdout
    assert "do not agree" not in sweep["second"].stdout  # one round cannot disagree with itself


# -- the arithmetic, on the numbers of a run that misled a user ---------------------------------


@pytest.fixture(scope="module")
def sweep_module():
    sys.path.insert(0, str(SWEEP.parent))  # the script imports its neighbour char_lm
    try:
        import accumulation_sweep
    finally:
        sys.path.remove(str(SWEEP.parent))
    return accumulation_sweep


def _records(module, by_round: dict[int, list[float]]):
    import argparse

    args = argparse.Namespace(seq_len=64, micro_batch=4, algorithm="ring", warmup_steps=1, steps=10)
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
    return [module.combine_rounds([runs[r, k] for r in range(rounds)], args) for k in ks]


def test_two_disagreeing_rounds_are_flagged_not_averaged(sweep_module):
    # The first run on a fresh clone: k=1 measured 45 and 87 samples/s in its two rounds.
    records = _records(sweep_module, {1: [45.0, 87.0], 8: [80.0, 118.0]})
    warnings = sweep_module.agreement_warnings(records, tolerance=0.10)
    assert any(w.startswith("NOISY: k=8 speedup ranged 1.36x-1.78x") for w in warnings), warnings
    assert records[1]["warnings"] and "NOISY" in records[1]["warnings"][0]
    table = sweep_module.format_table(records, warnings)
    assert "WARNING: NOISY" in table and "do not agree" in table


def test_an_uncertain_order_is_named(sweep_module):
    records = _records(sweep_module, {1: [80.0, 82.0, 81.0], 4: [120.0, 130.0, 125.0], 8: [125.0, 126.0, 124.0]})
    warnings = sweep_module.agreement_warnings(records, tolerance=0.10)
    assert [w for w in warnings if w.startswith("ORDER UNCERTAIN: k=8 vs k=4")], warnings
    assert not [w for w in warnings if "k=4 vs k=1" in w or "k=8 vs k=1" in w]


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
