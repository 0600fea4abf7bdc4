"""The Lightning integration on real gloo ranks: hook attached, same losses, accumulation, resume.

All cases run in one spawn of two ranks (Lightning's import alone costs seconds per process);
each rank returns plain numbers and the assertions run here.
"""

from __future__ import annotations

import math
import os

import pytest

pytest.importorskip("lightning")

from tests._dist import run_ranks

WORLD_SIZE = 2
MODEL = {"seq_len": 16, "width": 32, "num_layers": 2, "num_heads": 2}
MICRO_BATCH = 2
BUCKET_CAP_MB = 0.02  # a ~90 KB model: several buckets after DDP's rebuild
# Losses of the ring hook and of Lightning's plain DDP: with two ranks both compute
# (a + b) / 2 exactly (halving is exact in binary floating point), so they should agree to
# the last bit; the tolerance allows one rounding difference in a differently ordered sum.
LOSS_RTOL = 1e-6


def _lightning_cases(rank: int, world_size: int, directory: str) -> dict:
    # The ranks and the process group exist already; these variables tell Lightning that the
    # processes were started from outside (as by torchrun), so it launches none of its own
    # (and, the group being initialised, it never connects to the address).
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger

    import ddp_ring_hooks.integrations.lightning as ring_lightning
    from ddp_ring_hooks import HookState, ring_hook
    from ddp_ring_hooks.telemetry import MemorySink
    from train_examples.char_lm import CharLanguageModel, make_dataloader, quiet_lightning

    quiet_lightning()

    class RecordLosses(pl.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.comm_hook: str | None = None

        def on_train_start(self, trainer, pl_module) -> None:
            self.comm_hook = ring_lightning.reported_comm_hook(trainer.strategy.model)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.losses.append(float(outputs["loss"]))

    def fit(strategy, *, max_steps, accumulate=1, logger=False, callbacks=(), ckpt_path=None, save_to=None):
        pl.seed_everything(0, verbose=False)
        model = CharLanguageModel(**MODEL)
        record = RecordLosses()
        trainer = pl.Trainer(
            accelerator="cpu", devices=world_size, strategy=strategy, max_steps=max_steps,
            accumulate_grad_batches=accumulate, logger=logger, callbacks=[record, *callbacks],
            log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, make_dataloader(seq_len=MODEL["seq_len"], micro_batch=MICRO_BATCH), ckpt_path=ckpt_path)
        if save_to:
            trainer.save_checkpoint(save_to)
        parameters = [p.detach().clone() for p in model.parameters()]
        return trainer, record, parameters

    results: dict = {}

    # 1. Our strategy vs Lightning's DDPStrategy given our hook: on CPU Lightning silently
    #    drops the hook (plain DDP), ours attaches it. Same losses either way.
    ring_trainer, ring, ring_parameters = fit(ring_lightning.RingDDPStrategy(bucket_cap_mb=BUCKET_CAP_MB), max_steps=4)
    plain_strategy = pl.strategies.DDPStrategy(
        bucket_cap_mb=BUCKET_CAP_MB, ddp_comm_hook=ring_hook, ddp_comm_state=HookState()
    )
    _, plain, plain_parameters = fit(plain_strategy, max_steps=4)
    results["ring_hook_reported"] = ring.comm_hook
    results["ring_hook_kept_after_fit"] = ring_trainer.strategy.reported_comm_hook
    results["lightning_ddp_hook_reported"] = plain.comm_hook
    results["ring_losses"], results["plain_losses"] = ring.losses, plain.losses
    results["max_parameter_difference"] = max(
        float((a - b).abs().max()) for a, b in zip(ring_parameters, plain_parameters)
    )
    results["ring_parameters"] = ring_parameters
    # 1b. native through the strategy: bit-identical to Lightning's plain DDP.
    _, native, native_parameters = fit(
        ring_lightning.RingDDPStrategy("native", bucket_cap_mb=BUCKET_CAP_MB), max_steps=4
    )
    results["native_hook_reported"] = native.comm_hook
    results["native_matches_plain_bitwise"] = all(a.equal(b) for a, b in zip(native_parameters, plain_parameters))
    # 1c. a user's own hook through the strategy (hook=, issue 29): PyTorch's allreduce_hook, timed
    #     inside ours; it divides first and all-reduces, as plain DDP does: the same bits.
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    foreign_trainer, foreign, foreign_parameters = fit(
        ring_lightning.RingDDPStrategy(hook=allreduce_hook, bucket_cap_mb=BUCKET_CAP_MB), max_steps=4
    )
    results["foreign_hook_reported"] = foreign.comm_hook
    results["foreign_hook_name"] = foreign_trainer.strategy.hook_state.hook.name
    results["foreign_matches_plain_bitwise"] = all(a.equal(b) for a, b in zip(foreign_parameters, plain_parameters))

    # 2. Accumulation: 3 micro-batches per optimizer step; the hook reduces once per step.
    #    Every HookState option passes through the strategy (one lane here; bf16 on the wire with
    #    error feedback, which under accumulation waits for the synced micro-batch).
    memory = MemorySink()
    strategy = ring_lightning.RingDDPStrategy(
        bucket_cap_mb=BUCKET_CAP_MB, sinks=[memory], concurrent_buckets=1,
        algorithm_options={"wire_dtype": "bf16"}, error_feedback=True,
    )
    trainer, record, parameters = fit(strategy, max_steps=2, accumulate=3)
    results["accumulation"] = {
        "wire": sorted({b.wire for r in memory.records for b in r.buckets}),
        "wire_ratio": sorted({b.wire_ratio for r in memory.records for b in r.buckets}),
        "feedback": strategy.hook_state.summary().splitlines()[-1],
        "parameters": parameters,
        "lanes": (strategy.hook_state.concurrent_buckets, strategy.hook_state.timeline.run.concurrent_buckets),
        "micro_batches": len(record.losses),
        "global_step": trainer.global_step,
        "hook_iterations": strategy.hook_state.iteration,
        "recorded_steps": [r.step for r in memory.records],
        "bucket_indices": [[b.index for b in r.buckets] for r in memory.records],
    }

    # 3. Checkpoint saved with the hook, resumed into a new Trainer: hook attached again and
    #    its step counter continues from the checkpoint's step.
    checkpoint = os.path.join(directory, "ring.ckpt")
    fit(ring_lightning.RingDDPStrategy(bucket_cap_mb=BUCKET_CAP_MB), max_steps=2, save_to=checkpoint)
    memory = MemorySink()
    strategy = ring_lightning.RingDDPStrategy(bucket_cap_mb=BUCKET_CAP_MB, sinks=[memory])
    trainer, record, _ = fit(strategy, max_steps=4, ckpt_path=checkpoint)
    results["resume"] = {
        "comm_hook": record.comm_hook,
        "global_step": trainer.global_step,
        "hook_iterations": strategy.hook_state.iteration,
        "recorded_steps": [r.step for r in memory.records],
        "losses": record.losses,
    }

    # 4. Telemetry and throughput in the Trainer's own TensorBoard run, by strategy name.
    logger = TensorBoardLogger(directory, name="", version="callbacks")
    throughput = ring_lightning.ThroughputLogger(tokens_per_sample=MODEL["seq_len"])
    trainer, _, _ = fit("ddp_ring", max_steps=3, logger=logger,
                        callbacks=[ring_lightning.CommTimingLogger(), throughput])
    results["by_name"] = type(trainer.strategy).__name__
    results["throughput"] = [(s.step, s.micro_batches, s.samples, s.seconds) for s in throughput.history]
    results["log_dir"] = logger.log_dir

    # 5. One Trainer, fit twice (train on after the first fit): the second fit's hook is a
    #    new one, and its timing still reaches the CommTimingLogger's run.
    #    With diagnose=True the straggler and cadence tags go there too (its warm-up gathers
    #    every step).
    logger = TensorBoardLogger(directory, name="", version="refit")
    trainer, _, _ = fit(ring_lightning.RingDDPStrategy(diagnose=True), max_steps=2, logger=logger,
                        callbacks=[ring_lightning.CommTimingLogger()])
    trainer.fit_loop.epoch_loop.max_steps = 4
    trainer.fit(CharLanguageModel(**MODEL), make_dataloader(seq_len=MODEL["seq_len"], micro_batch=MICRO_BATCH))
    results["refit_log_dir"] = logger.log_dir

    # 6. Validation and checkpoint writes run with the hook paused (the stall watchdog is told):
    #    what the watchdog says in a validation step, and while Lightning's CheckpointIO writes.
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    pauses: list = []

    class Validated(CharLanguageModel):
        def validation_step(self, batch, batch_index):
            pauses.append(("validation_step", trainer.strategy.hook_state.observation.watchdog.pauses))

    class RecordingIO(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            pauses.append(("save_checkpoint", trainer.strategy.hook_state.observation.watchdog.pauses))
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)

    pl.seed_everything(0, verbose=False)
    loader = make_dataloader(seq_len=MODEL["seq_len"], micro_batch=MICRO_BATCH)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=ring_lightning.RingDDPStrategy(), max_steps=2, logger=False,
        val_check_interval=1, limit_val_batches=1, num_sanity_val_steps=0, enable_progress_bar=False,
        enable_model_summary=False, plugins=[RecordingIO()],
        callbacks=[ModelCheckpoint(dirpath=os.path.join(directory, "paused"), every_n_train_steps=1, save_top_k=-1)],
    )
    trainer.fit(Validated(**MODEL), loader, loader)
    fitted = len(pauses)
    trainer.save_checkpoint(os.path.join(directory, "paused.ckpt"))  # after the fit: the hook is closed
    results["pauses"] = {"during_fit": pauses[:fitted], "after_fit": pauses[fitted:]}
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("lightning"))
    return run_ranks(_lightning_cases, WORLD_SIZE, directory, timeout=240)


def test_ring_strategy_attaches_hook_on_cpu_where_lightning_ddp_drops_it(ranks):
    for result in ranks:
        assert result["ring_hook_reported"] == "ring_hook"
        assert result["ring_hook_kept_after_fit"] == "ring_hook"
        assert result["lightning_ddp_hook_reported"] is None  # Lightning's CUDA-only guard
        assert result["by_name"] == "RingDDPStrategy"


def test_ring_hook_losses_match_lightning_default_ddp(ranks):
    for result in ranks:
        ring, plain = result["ring_losses"], result["plain_losses"]
        assert len(ring) == len(plain) == 4
        assert ring[0] != ring[-1]  # training moved
        for a, b in zip(ring, plain):
            assert math.isclose(a, b, rel_tol=LOSS_RTOL), (ring, plain)
        assert result["max_parameter_difference"] <= 1e-6
    # Every rank ends with the same weights, bit for bit.
    for a, b in zip(ranks[0]["ring_parameters"], ranks[1]["ring_parameters"]):
        assert a.equal(b)


def test_native_strategy_trains_bit_identically_to_lightning_ddp(ranks):
    for result in ranks:
        assert result["native_hook_reported"] == "ring_hook"
        assert result["native_matches_plain_bitwise"]


def test_a_foreign_hook_through_the_strategy_trains_bit_identically_to_lightning_ddp(ranks):
    for result in ranks:
        assert result["foreign_hook_reported"] == "ring_hook" and result["foreign_hook_name"] == "allreduce_hook"
        assert result["foreign_matches_plain_bitwise"]


def test_accumulation_reduces_once_per_optimizer_step(ranks):
    for result in ranks:
        accumulation = result["accumulation"]
        assert accumulation["lanes"] == (1, 1)
        assert accumulation["wire"] == ["bfloat16"] and accumulation["wire_ratio"] == [0.5]
        assert accumulation["feedback"].startswith("error feedback: residuals of")
        assert accumulation["micro_batches"] == 6
        assert accumulation["global_step"] == 2
        assert accumulation["hook_iterations"] == 2  # one DDP reduction per step, not per micro-batch
        assert accumulation["recorded_steps"] == [1, 2]
        for indices in accumulation["bucket_indices"]:
            assert indices == list(range(len(indices)))  # each bucket once, in order
    first = ranks[0]["accumulation"]["parameters"]
    assert all(all(a.equal(b) for a, b in zip(first, r["accumulation"]["parameters"])) for r in ranks)


def test_checkpoint_resumes_with_hook_attached(ranks):
    for result in ranks:
        resume = result["resume"]
        assert resume["comm_hook"] == "ring_hook"
        assert resume["global_step"] == 4
        assert resume["hook_iterations"] == 4  # counter continued from step 2
        assert resume["recorded_steps"] == [3, 4]
        assert len(resume["losses"]) == 2 and all(math.isfinite(x) for x in resume["losses"])


def test_comm_and_throughput_share_the_loss_axis_in_the_trainers_run(ranks):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rank_zero = ranks[0]
    events = EventAccumulator(rank_zero["log_dir"])
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "comm/step/total_ms", "throughput/samples_per_s", "throughput/tokens_per_s"} <= tags
    loss_steps = sorted({e.step for e in events.Scalars("train/loss")})
    comm = events.Scalars("comm/step/total_ms")
    samples_per_s = events.Scalars("throughput/samples_per_s")
    assert loss_steps == [0, 1, 2]
    assert [e.step for e in comm] == loss_steps
    assert [e.step for e in samples_per_s] == loss_steps
    assert all(e.value > 0 for e in comm)
    # samples/s = all ranks' samples over the step's wall time, as recorded by the callback.
    for event, (step, micro_batches, samples, seconds) in zip(samples_per_s, rank_zero["throughput"]):
        assert micro_batches == 1 and samples == MICRO_BATCH * WORLD_SIZE
        assert math.isclose(event.value, samples / seconds, rel_tol=1e-5)


def test_a_second_fit_of_the_same_trainer_logs_its_comm_timing(ranks):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(ranks[0]["refit_log_dir"])
    events.Reload()
    assert [e.step for e in events.Scalars("comm/step/total_ms")] == [0, 1, 2, 3]
    for tag in ("comm/ranks/straggler_rank", "comm/ranks/straggler_wait_ms", "comm/ranks/arrival_spread_ms",
                "comm/diagnosis/gather_every", "comm/diagnosis/cost_ms"):
        assert [e.step for e in events.Scalars(tag)] == [0, 1, 2, 3], tag
    assert {e.value for e in events.Scalars("comm/ranks/straggler_rank")} <= {0.0, 1.0}


def test_validation_and_checkpoint_writes_run_with_the_hook_paused(ranks):
    for rank, result in enumerate(ranks):
        seen = [(what, tuple(pauses)) for what, pauses in result["pauses"]["during_fit"]]
        # val_check_interval=1 and a checkpoint every step, for max_steps=2; rank 0 writes them.
        assert [entry for entry in seen if entry[0] == "validation_step"] == [("validation_step", ("validation",))] * 2, seen
        saves = [entry for entry in seen if entry[0] == "save_checkpoint"]
        assert saves == ([("save_checkpoint", ("checkpoint",))] * 2 if rank == 0 else []), seen
        # After the fit the hook is closed: a checkpoint then pauses nothing.
        assert [(what, tuple(p)) for what, p in result["pauses"]["after_fit"]] == (
            [("save_checkpoint", ())] if rank == 0 else []), result["pauses"]


@pytest.mark.fast
def test_bad_arguments_get_errors_that_name_the_fix():
    import lightning.pytorch as pl

    from ddp_ring_hooks import HookState, ring_hook
    from ddp_ring_hooks.integrations.lightning import CommTimingLogger, RingDDPStrategy
    from ddp_ring_hooks.telemetry import TelemetryOptions

    with pytest.raises(ValueError, match="cannot take ddp_comm_hook="):
        RingDDPStrategy(ddp_comm_hook=ring_hook, ddp_comm_state=HookState())
    with pytest.raises(ValueError, match="unknown algorithm 'rign' \\(did you mean 'ring'\\?\\); choose one of ring"):
        RingDDPStrategy("rign")
    with pytest.raises(ValueError, match="concurrent_buckets must be an integer >= 1"):
        RingDDPStrategy(concurrent_buckets=0)
    with pytest.raises(ValueError, match="telemetry option 'log_every' given twice"):
        RingDDPStrategy(telemetry=TelemetryOptions(log_every=2), log_every=3)
    with pytest.raises(ValueError, match="stall_timeout=1 s must be longer than stall_after=2 s"):
        RingDDPStrategy(stall_after=2, stall_timeout=1)
    strategy = RingDDPStrategy(stall_after=2, stall_timeout=8)
    assert (strategy.register_options["stall_after"], strategy.register_options["stall_timeout"]) == (2, 8)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="ddp", logger=False, enable_progress_bar=False)
    with pytest.raises(TypeError, match='pass strategy="ddp_ring"'):
        CommTimingLogger().setup(trainer, None, "fit")


@pytest.mark.fast
@pytest.mark.timeout(400)
def test_both_strategies_take_every_option_the_same_way_and_check_it_when_built():
    """Lightning's and Fabric's strategies: an algorithm's options as keywords (or a mapping),
    DDP's and the strategy's own sent to them, the hook's checked at construction."""
    from ddp_ring_hooks.integrations.fabric import RingDDPFabricStrategy
    from ddp_ring_hooks.integrations.lightning import RingDDPStrategy
    from ddp_ring_hooks.telemetry import TelemetryOptions

    lightning = RingDDPStrategy(algorithm="tree", segments=4, bucket_cap_mb=2, log_every=5)
    assert lightning.register_options == {"algorithm": "tree", "algorithm_options": None, "segments": 4, "log_every": 5}
    assert lightning._ddp_kwargs == {"bucket_cap_mb": 2}  # DDPStrategy passes these to DistributedDataParallel
    fabric = RingDDPFabricStrategy(algorithm="tree", segments=4, bucket_cap_mb=2, log_every=5)
    assert fabric.register_options == {"algorithm": "tree", "segments": 4, "log_every": 5}
    assert fabric._ddp_kwargs == {"bucket_cap_mb": 2}
    for build in (RingDDPStrategy, RingDDPFabricStrategy):
        with pytest.raises(TypeError, match="unknown option 'segmnts' \\(did you mean 'segments'\\?\\)"):
            build(algorithm="tree", segmnts=4)
        with pytest.raises(ValueError, match="segments"):
            build(algorithm="tree", segments=0)
        with pytest.raises(TypeError, match="option 'segments' given twice"):
            build(algorithm="tree", algorithm_options={"segments": 2}, segments=4)
        with pytest.raises(ValueError, match="telemetry option 'log_every' given twice"):
            build(telemetry=TelemetryOptions(log_every=2), log_every=3)


def test_the_readme_resume_command_continues_in_the_same_run(tmp_path, capsys):
    """train_char_lm.py, then the same command with --resume last, as docs/lightning.md prints them: the
    second run trains --max-steps more steps (it once trained none and ended in
    KeyError: 'train/loss') and continues the first run's TensorBoard curve (it once left an
    empty version_1). A wrong --resume is refused before any training, by the script's own
    ``main`` in this process (a process of its own would spend its seconds importing Lightning)."""
    import importlib
    import subprocess
    import sys
    from pathlib import Path

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = Path(__file__).resolve().parents[1]
    output = tmp_path / "char_lm"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(root / "train_examples" / "train_char_lm.py"), "--max-steps", "2", "--micro-batch", "2",
        "--seq-len", "16", "--width", "32", "--layers", "1", "--heads", "2", "--output-dir", str(output),
    ]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}

    def train(*extra: str) -> str:
        done = subprocess.run([*command, *extra], env=environment, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout

    sys.path.insert(0, str(root / "train_examples"))  # as `python train_examples/train_char_lm.py` has it
    try:
        script = importlib.import_module("train_char_lm")
    finally:
        sys.path.remove(str(root / "train_examples"))

    def refused(*extra: str) -> str:  # before any training: no torchrun needed
        with pytest.raises(SystemExit) as done:
            script.main(["--output-dir", str(output), *extra])
        # SystemExit with a message: Python prints it to stderr and exits with status 1.
        assert isinstance(done.value.code, str) and not capsys.readouterr().out, done.value.code
        return done.value.code

    assert f"--resume last: no checkpoint to resume; there is none under {output} yet" in refused("--resume", "last")
    train()
    (checkpoint,) = (output / "version_0" / "checkpoints").glob("*.ckpt")
    assert (output / "version_0" / "timeline.jsonl").read_text().startswith('{"type":"run"')  # for `advise`
    wrong = refused("--resume", str(checkpoint.with_name("epoch=0-step=200.ckpt")))
    assert f"no such checkpoint file; checkpoints under {output}: {checkpoint}" in wrong
    resumed = subprocess.run([*command, "--resume", "last"], env=environment, capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "trained optimizer steps 3-4" in resumed.stdout
    # Lightning's warning, said once in words that tell what happens to the data order.
    assert f"resuming from {checkpoint} (step 2); note: the data loader keeps no place in its epoch" in resumed.stdout
    assert "dataloader is not resumable. This can cause" not in resumed.stderr
    assert sorted(p.name for p in output.iterdir()) == ["version_0"]
    events = EventAccumulator(str(output / "version_0"))
    events.Reload()
    assert sorted({event.step for event in events.Scalars("train/loss")}) == [0, 1, 2, 3]
