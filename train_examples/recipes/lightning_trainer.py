"""Lightning's Trainer with the ring hook: torchrun --standalone --nproc_per_node=2 train_examples/recipes/lightning_trainer.py"""

import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import TensorBoardLogger

import ddp_ring_hooks.integrations.lightning as ring_lightning  # registers strategy="ddp_ring"

trainer = pl.Trainer(strategy="ddp_ring", accelerator="cpu", devices=2, max_steps=6, accumulate_grad_batches=2,
                     logger=TensorBoardLogger("runs/lightning_trainer"), callbacks=[ring_lightning.CommTimingLogger()],
                     log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(BoringModel())
