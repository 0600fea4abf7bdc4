"""The framework integrations on 2 real ranks, one torchrun launch per framework.

Launched by ``tests/test_frameworks.py`` (one launch each: importing a framework costs
seconds per process, so every check of that framework shares it)::

    torchrun --standalone --nproc_per_node=2 tests/scripts/framework_checks.py transformers --out DIR

In each launch, working in ``DIR``:

1. the docs' recipes for the framework run (``train_examples/recipes/*.py``, the files
   ``docs/frameworks.md`` prints), leaving their TensorBoard runs in ``DIR/runs``;
2. the same seeded training runs without a hook, with the hook's ``native`` (DDP's own
   all-reduce through the hook: the very same numbers) and with ``ring``; each run reports
   its losses, what DDP itself names as its communication hook, and how far its final
   parameters are from the run without a hook; transformers and Fabric also run the ring on
   bf16 with error feedback (``ring_bf16``: the options reach the hook through the framework's
   own door), with a digest of the parameters to compare across ranks;
3. what is special to the framework: errors, a second ``train()``, checkpoints, compile.

The ring runs (``ring``; Accelerate's eager one) write a ``log_dir`` and note when each
optimizer step began by the framework's own loop (``step_starts_ms``): the test reads their
timelines with the advisor and holds its "(this run)" rows to the steps the loop measured.

Every rank writes ``DIR/{framework}_rank{r}.json``; the test makes the assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository, when not installed

RECIPES = ROOT / "train_examples" / "recipes"
ALGORITHMS = ("none", "native", "ring")
#: The run on a narrower wire: the ring's options, as a user passes them to the framework's door.
WIRE_RUN, WIRE_OPTIONS = "ring_bf16", {"wire_dtype": "bf16", "error_feedback": True}
#: The run with a user's own DDP hook through ours (``hook=``, issue 29): PyTorch's allreduce_hook,
#: which divides first and all-reduces as DDP without a hook does, so its parameters are "none"'s.
FOREIGN_RUN = "foreign"
#: The one switch a user leaves on (issue 32), on the run whose parameters must stay "none"'s
#: bit for bit: diagnosis watches the all-reduce and never touches a gradient.
DIAGNOSE_OPTIONS = {"diagnose": True}
#: Every run: (name, algorithm, options); the ring last (later checks continue its trainer).
RUNS = (("none", "none", {}), ("native", "native", DIAGNOSE_OPTIONS), (WIRE_RUN, "ring", WIRE_OPTIONS),
        (FOREIGN_RUN, None, {"hook": allreduce_hook}), ("ring", "ring", {}))
#: The torch.compile backend of the compiled Accelerate runs (see docs/frameworks.md, "torch.compile").
COMPILE_BACKEND = os.environ.get("FRAMEWORK_CHECKS_COMPILE_BACKEND", "aot_eager")


def run_recipe(name: str) -> None:
    """A docs recipe, run as its file is printed (torchrun already started this process)."""
    runpy.run_path(str(RECIPES / name), run_name="__main__")


def comm_hook_of(model) -> str | None:
    """What DDP itself reports as the communication hook of the DDP model in ``model``."""
    from ddp_ring_hooks.hooks.unwrap import find_ddp

    return find_ddp(model)._get_ddp_logging_data().get("comm_hook") or None


def max_difference(parameters: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """The largest absolute difference between two lists of parameters (0.0: bit-identical)."""
    return max(float((a - b).abs().max()) for a, b in zip(parameters, reference, strict=True))


def snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def wire_facts(state) -> dict:
    """What the hook state made of the wire options, and a digest of the parameters (ranks compare)."""
    return {"wire": state.algorithm_options.get("wire_dtype"), "error_feedback": state.plan.feedback is not None,
            "hook": state.hook.name if state.hook is not None else None}


def parameters_digest(parameters: list[torch.Tensor]) -> str:
    import hashlib

    return hashlib.sha256(b"".join(p.contiguous().view(torch.uint8).numpy().tobytes() for p in parameters)).hexdigest()


def caught_messages(caught) -> list[str]:
    return [str(warning.message) for warning in caught]


def error_of(action) -> str:
    try:
        action()
    except Exception as error:  # noqa: BLE001 - the message is what the test reads
        return f"{type(error).__name__}: {error}"
    return "no error"


# -- transformers' Trainer ---------------------------------------------------------------------


def transformers_checks(out: Path) -> dict:
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, set_seed

    from ddp_ring_hooks.integrations.transformers import RingHookCallback

    run_recipe("transformers_trainer.py")
    transformers.logging.set_verbosity_error()
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=128,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # no dropout: runs comparable bit for bit
    tokens = torch.randint(0, 128, (32, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": t, "labels": t} for t in tokens]

    class LossRecordingTrainer(Trainer):
        """Keeps every micro-batch's loss (the Trainer's logs average and round them)."""

        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            self.losses.append(float((loss[0] if isinstance(loss, tuple) else loss).detach()))
            return loss

    def trainer_for(algorithm: str) -> LossRecordingTrainer:
        set_seed(0)
        args = TrainingArguments(
            str(out / f"trainer_{algorithm}"), max_steps=4, per_device_train_batch_size=2, gradient_accumulation_steps=2,
            learning_rate=1e-3, use_cpu=True, ddp_backend="gloo", report_to="none", save_strategy="no",
            disable_tqdm=True, seed=0,
        )
        trainer = LossRecordingTrainer(model=GPT2LMHeadModel(config), args=args, train_dataset=data)
        trainer.losses = []
        return trainer

    class StepClock(TrainerCallback):
        """When the Trainer began each optimizer step (its first micro-batch), on its own loop."""

        def __init__(self):
            self.starts_ms: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.starts_ms.append(time.perf_counter() * 1e3)

    results: dict = {"runs": {}}
    reference = None
    for run, algorithm, options in RUNS:
        trainer = trainer_for(run)
        callback, clock = None, StepClock()
        if algorithm != "none":
            # The ring run (k=2, the Trainer's default find_unused_parameters=True) writes its timeline.
            timed = {"log_dir": str(out / "runs" / "trainer_ring")} if run == "ring" else {}
            callback = RingHookCallback(trainer, algorithm=algorithm, print_summary=False, **timed, **options)
            trainer.add_callback(callback)
            trainer.add_callback(clock)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
        parameters = snapshot(trainer.model)
        reference = reference or parameters
        results["runs"][run] = {
            "losses": list(trainer.losses),
            "comm_hook": comm_hook_of(trainer.model_wrapped),
            "max_parameter_difference": max_difference(parameters, reference),
            "global_step": trainer.state.global_step,
            "hook_iteration": callback.hook_state.iteration if callback else None,
            "warnings": caught_messages(caught),
            **(wire_facts(callback.hook_state) if callback else {}),
            "summary": callback.hook_state.summary() if callback else None,
            "digest": parameters_digest(parameters),
            "step_starts_ms": clock.starts_ms,
        }
    # A second train() keeps the DDP model and its hook: nothing registers twice, the hook
    # still averages (the same parameters as a second train() without a hook), untimed.
    first_state, ring_trainer = callback.hook_state, trainer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ring_trainer.train()
    plain_trainer = trainer_for("none")
    plain_trainer.train()
    plain_trainer.train()
    results["second_train"] = {
        "same_state": callback.hook_state is first_state,
        "comm_hook": comm_hook_of(ring_trainer.model_wrapped),
        "hook_iteration": callback.hook_state.iteration,
        "global_step": ring_trainer.state.global_step,
        "max_parameter_difference": max_difference(snapshot(ring_trainer.model), snapshot(plain_trainer.model)),
        "warnings": caught_messages(caught),
    }
    # Evaluation and checkpoints run with the hook paused (the stall watchdog is told): what
    # the watchdog says while the Trainer evaluates and while it writes a checkpoint.
    class PauseRecordingTrainer(Trainer):
        def evaluate(self, *args, **kwargs):
            self.pauses.append(("evaluate", self.ring.hook_state.observation.watchdog.pauses))
            return super().evaluate(*args, **kwargs)

        def _save_checkpoint(self, *args, **kwargs):
            self.pauses.append(("save", self.ring.hook_state.observation.watchdog.pauses))
            return super()._save_checkpoint(*args, **kwargs)

    set_seed(0)
    pausing = PauseRecordingTrainer(model=GPT2LMHeadModel(config), train_dataset=data, eval_dataset=data[:4], args=TrainingArguments(
        str(out / "trainer_paused"), max_steps=4, per_device_train_batch_size=2, learning_rate=1e-3, use_cpu=True,
        ddp_backend="gloo", report_to="none", eval_strategy="steps", eval_steps=2, save_strategy="steps",
        save_steps=2, disable_tqdm=True, seed=0,
    ))
    pausing.pauses, pausing.ring = [], RingHookCallback(pausing, print_summary=False)
    pausing.add_callback(pausing.ring)
    pausing.train()
    results["pauses"] = {"seen": pausing.pauses, "after": pausing.ring.hook_state.observation.watchdog.pauses}

    # Before train() the Trainer has not wrapped the model: the callback says so.
    unwrapped = trainer_for("unwrapped")
    results["not_ddp_error"] = error_of(
        lambda: RingHookCallback(unwrapped).on_train_begin(unwrapped.args, unwrapped.state, unwrapped.control)
    )
    results["not_a_trainer_error"] = error_of(lambda: RingHookCallback(unwrapped.model))
    return results


# -- Accelerate ---------------------------------------------------------------------------------------


def accelerate_checks(out: Path) -> dict:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    import ddp_ring_hooks
    from ddp_ring_hooks import HookState
    from ddp_ring_hooks.cost_model import Calibration

    run_recipe("accelerate_prepare.py")
    features = 16
    generator = torch.Generator().manual_seed(dist.get_rank())
    inputs, targets = torch.randn(128, features, generator=generator), torch.randn(128, 1, generator=generator)

    def train(algorithm: str, backend: str | None, run: str):
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, dynamo_backend=backend)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(features, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, targets), batch_size=8)
        model, optimizer, data = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05), data)
        state = None
        if algorithm != "none":
            state = ddp_ring_hooks.register(model, algorithm=algorithm, log_dir=str(out / "runs" / run))
        losses, starts_ms = [], []
        for index, (x, y) in enumerate(data):
            if index % 2 == 0:  # the first micro-batch of an optimizer step (accumulating 2)
                starts_ms.append(time.perf_counter() * 1e3)
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(float(loss.detach()))
        accelerator.step_starts_ms = starts_ms
        return accelerator, model, state, losses

    results: dict = {"runs": {}}
    for backend in (None, COMPILE_BACKEND):
        if backend is not None:
            # The dynamo backend lives in Accelerate's process-wide state, fixed by the first
            # Accelerator; its own tests reset that state between configurations the same way.
            AcceleratorState._reset_state()
        reference = None
        for algorithm in ALGORITHMS:
            accelerator, model, state, losses = train(algorithm, backend, f"accelerate_{algorithm}_{backend or 'eager'}")
            parameters = snapshot(model)
            reference = reference or parameters
            results["runs"][f"{algorithm}/{backend or 'eager'}"] = {
                "losses": losses,
                "model_type": type(model).__name__,
                "comm_hook": comm_hook_of(model),
                "max_parameter_difference": max_difference(parameters, reference),
                "hook_iteration": state.iteration if state else None,
                "step_starts_ms": accelerator.step_starts_ms,
            }
            if state is not None:
                state.close()
    # save_state / load_state through Accelerate's own files: the step counter comes back.
    accelerator, model, state, _ = train("ring", None, "accelerate_checkpoint")
    accelerator.register_for_checkpointing(state)
    accelerator.save_state(str(out / "checkpoint_ring"))
    accelerator.wait_for_everyone()  # rank 0 writes the files the others load
    saved_iteration, state.iteration = state.iteration, 0
    accelerator.load_state(str(out / "checkpoint_ring"))
    results["checkpoint"] = {
        "saved_iteration": saved_iteration,
        "restored_iteration": state.iteration,
        "file_reads_with_weights_only": torch.load(
            out / "checkpoint_ring" / "custom_checkpoint_0.pkl", weights_only=True
        ) == state.state_dict(),
    }
    state.close()
    # auto's calibration comes back too, replacing the resumed run's own.
    saved_calibration = {"ring": Calibration(1e-3, 1e-12), "native": Calibration(0.0, 1e-9)}
    saving = Accelerator(cpu=True, gradient_accumulation_steps=2)
    auto = HookState(algorithm="auto", candidates=("ring", "native"), calibration=saved_calibration)
    auto.iteration = 5
    saving.register_for_checkpointing(auto)
    saving.save_state(str(out / "checkpoint_auto"))
    saving.wait_for_everyone()
    resuming = Accelerator(cpu=True, gradient_accumulation_steps=2)
    resumed = HookState(algorithm="auto", candidates=("ring", "native"), calibration=Calibration(0.0, 0.0))
    resuming.register_for_checkpointing(resumed)
    resuming.load_state(str(out / "checkpoint_auto"))
    different = HookState(algorithm="tree")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        different.load_state_dict(auto.state_dict())
    results["auto_checkpoint"] = {
        "iteration": resumed.iteration,
        "calibration_restored": resumed.state_dict()["auto"] == auto.state_dict()["auto"],
        "native_chosen_for_1MiB": resumed.schedule_for(torch.empty(1 << 18)) is None,  # as the saved numbers say
        "other_algorithm_warning": caught_messages(caught),
        "other_algorithm_iteration": different.iteration,
    }
    return results


# -- Lightning (Fabric and the Trainer) -----------------------------------------------------------


def fabric_checks(out: Path) -> dict:
    run_recipe("lightning_trainer.py")
    run_recipe("fabric_strategy.py")
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    from ddp_ring_hooks.hooks.unwrap import find_ddp
    from ddp_ring_hooks.integrations.fabric import RingDDPFabricStrategy

    features, bucket_cap_mb = 16, 0.001
    generator = torch.Generator().manual_seed(dist.get_rank())
    batches = [(torch.randn(8, features, generator=generator), torch.randn(8, 1, generator=generator)) for _ in range(8)]

    results: dict = {"runs": {}}
    reference = None
    for run, algorithm, options in RUNS:
        if algorithm == "none":
            strategy = DDPStrategy(bucket_cap_mb=bucket_cap_mb)
        else:
            log_dir = str(out / "runs" / f"fabric_{run}")
            strategy = RingDDPFabricStrategy(algorithm=algorithm, log_dir=log_dir, bucket_cap_mb=bucket_cap_mb, **options)
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
        fabric.launch()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(features, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
        losses, starts_ms = [], []
        for index, (x, y) in enumerate(batches):
            stepping = index % 2 == 1  # accumulate 2 micro-batches per optimizer step
            if not stepping:
                starts_ms.append(time.perf_counter() * 1e3)
            with fabric.no_backward_sync(model, enabled=not stepping):
                loss = torch.nn.functional.mse_loss(model(x), y)
                fabric.backward(loss)
            if stepping:
                optimizer.step()
                optimizer.zero_grad()
            losses.append(float(loss.detach()))
        parameters = snapshot(model)
        reference = reference or parameters
        state = getattr(fabric.strategy, "hook_state", None)
        results["runs"][run] = {
            "losses": losses,
            "comm_hook": comm_hook_of(model),
            "max_parameter_difference": max_difference(parameters, reference),
            "hook_iteration": state.iteration if state else None,
            "bucket_cap_bytes": find_ddp(model).bucket_bytes_cap,
            **(wire_facts(state) if state else {}),
            "summary": state.summary() if state else None,
            "digest": parameters_digest(parameters),
            "step_starts_ms": starts_ms,
        }
        if state is not None:
            state.close()
    return results


CHECKS = {"transformers": transformers_checks, "accelerate": accelerate_checks, "fabric": fabric_checks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("framework", choices=sorted(CHECKS))
    parser.add_argument("--out", type=Path, required=True, help="working directory; results go here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = args.out.resolve()
    os.chdir(out)  # the recipes write their runs/ here
    results = CHECKS[args.framework](out)
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
    (out / f"{args.framework}_rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
