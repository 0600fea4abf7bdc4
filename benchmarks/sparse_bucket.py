"""A sparse gradient bucket's time: ours (the group's sparse all-reduce) against PyTorch's
``allreduce_hook``, and densified (``sparse="dense"``), on one ``nn.Embedding(sparse=True)``.

Every arm's bucket is timed by the same clock: PyTorch's ``allreduce_hook`` runs inside our hook
(``hook=allreduce_hook``: called unchanged, timed from its call to its Future's end), ours with
``algorithm="ring"`` (a sparse bucket is gathered whatever the algorithm), ``dense`` with
``sparse="dense"`` (the whole table through the ring). Blocks of steps alternate between the
arms, in an order rotated each round, so drifting load hits them alike; each round gives each
arm the median time of its sparse bucket, and the script prints the median over the rounds of
``ours / allreduce_hook`` (target: <= 1.05) and of ``dense / allreduce_hook`` with the spread::

    python benchmarks/sparse_bucket.py --rounds 20 --rows 100000 --nproc 2
    python benchmarks/sparse_bucket.py --rounds 20 --rows 1000 --tokens 4096 --nproc 2

``--rows`` (the table) against ``--tokens`` (rows each rank touches per step) sets which way
wins: the gather moves ``O(p * nnz)`` bytes, the densified ring ``2(p-1)/p * n``. The last lines
put the advisor's verdict (``advise``'s "sparse: gather vs densify", read from the ``ours`` and
the ``dense`` arm's timelines, which record the network probe it prices on) beside the measured
one (``dense / ours``, the median of the rounds' ratios); ``--timelines DIR`` keeps those two
timelines for ``ddp-ring-hooks advise DIR/ours.jsonl``.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

import ddp_ring_hooks
from ddp_ring_hooks.advisor.advice import step_model
from ddp_ring_hooks.advisor.sparse_verdict import sparse_verdicts
from ddp_ring_hooks.launch import run_on_ranks, under_torchrun

ARMS = {"allreduce_hook": {"hook": allreduce_hook}, "ours": {"algorithm": "ring", "network_probe": True},
        "dense": {"algorithm": "ring", "sparse": "dense", "network_probe": True}}
TARGET = 1.05


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="local gloo ranks to spawn when not under torchrun (default: 2)")
    parser.add_argument("--rounds", type=int, default=20, help="rounds of one block per arm (default: 20)")
    parser.add_argument("--steps", type=int, default=4, help="steps per block (default: 4)")
    parser.add_argument("--rows", type=int, default=100_000, help="rows of the embedding table (default: 100000)")
    parser.add_argument("--dim", type=int, default=64, help="floats per row (default: 64)")
    parser.add_argument("--tokens", type=int, default=512, help="rows looked up per rank per step (default: 512)")
    parser.add_argument("--timelines", metavar="DIR", help="write the ours and dense arms' timelines there "
                        "(DIR/ours.jsonl, DIR/dense.jsonl: `ddp-ring-hooks advise DIR/ours.jsonl` reads one)")
    return parser.parse_args(argv)


def measure(args: argparse.Namespace) -> dict:
    """Run on every rank: each arm's sparse-bucket time per round (ms, the median of its block)."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    arms = {}
    for name, options in ARMS.items():
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Embedding(args.rows, args.dim, sparse=True))
        arms[name] = (model, ddp_ring_hooks.register(model, **options))
    generator = torch.Generator().manual_seed(rank)
    times = {name: [] for name in ARMS}

    def block(name: str, steps: int) -> float:
        model, state = arms[name]
        seen = len(_bucket_ms(state))
        for _ in range(steps):
            tokens = torch.randint(0, args.rows, (args.tokens,), generator=generator)
            model(tokens).sum().backward()
            model.module.weight.grad = None
        return statistics.median(_bucket_ms(state)[seen:])

    for name in ARMS:
        block(name, 2)  # warm up: DDP's first iteration, the layout check
    names = list(ARMS)
    for round_index in range(args.rounds):
        for name in names[round_index % len(names):] + names[:round_index % len(names)]:
            dist.barrier()
            times[name].append(block(name, args.steps))
    records = {name: arms[name][1].timeline.records() for name in ("ours", "dense")}
    for _, state in arms.values():
        state.close()
    return {"world_size": dist.get_world_size(), "times": times, "records": records}


def _bucket_ms(state) -> list[float]:
    """The sparse bucket's communication time (ms) of every step the timeline holds."""
    return [bucket.comm_ms for record in state.timeline.records() for bucket in getattr(record, "buckets", ())]


def report(result: dict, args: argparse.Namespace) -> None:
    times = result["times"]
    print(f"world size {result['world_size']}, table {args.rows} x {args.dim} fp32, {args.tokens} rows looked up per "
          f"rank per step, {args.rounds} rounds x {args.steps} steps per arm (rank 0's sparse bucket)")
    for name in ARMS:
        print(f"  {name:>15}: median {statistics.median(times[name]):.3f} ms")
    for name in ("ours", "dense"):
        ratios = [a / b for a, b in zip(times[name], times["allreduce_hook"])]
        print(f"  {name}/allreduce_hook: median {statistics.median(ratios):.3f} "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f})"
              + (f" ({'meets' if statistics.median(ratios) <= TARGET else 'misses'} the <= {TARGET} target)"
                 if name == "ours" else ""))
    measured = statistics.median(a / b for a, b in zip(times["dense"], times["ours"]))
    print(f"  measured: dense/ours {measured:.2f}: {'gather' if measured >= 1 else 'densify'} wins")
    for name, way in (("ours", "gathered"), ("dense", "densified")):
        [verdict] = sparse_verdicts(step_model(result["records"][name]))
        print(f"  predicted from the {way} run: densify/gather {verdict['densify_over_gather']:.2f} "
              f"(gather {verdict['gather_ms']:.2f} ms, densify {verdict['densify_ms']:.2f} ms, on {verdict['priced_on']}): "
              f"{verdict['verdict']} wins{'' if verdict['verdict'] == ('gather' if measured >= 1 else 'densify') else ' (NOT the measured way)'}")


def write_timelines(result: dict, directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    for name, records in result["records"].items():
        with open(os.path.join(directory, f"{name}.jsonl"), "w", encoding="utf-8") as file:
            file.writelines(record.to_json() + "\n" for record in records)


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run_on_ranks(measure, args, nproc=args.nproc, backend="gloo")
    if not under_torchrun() or int(os.environ["RANK"]) == 0:  # rank 0 prints the report
        report(result, args)
        if args.timelines:
            write_timelines(result, args.timelines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
