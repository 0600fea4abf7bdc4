"""A training script that fails after a few steps without ``HookState.close``, under torchrun.

Run by ``tests/test_exit.py``. Before anything of the package is imported it registers an
``atexit`` handler, so that handler runs after every one the package registers (``atexit``
runs them last-in first-out): the last thing this process does before the interpreter
finalizes. It writes the package's threads still alive then to ``--out/threads_rank{R}.json``.
Every one of them must be gone (``runtime/daemons.py``): a daemon thread that comes back from a
C++ call while the interpreter finalizes aborts the process.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
from pathlib import Path


def _write_live_threads() -> None:
    alive = sorted(thread.name for thread in threading.enumerate()
                   if thread.name.startswith("ddp-ring-hooks") and thread.is_alive())
    (OUT / f"threads_rank{os.environ['RANK']}.json").write_text(json.dumps(alive))


OUT = Path(next(arg.split("=", 1)[1] for arg in sys.argv[1:] if arg.startswith("--out=")))
atexit.register(_write_live_threads)  # first: it runs last

import torch  # noqa: E402 - after the handler, on purpose (see the module docstring)
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, when not installed
import ddp_ring_hooks  # noqa: E402

STEPS = 3


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)))
    # The ring (communication workers), the watchdog (on by default: its thread and its store
    # exchange) and a log_dir (the telemetry writer): every kind of thread the package starts.
    ddp_ring_hooks.register(model, algorithm="ring", log_dir=str(OUT / "runs"))
    for step in range(STEPS):
        model(torch.randn(8, 16)).sum().backward()
    raise RuntimeError(f"the script fails after {STEPS} steps, without closing the hook state")


if __name__ == "__main__":
    main()
