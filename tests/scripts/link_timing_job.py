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

``--plan`` runs several such trainings in one launch, one after the other on the same process
group (the ranks start, import torch and join once: most of a short run's seconds on 2 cores).
Each is a fresh model and a fresh hook (its own warm-up, cadence and verdicts) and writes
``NAME/rank{r}.json`` and ``NAME/tb`` under ``--out``; a barrier between them, so that one
run's late rank is not late for the next. The advisor's network probe is off
(``network_probe=False``): these checks read the links' timing, not the advisor's α and β.
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
    parser.add_argument("--plan", type=json.loads, default=None,
                        help='several runs, one after the other: a JSON list of {"name": ..., and any of "steps", '
                             '"algorithm", "diagnose", "delay_rank", "delay_ms", "tensorboard" (default true)}; '
                             "a key left out takes its flag's value")
    return parser.parse_args()


#: What a run of --plan may set, each defaulting to the flag of the same name.
RUN_KEYS = {"name", "steps", "algorithm", "diagnose", "delay_rank", "delay_ms", "tensorboard"}


def planned_runs(args: argparse.Namespace) -> list[tuple[Path, dict]]:
    """(output directory, settings) of each run: ``--out`` itself without ``--plan``."""
    flags = {"steps": args.steps, "algorithm": args.algorithm, "diagnose": args.diagnose,
             "delay_rank": args.delay_rank, "delay_ms": args.delay_ms, "tensorboard": True}
    if args.plan is None:
        return [(args.out, flags)]
    runs = []
    for run in args.plan:
        unknown = set(run) - RUN_KEYS
        if unknown or "name" not in run:
            raise SystemExit(f"--plan: each run needs a name and takes only {sorted(RUN_KEYS)}; got {sorted(run)}")
        runs.append((args.out / run["name"], {**flags, **{k: v for k, v in run.items() if k != "name"}}))
    if len({out for out, _ in runs}) < len(runs):
        raise SystemExit("--plan: two runs with the same name would write the same files")
    return runs


def main() -> None:
    args = parse_args()
    runs = planned_runs(args)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for out, settings in runs:
        dist.barrier()  # every rank starts each run together
        train(out, width=args.width, **settings)
    dist.destroy_process_group()


def train(out: Path, *, width: int, steps: int, algorithm: str, diagnose: bool, delay_rank: int, delay_ms: float,
          tensorboard: bool) -> None:
    """One run: a fresh model and hook, ``steps`` optimizer steps, ``out/rank{r}.json``."""
    rank = dist.get_rank()
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, width))
    model = DistributedDataParallel(net, bucket_cap_mb=8)  # one bucket (see the docstring)
    memory = MemorySink()
    asked = {"diagnose": True} if diagnose else {"spread_every": 1, "links": True}
    logged = {"log_dir": str(out / "tb")} if tensorboard else {}
    state = ddp_ring_hooks.register(model, algorithm=algorithm, sinks=[memory], network_probe=False, **logged, **asked)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        if rank == delay_rank:
            time.sleep(delay_ms / 1e3)
        model(torch.randn(16, width, generator=generator)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    state.close()  # after the exchanges of every step
    result = {
        "summary": state.summary(),
        "trained_steps": steps,
        "steps": [{"step": r.step, "slow_nic_rank": r.verdict.slow_nic_rank,
                   "named": sorted(map(list, r.verdict.named_links())), "summary": r.summary,
                   "MBps": {f"{src}→{dst}": round(r.bandwidth_Bps((src, dst)) / 1e6, 1) for src, dst in sorted(r.links)}}
                  for r in memory.links],
        "stragglers": {r.step: r.straggler for r in memory.ranks},
        "checksum": float(sum(p.detach().double().sum() for p in model.parameters())),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
