"""transformers' ``Trainer`` with the ring hook: one callback, timing in the Trainer's own run.

::

    from ddp_ring_hooks.integrations.transformers import RingHookCallback

    trainer = Trainer(model=model, args=TrainingArguments(..., report_to="tensorboard"), train_dataset=data)
    trainer.add_callback(RingHookCallback(trainer, algorithm="ring"))
    trainer.train()                              # torchrun --nproc_per_node=N train.py

Why a callback that holds the trainer: the Trainer has no communication-hook option, builds
its own DDP settings (through Accelerate), and hands callbacks the *unwrapped* model, so
neither the arguments nor a callback's ``model`` reach the DDP. ``trainer.model_wrapped``
does: from ``on_train_begin`` on it is the DDP model (or ``torch.compile``'s wrapper around
it), and no backward has run yet, the moment DDP allows a hook to be registered.

1. ``on_train_begin`` finds the DDP in ``trainer.model_wrapped`` and registers the hook with
   ``register_options`` (those of :func:`ddp_ring_hooks.register`). The hook's step counter
   starts at the Trainer's ``global_step``, so a resumed run continues its curves. A new DDP
   (``auto_find_batch_size`` builds one per try) gets a hook of its own.
2. Timing goes into the Trainer's TensorBoard run (``report_to="tensorboard"``: the
   directory its ``TensorBoardCallback`` writes to), as ``comm/*`` next to ``train/loss``,
   on the same x axis; ``log_dir=`` puts it elsewhere; with neither, nothing is written.
3. Evaluation and checkpoints: when a step ends with the Trainer about to evaluate or save
   (``control.should_evaluate``, ``control.should_save``), the hook's stall watchdog is paused
   (``HookState.paused``) until the next step (or epoch) begins: a rank slower at those is not
   reported as busy to the ranks that wait for it in the next step's first bucket.
4. ``on_train_end``: rank 0 prints the per-bucket summary and the advisor's advice, and the
   hook state closes: its files complete, the advice added as the ``comm/advice`` text panel.

A second ``train()`` on the same trainer keeps its DDP model, which keeps its hook (DDP takes
one per model, once): the gradients are still averaged by it, but that ``train()`` is not
timed, and a warning says so.

How the steps line up with ``gradient_accumulation_steps=3``::

    micro-batch        1        2        3    |    4        5        6    |
    DDP                no_sync  no_sync  sync |    no_sync  no_sync  sync |
    ring_hook                          buckets|                   buckets|
    global_step (x)                      1    |                     2    |

The Trainer logs the loss of optimizer step N at ``global_step`` N, and the hook's reduction
of step N is its step N.

This is the only module of the package that imports transformers.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback
from transformers.integrations import TensorBoardCallback

from ..hooks import HookState, register
from ..hooks.advice import advice_text
from ..hooks.options import check_register_options
from ..hooks.unwrap import find_ddp


class RingHookCallback(TrainerCallback):
    """Attach :func:`~ddp_ring_hooks.ring_hook` to the DDP model a transformers ``Trainer`` trains.

    Args:
        trainer: the ``Trainer`` (its ``model_wrapped`` is the DDP model once training starts).
        print_summary: print the per-bucket summary and the advice at the end of training (rank 0).
        **register_options: what :func:`ddp_ring_hooks.register` takes (``algorithm=``,
            ``log_every=``, ``spread_every=``, ...); ``log_dir=`` writes there instead of the
            Trainer's TensorBoard run (``log_dir=None``: no files).

    After ``on_train_begin``, :attr:`hook_state` is the :class:`~ddp_ring_hooks.HookState`
    (``summary()``, ``advise()``, ``state_dict()``; closed at ``on_train_end``) and
    :attr:`log_dir` where it logs.
    """

    def __init__(self, trainer: Any, *, print_summary: bool = True, **register_options: Any) -> None:
        if not hasattr(trainer, "model_wrapped"):
            raise TypeError(
                f"RingHookCallback(trainer, ...) needs the transformers Trainer whose model it hooks (callbacks "
                f"are handed the unwrapped model, not the DDP); got {type(trainer).__name__}"
            )
        check_register_options(**register_options)  # a typo fails here, not when training starts
        self.trainer = trainer
        self.print_summary = print_summary
        self.register_options = register_options
        self.hook_state: HookState | None = None
        self.log_dir: str | None = None
        self._hooked: weakref.ref | None = None  # the DDP model hooked (weak: the Trainer may free it)
        self._timing = False  # between registering and the end of that train()
        self._pause: contextlib.AbstractContextManager | None = None  # paused for an evaluation or a checkpoint

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        ddp = self._trainer_ddp()
        if self._hooked is not None and self._hooked() is ddp:
            if state.is_world_process_zero:
                warnings.warn(
                    "this train() runs the DDP model of the previous one, whose hook state closed when that "
                    "train() ended: ring_hook still averages the gradients, but this train() is not timed "
                    "(DDP takes one hook per model, once). A new Trainer gets a new DDP model and a timed hook",
                    stacklevel=2,
                )
        else:
            given = "log_dir" in self.register_options  # log_dir=None: no files, even with the Trainer's run
            self.log_dir = self.register_options["log_dir"] if given else self._trainer_log_dir(ddp.process_group)
            self.hook_state = register(ddp, **{**self.register_options, "log_dir": self.log_dir})
            self._hooked = weakref.ref(ddp)
            self._timing = True
            if ddp.find_unused_parameters and state.is_world_process_zero:
                warnings.warn(
                    "the Trainer built DDP with find_unused_parameters=True (its default for models without "
                    "gradient checkpointing): every backward runs one more all-reduce and DDP never rebuilds "
                    "its buckets. When every parameter gets a gradient, pass "
                    "TrainingArguments(ddp_find_unused_parameters=False)", stacklevel=2,
                )
        self.hook_state.iteration = state.global_step

    # -- evaluation and checkpoints: planned asymmetric work, the stall watchdog is told -----

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self._pause_for(control)

    def on_epoch_end(self, args, state, control, **kwargs) -> None:
        self._pause_for(control)

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        self._resume()

    def on_epoch_begin(self, args, state, control, **kwargs) -> None:
        self._resume()

    def _pause_for(self, control) -> None:
        """After the Trainer's flow callback decided (it runs first): pause for what comes."""
        reasons = [name for name, due in (("evaluation", control.should_evaluate), ("checkpoint", control.should_save))
                   if due]
        if reasons and self._timing and self._pause is None:
            self._pause = self.hook_state.paused(" and ".join(reasons))
            self._pause.__enter__()

    def _resume(self) -> None:
        pause, self._pause = self._pause, None
        if pause is not None:
            pause.__exit__(None, None, None)

    def on_train_end(self, args, state, control, **kwargs) -> None:
        self._resume()
        if not self._timing:  # a train() after the first on the same DDP model: nothing was timed
            return
        self._timing = False
        self.hook_state.close()  # every rank: its files complete; rank 0 adds the comm/advice panel
        if self.print_summary and state.is_world_process_zero:
            print(f"{self.hook_state.summary()}\n{advice_text(self.hook_state)}")

    def _trainer_ddp(self) -> DistributedDataParallel:
        try:
            return find_ddp(self.trainer.model_wrapped)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"RingHookCallback hooks the DDP model the Trainer trains, but {error}. (The Trainer wraps the "
                "model in DistributedDataParallel when it runs in 2 or more processes without fsdp= or deepspeed=.)"
            ) from error

    def _trainer_log_dir(self, group: dist.ProcessGroup) -> str | None:
        """The directory of the Trainer's TensorBoard run, the same on every rank, or None
        without one. Only rank 0's ``TensorBoardCallback`` opens its writer, so rank 0 tells
        the others (collective over the DDP model's group)."""
        board = next((cb for cb in self.trainer.callback_handler.callbacks if isinstance(cb, TensorBoardCallback)), None)
        if board is None:
            return None
        directory = [board.tb_writer.get_logdir() if board.tb_writer is not None else None]
        dist.broadcast_object_list(directory, group=group, group_src=0)
        if directory[0] is None:
            raise RuntimeError(
                "the Trainer's TensorBoardCallback had not opened its run when RingHookCallback registered the "
                "hook (it must come first among the callbacks, as report_to='tensorboard' puts it); or pass "
                "log_dir= to RingHookCallback"
            )
        return directory[0]
