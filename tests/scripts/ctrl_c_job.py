"""A torchrun job for tests/test_interrupts.py: Ctrl-C while one rank waits in C++.

Every rank installs the guard (grace: the first argument, seconds) and joins the group; then
rank 0 waits in Python (short sleeps) and every other rank in C++, a ``get`` on the job's store
(torchrun's, alive until torchrun ends) of a key nobody sets. Each prints ``rank R waiting``
once it waits, and ``rank R took Ctrl-C`` if its main thread takes the signal.
"""

import signal
import sys
import time

import torch.distributed as dist

from ddp_ring_hooks.interrupts import exit_promptly_on_ctrl_c

# Ctrl-C raising KeyboardInterrupt, as in a job started from a terminal (a shell's background
# job, as CI's pytest may be, starts every process with SIGINT ignored).
signal.signal(signal.SIGINT, signal.default_int_handler)
exit_promptly_on_ctrl_c(float(sys.argv[1]))
dist.init_process_group("gloo")
rank = dist.get_rank()
store = dist.distributed_c10d._get_default_store()
print(f"rank {rank} waiting", flush=True)
try:
    if rank == 0:
        while True:
            time.sleep(0.05)
    else:
        store.get("a key nobody sets")  # the group's timeout: 30 minutes
except KeyboardInterrupt:
    print(f"rank {rank} took Ctrl-C", flush=True)
    sys.exit(130)
