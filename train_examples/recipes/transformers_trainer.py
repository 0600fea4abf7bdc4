"""transformers' Trainer with the ring hook: torchrun --standalone --nproc_per_node=2 train_examples/recipes/transformers_trainer.py"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from ddp_ring_hooks.integrations.transformers import RingHookCallback

model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=32, vocab_size=256,
                                   bos_token_id=255, eos_token_id=255))  # GPT-2's own ids (50256) lie outside 256
tokens = torch.randint(0, 256, (64, 32), generator=torch.Generator().manual_seed(0))
args = TrainingArguments("runs/transformers_trainer", max_steps=6, per_device_train_batch_size=4,
                         gradient_accumulation_steps=2, use_cpu=True, ddp_backend="gloo",
                         ddp_find_unused_parameters=False,  # every parameter gets a gradient: no extra all-reduce
                         report_to="tensorboard", logging_steps=1, save_strategy="no")
trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": t, "labels": t} for t in tokens])
trainer.add_callback(RingHookCallback(trainer, algorithm="ring"))  # the hook, timed in the Trainer's run
trainer.train()
