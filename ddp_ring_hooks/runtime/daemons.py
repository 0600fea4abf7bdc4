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

Threads that are not ours run our code too: gloo completes a collective's Future on its own C++
thread, which runs the Future callbacks chained on it (``runtime/native.py``'s ``finished``,
the hook's naming of the failure, the stall watchdog's guard). When a bucket fails, that thread
wakes DDP, and so the main thread with the error, *before* it has finished the chain: the
callbacks after DDP's, and the Python references the chain drops, still need the GIL. A script
that ends at once on the error then finalizes under it, and the thread aborts the process
("terminate called after throwing an instance of 'std::runtime_error'", or "... without an
active exception"): a rank the stall watchdog had failed did so in one run of 22 here under
load (none of 45 since), and once in CI. So each such callback is decorated
:func:`backend_callback`; when one raises, the exit gives the threads :data:`CALLBACK_TAIL_S`
after the last such failure to finish (the GIL is free while the main thread sleeps). A run in
which nothing failed pays nothing.
"""

from __future__ import annotations

import atexit
import functools
import time
import weakref
from typing import Callable, Protocol, TypeVar

#: The longest the exit waits for all the package's threads together (seconds).
EXIT_WAIT_S = 2.0
#: How long after the last failed :func:`backend_callback` the exit lets a backend's thread
#: finish its chain of callbacks (seconds): the rest of a chain is C++ and reference drops,
#: microseconds once the thread has the GIL.
CALLBACK_TAIL_S = 0.5

Callback = TypeVar("Callback", bound=Callable)
_last_failed_callback: float | None = None  # time.monotonic() of the last backend_callback that raised


class StopsThreads(Protocol):
    def stop_threads(self, timeout: float) -> None:
        """Stop this object's daemon threads, waiting for them up to ``timeout`` seconds."""


_LIVE: weakref.WeakSet = weakref.WeakSet()


def stop_at_exit(owner: StopsThreads) -> None:
    """Have ``owner``'s threads stopped when the interpreter exits (held weakly; registering
    twice is once)."""
    _LIVE.add(owner)


def backend_callback(callback: Callback) -> Callback:
    """Mark ``callback``, a Future callback that may run on a backend's own thread (gloo's), so
    that when it raises, the exit waits for that thread to finish the chain (module docstring)."""

    @functools.wraps(callback)
    def marked(*args, **kwargs):
        global _last_failed_callback
        try:
            return callback(*args, **kwargs)
        except BaseException:
            _last_failed_callback = time.monotonic()
            raise

    return marked  # type: ignore[return-value]


@atexit.register
def _stop_all() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    for owner in list(_LIVE):
        owner.stop_threads(max(0.0, deadline - time.monotonic()))
    if _last_failed_callback is not None:  # a backend's thread may still be in the failed chain
        time.sleep(max(0.0, _last_failed_callback + CALLBACK_TAIL_S - time.monotonic()))
