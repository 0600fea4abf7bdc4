"""Plain PyTorch DDP with the ring hook: torchrun --standalone --nproc_per_node=2 train_examples/recipes/plain_ddp.py"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import ddp_ring_hooks

dist.init_process_group("gloo")
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
state = ddp_ring_hooks.register(model, algorithm="ring", log_dir="runs/plain_ddp")  # the hook
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(6):
    loss = model(torch.randn(16, 32)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
if dist.get_rank() == 0:
    print(state.summary())
state.close()
dist.destroy_process_group()
