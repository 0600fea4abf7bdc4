# torchrun --standalone --nproc_per_node=2 train_examples/minimal.py
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import ddp_ring_hooks

dist.init_process_group("gloo")  # torchrun tells every process its rank and the world size
torch.manual_seed(0)  # the same initial weights on every rank
net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                          torch.nn.Linear(1024, 1))
model = DistributedDataParallel(net, bucket_cap_mb=1)  # 1 MB buckets: more than one per step
state = ddp_ring_hooks.register(model, algorithm="ring", log_dir="runs/ring")  # the one call
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

torch.manual_seed(1 + dist.get_rank())  # each rank its own data
for step in range(30):
    x = torch.randn(32, 256)
    loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()  # DDP hands each gradient bucket to the ring hook
    optimizer.step()

if dist.get_rank() == 0:
    print(state.summary())  # per bucket: count, p50/p90/max ms, bus bandwidth
state.close()  # flush TensorBoard and the timeline `ddp-ring-hooks advise runs/ring` reads
dist.destroy_process_group()
