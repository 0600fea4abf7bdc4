"""The accumulation sweep end to end, as a user runs it: torchrun, two gloo ranks, a tiny model."""

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
RESULT_KEYS = {"accumulate_grad_batches", "samples_per_s", "comm_ms_per_optimizer_step", "comm_fraction", "speedup"}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("sweep")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(SWEEP),
        "--accumulate", ",".join(map(str, ACCUMULATE)), "--micro-batches", "6", "--rounds", "1",
        "--micro-batch", "2", "--seq-len", "16", "--width", "32", "--layers", "2", "--heads", "2",
        "--bucket-cap-mb", "0.02", "--output-dir", str(output),
    ]
    # The checkout need not be installed: the package is found from the repository root.
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    finished = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=180)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    assert "speedup vs k=1" in finished.stdout
    return output


def test_results_json_holds_one_sane_record_per_setting(sweep):
    records = json.loads((sweep / "results.json").read_text())
    assert [r["accumulate_grad_batches"] for r in records] == list(ACCUMULATE)
    for record in records:
        assert RESULT_KEYS <= record.keys()
        assert record["samples_per_s"] > 0
        assert record["comm_ms_per_optimizer_step"] > 0
        assert 0 < record["comm_fraction"] < 1
        assert record["comm_hook"] == "ring_hook"  # what DDP reported after the strategy attached it
        assert record["world_size"] == 2
        assert record["buckets_per_step"] > 1
    assert records[0]["speedup"] == 1.0
    assert records[1]["speedup"] == pytest.approx(records[1]["samples_per_s"] / records[0]["samples_per_s"])


def test_plot_is_a_png(sweep):
    assert (sweep / "accumulation_sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_setting_is_its_own_tensorboard_run_with_hparams(sweep):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for k in ACCUMULATE:
        events = EventAccumulator(str(sweep / f"accumulate_{k}"))
        events.Reload()
        scalars = set(events.Tags()["scalars"])
        assert {"train/loss", "comm/step/total_ms", "throughput/samples_per_s", "sweep/samples_per_s"} <= scalars
        # 6 micro-batches at k micro-batches per step: 6/k optimizer steps, each with comm timing.
        assert len(events.Scalars("comm/step/total_ms")) == 6 // k
        plugins = events.PluginTagToContent("hparams")
        assert "_hparams_/experiment" in plugins and "_hparams_/session_start_info" in plugins
        assert b"accumulate_grad_batches" in plugins["_hparams_/session_start_info"]
