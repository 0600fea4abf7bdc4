"""One rank of the lab's partition test: train with the hook until a bucket fails, then say what was heard.

Started by ``tests/test_stall.py`` on every host of an emulated lab (``lab.start``, torchrun's
variables set by the lab: gloo over the lab's links, the store on host 0). It trains a small
DDP model with the stall watchdog (``--stall-after``, ``--stall-timeout``), writes the step it
reached to ``--out/progress_rank{r}`` after every step (the test pulls a host's cable once every
rank has taken a few), and when ``backward()`` fails prints one JSON line: the error,
when it came, and every line the watchdog logged (with the time it was heard).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, when not installed

import ddp_ring_hooks  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory shared by the hosts")
    parser.add_argument("--stall-after", type=float, required=True, help="the hook's stall_after (seconds)")
    parser.add_argument("--stall-timeout", type=float, required=True, help="the hook's stall_timeout (seconds)")
    parser.add_argument("--steps", type=int, default=2000, help="at most this many steps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    heard: list[tuple[float, str]] = []

    class Heard(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            heard.append((time.time(), record.getMessage()))

    logging.getLogger("ddp_ring_hooks").addHandler(Heard())
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)))
    ddp_ring_hooks.register(model, stall_after=args.stall_after, stall_timeout=args.stall_timeout)
    outcome = {"rank": rank, "error": None}
    for step in range(args.steps):
        try:
            model(torch.randn(16, 64)).square().mean().backward()
        except RuntimeError as error:
            outcome.update(error=str(error), failed_at=time.time(), step=step)
            break
        (args.out / f"progress_rank{rank}").write_text(str(step))
        time.sleep(0.05)
    outcome["heard"] = heard
    print(json.dumps(outcome), flush=True)


if __name__ == "__main__":
    main()
