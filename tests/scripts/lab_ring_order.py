"""One rank of the lab's ring-order test: what a misplaced two-tier lab makes of the ring orders.

Started by ``tests/test_lab.py`` on every host of a two-tier lab whose ranks alternate between
the nodes (``lab.run``: ``GROUP_RANK`` is each host's node). On this rank it builds hook states
with ``ring_order="measured"`` (ring and hierarchical: the probe of the links, one pair at a
time), ``"hosts"`` (the gathered ``GROUP_RANK`` s) and the rank order, all-reduces a small
buffer with each state's settled options, and prints one JSON line: the orders chosen, the nodes the state gathered,
each result's digest (equal on every rank = bit-identical) and distance from the exact sum,
and the summary's ring-order line of the rank-order ring.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, when not installed

import ddp_ring_hooks  # noqa: E402
from ddp_ring_hooks import HookState  # noqa: E402
from tests.conftest import digest, rank_input, within_summation_bound  # noqa: E402

CASES = {
    "hierarchical rank": {"algorithm": "hierarchical"},
    "ring measured": {"algorithm": "ring", "ring_order": "measured"},
    "hierarchical measured": {"algorithm": "hierarchical", "ring_order": "measured"},
    "ring hosts": {"algorithm": "ring", "ring_order": "hosts"},
    "ring rank": {"algorithm": "ring"},
}


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    report: dict[str, object] = {"rank": rank}
    for name, options in CASES.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = HookState(**options)
        report[f"{name} warnings"] = [str(w.message) for w in caught]
        inputs = [rank_input(r, 1009, torch.float32) for r in range(world_size)]
        result = ddp_ring_hooks.all_reduce(inputs[rank].clone(), algorithm=state.algorithm, **state.algorithm_options)
        report[name] = {
            "ring": state.ring, "nodes": state.nodes, "digest": digest(result),
            "excess": within_summation_bound(result, inputs, torch.float32, world_size),
        }
        if name in ("ring rank", "hierarchical rank"):
            report[f"{name} summary line"] = state.summary().splitlines()[-1]
        state.close()
    print(json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
