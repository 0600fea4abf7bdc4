"""A training script whose rank 1 fails in a bucket because rank 0 has gone, and ends at once on
the error, as a script without a ``try`` does. Run by ``tests/test_exit.py``.

The hook is the user's own (``register(model, hook=...)``, timed by the package): gloo's
all-reduce, whose Future's callback hands the result over to the Future the hook returned and
then goes on working for ``--tail`` seconds, as PowerSGD's callbacks do. Rank 0 leaves
(``os._exit``) a second into step 2, while rank 1 waits in that step's all-reduce, so the
failure runs the whole chain on gloo's own thread: the hand-over runs the package's callbacks
and DDP's, which wake the main thread with the error, and then the tail goes on, as the
package's own chain does for microseconds (``runtime/daemons.py``). The main thread,
meanwhile, prints the traceback and exits. If the interpreter finalizes before the tail is
over, gloo's thread is ended inside C++ and the process aborts (SIGABRT, "terminate called
..."), in place of the script's error.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, when not installed
import ddp_ring_hooks  # noqa: E402

LEAVES_AT = 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tail", type=float, required=True, help="seconds the last callback goes on after DDP's wake-up")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)))

    def relayed_all_reduce(process_group, bucket):
        relay = torch.futures.Future()

        def hand_over_then_go_on(done):
            try:
                relay.set_result(done.value()[0] / dist.get_world_size())
            except RuntimeError as error:
                relay.set_exception(error)  # the package's callbacks, then DDP's: the main thread raises it
                time.sleep(args.tail)

        dist.all_reduce(bucket.buffer(), group=process_group, async_op=True).get_future().add_done_callback(hand_over_then_go_on)
        return relay

    ddp_ring_hooks.register(model, hook=relayed_all_reduce, hook_state=None)
    for step in range(LEAVES_AT + 1):
        if step == LEAVES_AT and dist.get_rank() == 0:
            time.sleep(1.0)  # rank 1 is inside the step's all-reduce by now
            os._exit(0)
        model(torch.randn(8, 16)).sum().backward()


if __name__ == "__main__":
    main()
