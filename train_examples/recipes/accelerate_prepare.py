"""Accelerate with the ring hook: torchrun --standalone --nproc_per_node=2 train_examples/recipes/accelerate_prepare.py"""

import torch
from accelerate import Accelerator

import ddp_ring_hooks

accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)  # cpu=True: DDP on CPU (gloo); GPUs: leave it out
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(256, 32)), batch_size=16)
model, optimizer, data = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), data)
state = ddp_ring_hooks.register(model, algorithm="ring", log_dir="runs/accelerate")  # the hook, on the DDP inside
accelerator.register_for_checkpointing(state)  # save_state / load_state keep its step counter
for (x,) in data:
    with accelerator.accumulate(model):
        accelerator.backward(model(x).square().mean())
        optimizer.step()
        optimizer.zero_grad()
accelerator.save_state("runs/accelerate/checkpoint")
accelerator.print(state.summary())
state.close()
