"""A DDP run with per-link timing on, one process per host of an emulated lab (``lab.run``).

Every step gathers arrivals and times every link (``spread_every=1, links=True``); with
``--delay-rank R`` that rank sleeps ``--delay-ms`` before every forward (a rank late for
compute reasons, not the network). With ``--diagnose`` the one switch instead
(``diagnose=True``: the gather and the links at ``spread_every="auto"``); under ``native`` the
links are then a probe's (``telemetry/native_probe.py``).

The model is one bucket of 4.2 MB, so the ring's transfers at 4 ranks are 1 MiB chunks, four
times the lab shaper's bucket (250 KB at 400 Mbit/s, ``lab/iproute.py``). Smaller ones read
the shaper, not the link: a link that idles for 5 ms (waiting for a late rank's chain, say)
refills the bucket, and its next 256 KB chunk crosses at veth speed, 100-350 MB/s on a
50 MB/s link; two such links out of four put the median high enough to make the healthy
ones look slow. At 1 MiB a full bucket lifts a reading by at most a third.

Each rank writes ``rank{r}.json``: its summary, what the rule and the straggler gather said at
every step, and a checksum of its parameters. Used by ``tests/test_link_timing.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, when not installed

import ddp_ring_hooks  # noqa: E402
from ddp_ring_hooks.telemetry import MemorySink  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for rank{r}.json and the TensorBoard run")
    parser.add_argument("--algorithm", default="ring", help="hook algorithm (default: ring)")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps (default: 12)")
    parser.add_argument("--width", type=int, default=724, help="the MLP's width: 2 x width^2 parameters (default: 724)")
    parser.add_argument("--delay-rank", type=int, default=-1, help="this rank sleeps before every forward")
    parser.add_argument("--delay-ms", type=float, default=60.0, help="for how long (default: 60)")
    parser.add_argument("--diagnose", action="store_true", help="diagnose=True instead of spread_every=1, links=True")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.Tanh(), torch.nn.Linear(args.width, args.width))
    model = DistributedDataParallel(net, bucket_cap_mb=8)  # one bucket (see the docstring)
    memory = MemorySink()
    asked = {"diagnose": True} if args.diagnose else {"spread_every": 1, "links": True}
    state = ddp_ring_hooks.register(model, algorithm=args.algorithm, log_dir=str(args.out / "tb"), sinks=[memory],
                                    **asked)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        if rank == args.delay_rank:
            time.sleep(args.delay_ms / 1e3)
        model(torch.randn(16, args.width, generator=generator)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    state.close()  # after the exchanges of every step
    result = {
        "summary": state.summary(),
        "steps": [{"step": r.step, "slow_nic_rank": r.verdict.slow_nic_rank,
                   "named": sorted(map(list, r.verdict.named_links())), "summary": r.summary,
                   "MBps": {f"{src}→{dst}": round(r.bandwidth_Bps((src, dst)) / 1e6, 1) for src, dst in sorted(r.links)}}
                  for r in memory.links],
        "stragglers": {r.step: r.straggler for r in memory.ranks},
        "checksum": float(sum(p.detach().double().sum() for p in model.parameters())),
    }
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
