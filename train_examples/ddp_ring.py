"""Plain PyTorch DDP with the ring all-reduce hook, in one file, readable top to bottom.

Launch (CPU/gloo by default, NCCL when every rank has a GPU)::

    torchrun --standalone --nproc_per_node=2 train_examples/ddp_ring.py
    torchrun --standalone --nproc_per_node=4 train_examples/ddp_ring.py --algorithm ring --steps 50
    torchrun --standalone --nproc_per_node=4 train_examples/ddp_ring.py --spread-every 1 --links
    torchrun --standalone --nproc_per_node=4 train_examples/ddp_ring.py --diagnose

Each rank trains a small MLP on its own synthetic regression data; DDP averages gradients
through ``ddp_ring_hooks.ring_hook``. Rank 0 prints the backend, the attached hook (as DDP
itself reports it) and the loss, and at the end checks that every rank holds the same weights.
The hook's TensorBoard events and timeline go to ``--log-dir`` (``tensorboard --logdir
runs/ddp_ring``, ``ddp-ring-hooks advise runs/ddp_ring``). With ``--spread-every N`` every
N-th step also says which rank arrived last, and with ``--links`` which link is slow;
``--diagnose`` asks for both (and the stall watchdog) at a cadence that keeps their cost within
1% of a step (``diagnose=True``). Rank 0 prints the hook's summary at the end.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import ddp_ring_hooks
from ddp_ring_hooks import accepted_algorithms
from ddp_ring_hooks.machine import oversubscription_warning


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithm", default="ring", choices=accepted_algorithms(),
                        help="all-reduce algorithm run by the hook (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per rank per step (default: %(default)s)")
    parser.add_argument("--width", type=int, default=512, help="hidden layer width (default: %(default)s)")
    parser.add_argument("--bucket-cap-mb", type=float, default=1.0,
                        help="DDP bucket size in MiB; smaller gives more buckets (default: %(default)s)")
    parser.add_argument("--log-dir", default="runs/ddp_ring",
                        help="the hook's TensorBoard events and timeline (default: %(default)s)")
    parser.add_argument("--spread-every", type=int, default=0,
                        help="every N-th step, gather every rank's arrival: who is late (default: 0, never)")
    parser.add_argument("--links", action="store_true",
                        help="on those steps also time every link and name a slow one (needs --spread-every)")
    parser.add_argument("--diagnose", action="store_true",
                        help="diagnose=True: the straggler, the slow link and a stall, at a cadence costing <= 1%% of a step")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                        help="process-group backend; auto = nccl when this node has a GPU for every "
                             "process (NCCL refuses two ranks on one GPU), else gloo")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    gpus, processes = torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    backend = args.backend if args.backend != "auto" else ("nccl" if gpus >= processes else "gloo")
    if args.backend == "auto" and 0 < gpus < processes and local_rank == 0:
        print(f"note: {processes} processes on this node but {gpus} GPU(s), and NCCL needs one GPU per "
              f"process: running on CPU (gloo). Launch with --nproc_per_node={gpus} for the GPUs.", flush=True)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # ranks share the machine's cores
        crowded = oversubscription_warning(processes)
        if crowded and local_rank == 0:
            print(crowded, flush=True)
    dist.init_process_group(backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(
        torch.nn.Linear(64, args.width), torch.nn.GELU(),
        torch.nn.Linear(args.width, args.width), torch.nn.GELU(),
        torch.nn.Linear(args.width, 1),
    ).to(device)
    ddp_model = DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
    state = ddp_ring_hooks.register(ddp_model, algorithm=args.algorithm, log_dir=args.log_dir,
                                    spread_every=args.spread_every, links=args.links, diagnose=args.diagnose)
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=1e-3)

    generator = torch.Generator(device=device).manual_seed(1234 + rank)  # each rank its own data
    target_weights = torch.linspace(-1, 1, 64, device=device) / 4  # keeps sin() in its smooth range
    if rank == 0:
        print(f"backend={dist.get_backend()} world_size={world_size} device={device} algorithm={args.algorithm}")
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x = torch.randn(args.batch_size, 64, device=device, generator=generator)
        y = torch.sin(x @ target_weights).unsqueeze(1)
        loss = torch.nn.functional.mse_loss(ddp_model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if rank == 0 and (step == 1 or step % 10 == 0 or step == args.steps):
            print(f"step {step:4d}  loss {loss.item():.4f}")
    elapsed = time.perf_counter() - start

    logging_data = ddp_model._get_ddp_logging_data()  # what DDP itself records about the model
    attached, buckets = logging_data.get("comm_hook"), logging_data.get("rebuilt_bucket_sizes")
    checksum = torch.stack([p.detach().double().sum() for p in ddp_model.parameters()]).sum().reshape(1)
    everyone = [torch.zeros_like(checksum) for _ in range(world_size)]
    dist.all_gather(everyone, checksum)
    if rank == 0:
        print(f"comm_hook={attached} (DDP reports the hook it calls) buckets(bytes)={buckets}")
        print(f"hook calls: {state.iteration} optimizer steps; {args.steps / elapsed:.1f} steps/s")
        identical = all(torch.equal(everyone[0], other) for other in everyone)
        print(f"parameters identical on all {world_size} ranks: {identical}")
    state.close()  # after the last step's exchanges across ranks
    if rank == 0:
        print(state.summary())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
