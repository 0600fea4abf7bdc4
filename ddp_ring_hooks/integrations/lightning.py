"""Lightning integration: the ring hook on every device, its timing in the Trainer's own run.

Three pieces, all opt-in::

    import ddp_ring_hooks.integrations.lightning as ring_lightning      # registers "ddp_ring"

    trainer = pl.Trainer(
        strategy="ddp_ring",                     # or RingDDPStrategy(algorithm="ring", bucket_cap_mb=2)
        callbacks=[ring_lightning.CommTimingLogger(),
                   ring_lightning.ThroughputLogger(tokens_per_sample=128)],
    )

1. :class:`RingDDPStrategy` is a ``DDPStrategy`` that attaches :func:`~ddp_ring_hooks.ring_hook`
   right after wrapping the model in DDP, on CPU/gloo as on CUDA/NCCL. Lightning's own
   ``DDPStrategy(ddp_comm_hook=...)`` registers a hook only when the device is CUDA and
   silently drops it elsewhere, so a CPU run would quietly use plain DDP. The strategy
   then reads DDP's own record (``_get_ddp_logging_data()["comm_hook"]``) and fails loudly
   if the hook is not there. It pauses the hook's stall watchdog (``HookState.paused``)
   while validation runs and while a checkpoint is written: a rank that is slower at those
   is not reported as busy to the ranks that wait for it.
2. :class:`CommTimingLogger` sends the hook's telemetry (per-bucket and per-step
   communication time, bytes, bus bandwidth) into the Trainer's TensorBoard logger: the same
   run directory as the loss, on the same x axis (the optimizer step).
3. :class:`ThroughputLogger` logs samples/s (and tokens/s) for every optimizer step (measured
   by :mod:`~ddp_ring_hooks.integrations.throughput`, which knows nothing of Lightning).

How the steps line up with gradient accumulation (``accumulate_grad_batches=3``)::

    micro-batch        1        2        3    |    4        5        6    |
    DDP                no_sync  no_sync  sync |    no_sync  no_sync  sync |
    ring_hook                          buckets|                   buckets|
    optimizer step                       1    |                     2    |
    TensorBoard x      0        0        0    |    1        1        1    |

(Lightning logs the batches of optimizer step N at x = N - 1; ``comm/*`` and
``throughput/*`` of step N go there too.)

Lightning runs the non-stepping micro-batches under ``DDP.no_sync()``, so the hook runs
once per optimizer step; the hook's step counter (``HookState.iteration``) is set to the
Trainer's ``global_step`` when training starts, so it also continues after a resume from a
checkpoint.

This is the only module of the package that imports lightning.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from torch.nn.parallel import DistributedDataParallel

from ..hooks import HookState, register, ring_hook
from ..hooks.advice import advice_text
from ..hooks.options import check_register_options, parameter_names, split_options
from ..hooks.register import reported_comm_hook
from ..telemetry import Sink, TensorBoardSink
from ..telemetry.sinks import ADVICE_TAG, advice_panel
from .throughput import StepThroughput, ThroughputMeter, ThroughputSummary, count_leading_dimension

__all__ = [
    "CommTimingLogger", "RingDDPStrategy", "StepThroughput", "ThroughputLogger", "ThroughputSummary",
    "count_leading_dimension",
]

STRATEGY_NAME = "ddp_ring"

#: Where each keyword goes: Lightning's DDPStrategy and DistributedDataParallel take these;
#: every other keyword is one of :func:`ddp_ring_hooks.register`'s (as Fabric's strategy sorts them).
_STRATEGY_KEYWORDS = parameter_names(DDPStrategy.__init__, DistributedDataParallel.__init__)

# Lightning logs what the batches of optimizer step N (1-based) produced at x = N - 1 (its
# step counter before that step). Comm and throughput of step N go to the same x.
LIGHTNING_STEP_OFFSET = -1


class RingDDPStrategy(DDPStrategy):
    """``DDPStrategy`` whose gradients are averaged by :func:`~ddp_ring_hooks.ring_hook`.

    Takes its options the way Fabric's :class:`~ddp_ring_hooks.integrations.fabric.RingDDPFabricStrategy`
    does: every keyword goes where it belongs, by name.

    Args:
        algorithm: the all-reduce algorithm, one of :data:`ddp_ring_hooks.ALGORITHMS`, "native"
            (the group's own all-reduce with this hook's telemetry), or "auto".
        algorithm_options: the algorithm's options, as a mapping; or give them as keywords
            (``RingDDPStrategy(algorithm="tree", segments=4)``), not the same one both ways.
        **options: what :func:`ddp_ring_hooks.register` takes (the algorithm's options,
            ``telemetry=``, the telemetry fields ``log_dir``, ``log_every``, ``trace_steps``,
            ``per_rank``, ``spread_every``, ``sinks``, ..., ``concurrent_buckets``,
            ``check_layout_steps``, ``error_feedback`` (with ``wire_dtype="bf16"``),
            ``observers``; all watching is off by default), and what
            ``DDPStrategy`` and ``DistributedDataParallel`` take (``bucket_cap_mb``,
            ``process_group_backend``, ``timeout``, ``start_method``, ...), except the hook
            arguments: this strategy owns DDP's single hook slot. The hook's are checked here
            (an unknown name, a bad value), not when ``fit`` starts.

    After ``trainer.fit`` starts, :attr:`hook_state` is the :class:`~ddp_ring_hooks.HookState`
    and :attr:`reported_comm_hook` what DDP reports as its hook (``"ring_hook"``).

    Example::

        >>> trainer = pl.Trainer(strategy=RingDDPStrategy(bucket_cap_mb=2), accelerator="cpu", devices=2)
        >>> RingDDPStrategy(algorithm="hierarchical", local_size=2, log_dir="runs/h")
    """

    strategy_name = STRATEGY_NAME

    def __init__(
        self,
        algorithm: str | None = None,  # the ring, unless hook= (a DDP hook of your own) is given
        *,
        algorithm_options: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> None:
        for owned in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper"):
            if options.get(owned) is not None:
                raise ValueError(
                    f"RingDDPStrategy attaches its own hook, so it cannot take {owned}=; drop it, "
                    "or use lightning's DDPStrategy to run a different hook"
                )
        strategy, hook = split_options(options, _STRATEGY_KEYWORDS)
        self.register_options = {"algorithm": algorithm, "algorithm_options": algorithm_options, **hook}
        check_register_options(**self.register_options)  # a typo fails here, not when fit starts
        super().__init__(**strategy)
        self.algorithm = algorithm
        # Sinks added by callbacks (CommTimingLogger) for the current fit only: a second fit
        # brings its own logger, so they are dropped at teardown.
        self._fit_sinks: list[Sink] = []
        self.hook_state: HookState | None = None
        # True from configure_ddp to teardown: the hook of the current fit exists. (After a
        # fit, hook_state stays readable but closed; the next fit builds a new one.)
        self._fitting = False
        # What DDP itself reported right after the hook was attached (the model is unwrapped
        # again at teardown, so this keeps the proof).
        self.reported_comm_hook: str | None = None
        # The hook's pauses for validation (its start and end are two strategy hooks).
        self._pauses = contextlib.ExitStack()

    def add_sink(self, sink: Sink) -> None:
        """Send the hook's telemetry records to ``sink`` too, for this fit (before or after the hook exists)."""
        if self._fitting:
            self.hook_state.telemetry.add_sink(sink)
        else:  # Lightning sets callbacks up before the strategy: the hook comes later
            self._fit_sinks.append(sink)

    def configure_ddp(self) -> None:
        """Wrap the model in DDP (Lightning's code), then attach the ring hook and check it."""
        super().configure_ddp()  # registers nothing: this strategy never passes ddp_comm_hook
        if self.hook_state is not None:  # a second fit with the same strategy object
            self.hook_state.close()
        self.hook_state = register(self.model, **self.register_options)
        for sink in self._fit_sinks:
            self.hook_state.telemetry.add_sink(sink)
        self._fitting = True
        self.reported_comm_hook = reported_comm_hook(self.model)
        if self.reported_comm_hook != ring_hook.__qualname__:
            raise RuntimeError(
                f"DDP reports the communication hook {self.reported_comm_hook!r} instead of "
                f"{ring_hook.__qualname__!r}; "
                "the model was wrapped without the ring hook (was configure_ddp overridden?)"
            )

    def on_train_start(self) -> None:
        super().on_train_start()
        # The telemetry's x axis is the hook's step counter. Lining it up with global_step
        # here (after a checkpoint has been restored) makes it continue across resumes.
        assert self.hook_state is not None
        self.hook_state.iteration = self.lightning_module.trainer.global_step

    # -- planned asymmetric work: the stall watchdog is told, so a slower rank is not "busy" --

    def _paused(self, reason: str):
        """``hook_state.paused(reason)`` during a fit, else nothing."""
        return self.hook_state.paused(reason) if self._fitting else contextlib.nullcontext()

    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._pauses.enter_context(self._paused("validation"))

    def on_validation_end(self) -> None:
        self._pauses.close()
        super().on_validation_end()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        with self._paused("checkpoint"):
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def teardown(self) -> None:
        self._pauses.close()
        if self.hook_state is not None:
            self.hook_state.close()  # finish queued buckets and flush telemetry
        self._fit_sinks.clear()
        self._fitting = False
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``strategy="ddp_ring"`` with Lightning (done when this module is imported)."""
        if STRATEGY_NAME not in strategy_registry:
            strategy_registry.register(
                STRATEGY_NAME,
                cls,
                description="DDP with the ddp_ring_hooks ring all-reduce hook, on CPU (gloo) and GPU (NCCL)",
            )


RingDDPStrategy.register_strategies(StrategyRegistry)


def _ring_strategy(trainer: pl.Trainer) -> RingDDPStrategy:
    strategy = trainer.strategy
    if not isinstance(strategy, RingDDPStrategy):
        raise TypeError(
            f"this callback reads the ring hook's telemetry, but the Trainer uses {type(strategy).__name__}; "
            f'pass strategy="{STRATEGY_NAME}" (or RingDDPStrategy(...)) to the Trainer'
        )
    return strategy


class CommTimingLogger(pl.Callback):
    """Write the ring hook's communication timing into the Trainer's TensorBoard run.

    The records go through a telemetry ``TensorBoardSink`` that writes into
    ``trainer.logger.experiment`` (Lightning's own ``SummaryWriter``, on global rank 0), so
    ``comm/*`` sits next to ``train/loss``, with the optimizer step as x axis. The sink is
    fed off the training thread. Needs :class:`RingDDPStrategy` and a ``TensorBoardLogger``.

    At the end of training it writes the advisor's advice (what to change: bucket size,
    accumulation, algorithm; see :mod:`ddp_ring_hooks.advisor`) as the text panel
    ``comm/advice``, and at the end of ``fit`` prints it on global rank 0, unless
    ``print_advice=False``.
    """

    def __init__(self, *, print_advice: bool = True) -> None:
        self.print_advice = print_advice
        self._advice: str | None = None  # this fit's, on rank 0 (see on_train_end)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = _ring_strategy(trainer)
        # Only fitting reduces gradients; Lightning's logger writes on rank 0 only.
        if stage != "fit" or trainer.global_rank != 0:
            return
        logger = next((lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), None)
        if logger is None:
            raise ValueError(
                "CommTimingLogger writes into the Trainer's TensorBoard run, but the Trainer has no "
                "TensorBoardLogger; pass logger=TensorBoardLogger(...) (needs `pip install tensorboard`)"
            )
        strategy.add_sink(TensorBoardSink(writer=logger.experiment, step_offset=LIGHTNING_STEP_OFFSET))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = _ring_strategy(trainer).hook_state
        if state is not None:
            state.telemetry.flush()
        # The advice, worked out once per fit on rank 0: the comm/advice panel now, printed at fit end.
        self._advice = advice_text(state) if state is not None and trainer.global_rank == 0 else None
        logger = next((lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), None)
        if self._advice is not None and logger is not None:
            logger.experiment.add_text(ADVICE_TAG, advice_panel(self._advice), global_step=trainer.global_step)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.print_advice and self._advice is not None:
            print(self._advice)


class ThroughputLogger(pl.Callback):
    """Log samples/s (and tokens/s) of every optimizer step into the Trainer's loggers; keep this
    fit's steps in :attr:`history` (the measuring itself: :class:`~.throughput.ThroughputMeter`).

    Not Lightning's ``ThroughputMonitor``: it synchronizes CUDA after every micro-batch (hiding
    the overlap being measured), logs only once a 100-batch window is full, and keeps no steps.
    Samples are counted on this rank and multiplied by the world size (every rank gets equal
    micro-batches under Lightning's DistributedSampler).

    Args:
        tokens_per_sample: also log tokens/s (e.g. the sequence length of a language model).
        batch_size_fn: how many samples a batch holds (default: its leading dimension), as in
            Lightning's ``ThroughputMonitor``.
    """

    def __init__(
        self,
        *,
        tokens_per_sample: int | None = None,
        batch_size_fn: Callable[[Any], int] = count_leading_dimension,
    ) -> None:
        self.tokens_per_sample = tokens_per_sample
        self.meter = ThroughputMeter(batch_size_fn=batch_size_fn)

    @property
    def history(self) -> list[StepThroughput]:
        """This fit's steps, measured."""
        return self.meter.history

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.meter.start(step=trainer.global_step, device=pl_module.device)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        for record in self.meter.micro_batch(batch, step=trainer.global_step, world_size=trainer.world_size):
            self._log(trainer, record)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for record in self.meter.finish():  # the last steps' CUDA events: one synchronize per fit
            self._log(trainer, record)

    def _log(self, trainer: pl.Trainer, record: StepThroughput) -> None:
        metrics = record.metrics(tokens_per_sample=self.tokens_per_sample)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=record.step + LIGHTNING_STEP_OFFSET)

    def summarize(self, *, skip_steps: int = 0) -> ThroughputSummary:
        """The steps after the first ``skip_steps`` of this fit (warm-up: DDP's first step differs)."""
        return self.meter.summarize(skip_steps=skip_steps)
