"""Lightning Fabric with the ring hook: torchrun --standalone --nproc_per_node=2 train_examples/recipes/fabric_strategy.py"""

import torch
from lightning.fabric import Fabric

from ddp_ring_hooks.integrations.fabric import RingDDPFabricStrategy  # also registers strategy="ddp_ring"

fabric = Fabric(strategy=RingDDPFabricStrategy(log_dir="runs/fabric"), accelerator="cpu", devices=2)
fabric.launch()
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
for step in range(6):
    loss = model(torch.randn(16, 32)).square().mean()
    optimizer.zero_grad()
    fabric.backward(loss)
    optimizer.step()
fabric.print(f"loss {loss.item():.4f}, gradients averaged by {fabric.strategy.hook_state.algorithm}")
fabric.strategy.hook_state.close()  # Fabric never tears its strategy down: complete the TensorBoard files now
