"""The store of one ``lab torchrun`` job's c10d rendezvous, in a process of its own on host 0::

    python rendezvous_store.py 10.100.0.1 29500     # prints "ready", serves until killed

torchrun's agents could host it themselves (``is_host=1`` on host 0), but then the store goes
away with host 0's agent, and every other agent, still closing the rendezvous, prints a long
"Connection was likely closed" traceback at the end of a job that succeeded. Here the store
outlives every agent, and the lab stops it once they are all done. (A script: it imports torch
in its own process; the lab itself never does.)
"""

from __future__ import annotations

import signal
import sys
from datetime import timedelta

import torch.distributed as dist


def main(address: str, port: int) -> None:
    store = dist.TCPStore(address, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    print(f"ready: serving on {store.host}:{store.port}", flush=True)
    signal.pause()  # until the lab kills this process; the store serves from its own threads


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
