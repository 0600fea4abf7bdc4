"""One rank of the lab's correctness test: every algorithm of the registry, on this host.

Started by ``tests/test_lab.py`` on every host of an emulated lab (``lab.run``), with torchrun's
variables set by the lab, so the process group forms over the lab's links (gloo on
``GLOO_SOCKET_IFNAME``, rendezvous on host 0's address). For every ``(algorithm, options)``
that the registry gives as an example for this world size, plus ``native``, and a few element
counts, it all-reduces this rank's seeded input and prints one JSON line: per case, the SHA-256
of the result (equal on every rank = bit-identical) and its distance from the exact sum as a
fraction of the summation bound (<= 1 passes). Arguments, if any, are the algorithms to run
(default: every one).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, when not installed

import ddp_ring_hooks  # noqa: E402
from tests.conftest import algorithm_cases, digest, rank_input, within_summation_bound  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cases = {}
    chosen = set(sys.argv[1:])
    for algorithm, options in [*algorithm_cases(world_size), ("native", {})]:
        if chosen and algorithm not in chosen:
            continue
        for numel in (0, 1, world_size + 1, 1009):
            inputs = [rank_input(r, numel, torch.float32) for r in range(world_size)]
            result = ddp_ring_hooks.all_reduce(inputs[rank].clone(), algorithm=algorithm, **options)
            key = f"{algorithm} {json.dumps(options, sort_keys=True)} {numel}"
            cases[key] = {"digest": digest(result),
                          "excess": within_summation_bound(result, inputs, torch.float32, world_size)}
    print(json.dumps({"rank": rank, "world_size": world_size, "cases": cases}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
