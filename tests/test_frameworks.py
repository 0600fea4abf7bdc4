"""The hook where users train: transformers' Trainer, Accelerate (eager and compiled), Lightning
Fabric and Trainer, plain DDP, each on 2 real gloo ranks under torchrun.

One launch per framework (``tests/scripts/framework_checks.py``, which says what runs in it);
the tests below read what its ranks reported and the TensorBoard event files they wrote. In
every framework: DDP itself names ``ring_hook`` as its communication hook, ``native`` gives
the very same losses and parameters as no hook, ``ring`` the same within rounding, and the
``comm/*`` tags are in the run. The docs page prints the recipes these launches run.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ROOT / "tests" / "scripts" / "framework_checks.py"
RECIPES = ROOT / "train_examples" / "recipes"
# ring and DDP's all-reduce both compute (a + b) / 2 at two ranks, exactly in binary floating
# point, but in differently ordered bucket arithmetic: allow a few roundings per step.
LOSS_RTOL = 1e-5
PARAMETER_ATOL = 1e-5
#: bf16 on the wire keeps 8 bits of each averaged gradient: a few steps stay this close (the
#: Trainer's AdamW moves a parameter by up to its lr, 1e-3, per step whatever the gradient's
#: size, so 4 steps may part by a few 1e-3 where a gradient is near 0).
WIRE_LOSS_RTOL = 1e-2
WIRE_PARAMETER_ATOL = 1e-2


def torchrun(script: Path, *arguments: str, cwd: Path, timeout: float) -> str:
    """``torchrun --standalone --nproc_per_node=2 script arguments`` in ``cwd``; its output. A
    launch that does not finish in time is killed with all its ranks (its own session), and
    the test fails."""
    environment = {
        **os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), *arguments]
    process = subprocess.Popen(command, cwd=cwd, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{script.name} {' '.join(arguments)} did not finish in {timeout:.0f} s:\n{output[-4000:]}")
    assert process.returncode == 0, output[-6000:]
    return output


def launch(tmp_path_factory, framework: str, *, needs: str, timeout: float) -> tuple[Path, list[dict]]:
    """Run the framework's checks on 2 ranks (skipped without the package ``needs``): the
    directory they worked in (the output in ``output.txt``) and every rank's report."""
    pytest.importorskip(needs)
    out = tmp_path_factory.mktemp(framework)
    output = torchrun(CHECKS, framework, "--out", str(out), cwd=out, timeout=timeout)
    (out / "output.txt").write_text(output)
    return out, [json.loads((out / f"{framework}_rank{rank}.json").read_text()) for rank in range(2)]


def scalars(run_dir: Path) -> dict[str, list[int]]:
    """Every scalar tag of a TensorBoard run directory and the steps it was written at."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [event.step for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def text_panels(run_dir: Path) -> list[str]:
    """The text panels (TensorBoard's ``text_summary`` tensors) of a run directory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    events.Reload()
    return events.Tags()["tensors"]


def assert_hook_runs_match(runs: dict, *, suffix: str = "") -> None:
    """``none``/``native``/``ring`` runs: the hook attached, native identical, ring within rounding."""
    none, native, ring = (runs[f"{algorithm}{suffix}"] for algorithm in ("none", "native", "ring"))
    assert none["comm_hook"] is None
    assert native["comm_hook"] == ring["comm_hook"] == "ring_hook"
    assert native["losses"] == none["losses"] and native["max_parameter_difference"] == 0.0
    assert ring["losses"] != [] and len(ring["losses"]) == len(none["losses"])
    for got, expected in zip(ring["losses"], none["losses"], strict=True):
        assert math.isclose(got, expected, rel_tol=LOSS_RTOL), (ring["losses"], none["losses"])
    assert ring["max_parameter_difference"] <= PARAMETER_ATOL


def assert_diagnosis_left_on(runs: dict) -> None:
    """The ``native`` run asked for ``diagnose=True`` at the framework's door (issue 32): every
    warm-up step gathered, its straggler and probe lines in the summary on both ranks, and its
    parameters still "none"'s bit for bit (assert_hook_runs_match): diagnosis touches no gradient."""
    summary = runs["native"]["summary"]
    steps = runs["native"]["hook_iteration"]
    assert f"cadence: auto, {steps} of {steps} steps gathered" in summary, summary
    assert "\nstragglers: " in summary and "\nlinks (probe): " in summary, summary
    assert runs["ring"]["summary"] is not None and "cadence:" not in runs["ring"]["summary"]  # asked for nothing


def assert_foreign_run(reports: list[dict]) -> None:
    """The ``foreign`` run (``hook=allreduce_hook`` through the framework's door): DDP sees our
    hook, ours ran the user's, and the parameters are those of the run without a hook, bit for bit."""
    for report in reports:
        runs = report["runs"]
        foreign, none = runs["foreign"], runs["none"]
        assert foreign["comm_hook"] == "ring_hook" and foreign["hook"] == "allreduce_hook"
        assert foreign["losses"] == none["losses"] and foreign["max_parameter_difference"] == 0.0


def assert_wire_run(reports: list[dict]) -> None:
    """The ``ring_bf16`` run (the ring on bf16 with error feedback, its options given through the
    framework's door): the options reached the hook, every rank ends with the same parameters,
    and the losses follow the run without a hook to bf16's precision."""
    runs = [report["runs"] for report in reports]
    for run in runs:
        wire, none = run["ring_bf16"], run["none"]
        assert wire["comm_hook"] == "ring_hook" and wire["wire"] == "bf16" and wire["error_feedback"]
        for got, expected in zip(wire["losses"], none["losses"], strict=True):
            assert math.isclose(got, expected, rel_tol=WIRE_LOSS_RTOL), (wire["losses"], none["losses"])
        assert 0.0 < wire["max_parameter_difference"] <= WIRE_PARAMETER_ATOL
    assert len({run["ring_bf16"]["digest"] for run in runs}) == 1, "ranks differ bit-wise on bf16"


def assert_comm_tags_on_steps(run_dir: Path, steps: list[int], *, next_to: str | None = None) -> None:
    written = scalars(run_dir)
    assert written.get("comm/bucket_0/time_ms") == steps, sorted(written)
    assert written.get("comm/step/total_ms") == steps
    if next_to is not None:  # the framework's own curve, on the same x axis
        assert written[next_to] == steps


#: The advisor's "(this run)" rows against the step it measured (issue 31's target).
THIS_RUN = 0.02
#: The timeline's step against the framework loop's own clock: the same boundaries up to what
#: the loop does before its first forward (a data fetch). 10% and 3 ms: on a shared 2-core
#: machine one of the two measured steps moved by 4 ms of a 30 ms step; a timeline that missed a
#: micro-batch of the k=2 step would be about half the loop's.
LOOP_CLOCK, LOOP_CLOCK_MS = 0.10, 3.0


def assert_this_run_reproduced(log_dir: Path, step_starts_ms: list[float] | None = None) -> dict:
    """``advise`` on the run's timeline: every "(this run)" row is the measured step within 2%
    (issue 31's target); with the loop's ``step_starts_ms``, the
    measured step is the loop's own (median over the same steps, within :data:`LOOP_CLOCK`)."""
    from ddp_ring_hooks.advisor import advise
    from ddp_ring_hooks.telemetry.timeline import read_timeline

    records = read_timeline(log_dir)
    advice = advise(records)
    run, error = advice["run"], advice["model"]["reproduced_error"]
    own = [r for r in advice["what_if"] if r["this_run"]]
    assert {r["knob"] for r in own} >= {"accumulate", "algorithm", "world_size"}, own
    # Issue 31's target, held here (a run that missed it would have its advice withheld, with the
    # error stated: tests/test_advisor.py's test_a_run_the_model_cannot_reproduce_...).
    assert abs(error) <= THIS_RUN, advice["recommendation"]
    for row in own:
        assert abs(row["step_ms"] / run["step_ms"] - 1) <= THIS_RUN, (row, run)
        assert row["speedup"] == pytest.approx(1.0, abs=THIS_RUN), row
    if step_starts_ms:
        steps = [r for r in records[2:] if hasattr(r, "buckets") and r.micro_batches == run["accumulate"]]
        looped = sorted(step_starts_ms[s.step] - step_starts_ms[s.step - 1] for s in steps if s.step < len(step_starts_ms))
        assert len(looped) >= 2, (len(step_starts_ms), [s.step for s in steps])
        median = looped[(len(looped) - 1) // 2] / 2 + looped[len(looped) // 2] / 2
        assert abs(run["step_ms"] - median) <= LOOP_CLOCK * median + LOOP_CLOCK_MS, (run["step_ms"], looped)
    return advice


# -- transformers' Trainer -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def transformers_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    return launch(tmp_path_factory, "transformers", needs="transformers", timeout=240)


def test_trainer_runs_a_foreign_hook_inside_ours(transformers_run):
    assert_foreign_run(transformers_run[1])


def test_trainer_takes_the_wire_options_and_ranks_agree(transformers_run):
    assert_wire_run(transformers_run[1])


def test_trainer_runs_the_hook_and_native_matches_no_hook(transformers_run):
    for report in transformers_run[1]:
        assert_hook_runs_match(report["runs"])


def test_trainer_takes_diagnose_at_its_callback(transformers_run):
    for report in transformers_run[1]:
        assert_diagnosis_left_on(report["runs"])


def test_trainer_evaluates_and_saves_with_the_hook_paused(transformers_run):
    for result in transformers_run[1]:
        seen = [(what, tuple(pauses)) for what, pauses in result["pauses"]["seen"]]
        # eval_steps=save_steps=2 of 4 steps: at steps 2 and 4 it evaluates, then saves.
        assert seen == [("evaluate", ("evaluation and checkpoint",)), ("save", ("evaluation and checkpoint",))] * 2, seen
        assert result["pauses"]["after"] == [], result["pauses"]  # resumed by the end of training


def test_trainer_with_gradient_accumulation_reduces_once_per_optimizer_step(transformers_run):
    for report in transformers_run[1]:
        ring = report["runs"]["ring"]
        assert ring["global_step"] == ring["hook_iteration"] == 4
        assert len(ring["losses"]) == 4 * 2  # micro-batches: 2 per optimizer step


def test_trainer_recipe_logs_comm_tags_next_to_the_loss(transformers_run):
    out, _ = transformers_run
    (run_dir,) = (out / "runs" / "transformers_trainer" / "runs").iterdir()  # the Trainer's TensorBoard run
    assert_comm_tags_on_steps(run_dir, list(range(1, 7)), next_to="train/loss")
    assert "comm/advice/text_summary" in text_panels(run_dir), "no comm/advice panel"
    output = (out / "output.txt").read_text()
    assert "communication per bucket, rank 0: ring over 2 ranks, 6 steps logged" in output
    assert "communication advice (ddp_ring_hooks advisor)" in output


def test_trainer_runs_this_run_rows_reproduce_the_measured_step(transformers_run):
    """The Trainer at k=2 with its default find_unused_parameters=True (issue 31 read 42.3 ms
    and 1.13x against 47.7 ms measured), and the recipe (k=2, find_unused_parameters=False)."""
    out, reports = transformers_run
    advice = assert_this_run_reproduced(out / "runs" / "trainer_ring", reports[0]["runs"]["ring"]["step_starts_ms"])
    assert advice["run"]["accumulate"] == 2 and advice["run"]["steps"] >= 2
    (recipe,) = (out / "runs" / "transformers_trainer" / "runs").iterdir()
    assert_this_run_reproduced(recipe)


def test_trainer_train_twice_keeps_the_hook_and_says_the_second_is_untimed(transformers_run):
    for rank, report in enumerate(transformers_run[1]):
        second = dict(report["second_train"])
        warnings = second.pop("warnings")
        assert second == {"same_state": True, "comm_hook": "ring_hook", "hook_iteration": 4, "global_step": 4,
                          "max_parameter_difference": pytest.approx(0.0, abs=PARAMETER_ATOL)}
        assert any("this train() is not timed" in message for message in warnings) == (rank == 0)


def test_trainer_default_find_unused_parameters_is_named_on_rank_0(transformers_run):
    rank_0, rank_1 = (report["runs"]["ring"]["warnings"] for report in transformers_run[1])
    assert any("find_unused_parameters=True" in message and "ddp_find_unused_parameters=False" in message
               for message in rank_0)
    assert not any("find_unused_parameters" in message for message in rank_1)


def test_trainer_callback_errors_say_what_is_wrong(transformers_run):
    report = transformers_run[1][0]
    assert report["not_ddp_error"].startswith("ValueError: RingHookCallback hooks the DDP model the Trainer trains")
    assert "found no DistributedDataParallel in GPT2LMHeadModel" in report["not_ddp_error"]
    assert report["not_a_trainer_error"].startswith("TypeError: RingHookCallback(trainer, ...) needs the transformers Trainer")


# -- Accelerate, and plain DDP -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def accelerate_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    return launch(tmp_path_factory, "accelerate", needs="accelerate", timeout=300)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_accelerate_prepared_model_takes_the_hook(accelerate_run, mode):
    from tests.scripts.framework_checks import COMPILE_BACKEND

    suffix = "/eager" if mode == "eager" else f"/{COMPILE_BACKEND}"
    for report in accelerate_run[1]:
        runs = report["runs"]
        assert_hook_runs_match(runs, suffix=suffix)
        expected_type = "DistributedDataParallel" if mode == "eager" else "OptimizedModule"
        assert {runs[f"{a}{suffix}"]["model_type"] for a in ("none", "native", "ring")} == {expected_type}
        assert runs[f"ring{suffix}"]["hook_iteration"] == 4  # 8 micro-batches, accumulating 2


def test_accelerate_runs_log_comm_tags(accelerate_run):
    out, _ = accelerate_run
    assert_comm_tags_on_steps(out / "runs" / "accelerate", [1, 2, 3, 4])  # the recipe
    assert_comm_tags_on_steps(out / "runs" / "accelerate_ring_eager", [1, 2, 3, 4])


def test_accelerate_runs_this_run_rows_reproduce_the_measured_step(accelerate_run):
    out, reports = accelerate_run
    advice = assert_this_run_reproduced(out / "runs" / "accelerate_ring_eager",
                                        reports[0]["runs"]["ring/eager"]["step_starts_ms"])
    assert advice["run"]["accumulate"] == 2
    assert_this_run_reproduced(out / "runs" / "accelerate")  # the recipe


def test_accelerate_save_and_load_state_round_trip_the_hook_state(accelerate_run):
    out, reports = accelerate_run
    assert (out / "runs" / "accelerate" / "checkpoint" / "custom_checkpoint_0.pkl").is_file()  # the recipe's
    for report in reports:
        assert report["checkpoint"] == {"saved_iteration": 4, "restored_iteration": 4, "file_reads_with_weights_only": True}
        auto = report["auto_checkpoint"]
        assert auto["iteration"] == 5 and auto["calibration_restored"] and auto["native_chosen_for_1MiB"]
        assert auto["other_algorithm_iteration"] == 5
        (warning,) = auto["other_algorithm_warning"]
        assert "ran auto" in warning and "keeps tree" in warning


def test_plain_ddp_recipe_runs_as_printed_and_logs_comm_tags(tmp_path):
    # A launch of its own: it makes and destroys its process group, and a second default group
    # made after it in the same torchrun processes (Accelerate's) once hung in init_process_group
    # with one rank already past it.
    output = torchrun(RECIPES / "plain_ddp.py", cwd=tmp_path, timeout=120)
    assert "communication per bucket, rank 0: ring over 2 ranks, 6 steps logged" in output
    assert_comm_tags_on_steps(tmp_path / "runs" / "plain_ddp", list(range(1, 7)))


# -- Lightning Fabric and the Lightning Trainer -----------------------------------------------------


@pytest.fixture(scope="module")
def fabric_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    return launch(tmp_path_factory, "fabric", needs="lightning", timeout=240)


def test_fabric_strategy_runs_the_hook_and_native_matches_no_hook(fabric_run):
    for report in fabric_run[1]:
        runs = report["runs"]
        assert_hook_runs_match(runs)
        assert runs["ring"]["hook_iteration"] == 4  # 8 micro-batches under no_backward_sync, 2 per step
        # DDP's own options go to DDP, the hook's to the hook.
        assert {run["bucket_cap_bytes"] for run in runs.values()} == {int(0.001 * 1024 * 1024)}


def test_fabric_strategy_runs_a_foreign_hook_inside_ours(fabric_run):
    assert_foreign_run(fabric_run[1])
    assert_comm_tags_on_steps(fabric_run[0] / "runs" / "fabric_foreign", [1, 2, 3, 4])


def test_fabric_strategy_takes_the_wire_options_and_ranks_agree(fabric_run):
    assert_wire_run(fabric_run[1])


def test_fabric_runs_log_comm_tags(fabric_run):
    out, _ = fabric_run
    assert_comm_tags_on_steps(out / "runs" / "fabric_ring", [1, 2, 3, 4])
    # The recipe as printed: its log_dir holds the comm tags of its 6 steps (it once wrote none).
    assert "gradients averaged by ring" in (out / "output.txt").read_text()
    assert_comm_tags_on_steps(out / "runs" / "fabric", list(range(1, 7)))


def test_fabric_strategy_takes_diagnose_and_logs_its_cadence(fabric_run):
    out, reports = fabric_run
    for report in reports:
        assert_diagnosis_left_on(report["runs"])
    assert scalars(out / "runs" / "fabric_native")["comm/diagnosis/gather_every"] == [1, 2, 3, 4]


def test_fabric_runs_this_run_rows_reproduce_the_measured_step(fabric_run):
    out, reports = fabric_run
    advice = assert_this_run_reproduced(out / "runs" / "fabric_ring", reports[0]["runs"]["ring"]["step_starts_ms"])
    assert advice["run"]["accumulate"] == 2
    assert_this_run_reproduced(out / "runs" / "fabric")  # the recipe


def test_lightning_trainer_recipe_logs_comm_tags_next_to_the_loss(fabric_run):
    out, _ = fabric_run
    run_dir = out / "runs" / "lightning_trainer" / "lightning_logs" / "version_0"
    written = scalars(run_dir)
    assert written["comm/bucket_0/time_ms"] == list(range(6))  # Lightning's x of step N is N - 1


# -- the docs print the recipes these launches run ------------------------------------------------------


@pytest.mark.fast
def test_docs_print_every_recipe_verbatim():
    page = (ROOT / "docs" / "frameworks.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.DOTALL)
    recipes = sorted(RECIPES.glob("*.py"))
    assert len(recipes) == 5
    for recipe in recipes:
        assert recipe.read_text() in blocks, f"docs/frameworks.md does not print {recipe.name} as it is"
        command = f"torchrun --standalone --nproc_per_node=2 train_examples/recipes/{recipe.name}"
        assert command in page and command in recipe.read_text()
