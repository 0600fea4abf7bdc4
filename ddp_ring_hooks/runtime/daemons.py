"""The package's daemon threads, stopped at exit before the interpreter finalizes.

The hook runs its work on daemon threads: the communication workers (gloo's waits), the stall
watchdog and its store exchange (``TCPStore`` calls), the telemetry writer. A training script
that ends without :meth:`~ddp_ring_hooks.hooks.state.HookState.close` (by an exception: a
peer's abort, a ``RankStalledError``) leaves them running, and that is not harmless. A daemon
thread that comes back from a C++ call that released the GIL (a gloo wait, a store request)
after the interpreter began to finalize is ended by Python (before 3.14) with
``pthread_exit`` inside pybind11's GIL guard, a destructor that cannot unwind, so the whole
process aborts::

    terminate called without an active exception        (SIGABRT, exit status 134)

in place of the script's own error and status, now and then, as the threads' timing falls.

So every object that runs such a thread registers here (:func:`stop_at_exit`), and one
``atexit`` handler, which runs before finalization, asks each to stop its threads
(``stop_threads(timeout)``) within :data:`EXIT_WAIT_S` seconds in all. A thread idle in a
queue ends at once; one in a transfer that never completes (a peer gone, no watchdog) is
left where it is after the wait: it never comes back, so it cannot abort the exit.
"""

from __future__ import annotations

import atexit
import time
import weakref
from typing import Protocol

#: The longest the exit waits for all the package's threads together (seconds).
EXIT_WAIT_S = 2.0


class StopsThreads(Protocol):
    def stop_threads(self, timeout: float) -> None:
        """Stop this object's daemon threads, waiting for them up to ``timeout`` seconds."""


_LIVE: weakref.WeakSet = weakref.WeakSet()


def stop_at_exit(owner: StopsThreads) -> None:
    """Have ``owner``'s threads stopped when the interpreter exits (held weakly; registering
    twice is once)."""
    _LIVE.add(owner)


@atexit.register
def _stop_all() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    for owner in list(_LIVE):
        owner.stop_threads(max(0.0, deadline - time.monotonic()))
