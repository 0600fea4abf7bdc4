"""Ctrl-C that ends a torchrun job within seconds and without a traceback, even when a rank is
waiting in C++ or its peer took the signal first.

torchrun starts each rank in a session of its own, so a terminal's Ctrl-C reaches torchrun only,
and torchrun forwards SIGINT to its ranks one after another. Python runs a signal's handler (the
one that raises ``KeyboardInterrupt``) only between bytecodes of the main thread, so a rank whose
main thread waits inside a C++ call takes the signal only when that call returns::

    rank 0   Python (training, an import)  ---- SIGINT -> KeyboardInterrupt, exits
    rank 1   C++: TCPStore get (the group's   ---- SIGINT -> (pending) ... the store's timeout
             rendezvous), a gloo connect,                    (minutes; rank 0 never comes)
             a collective rank 0 left

torchrun, meanwhile, gives its ranks 30 s after the signal, then kills them with a traceback.
Measured here: a ``TCPStore.get`` of a key nobody sets took SIGINT only at its 60 s timeout; the
project's main job, interrupted as it started, took torchrun's 30 s twice in 210 tries.

:func:`exit_promptly_on_ctrl_c` makes such a rank leave on its own: the interpreter's C-level
signal handler writes each signal's number to a *wakeup fd* (:func:`signal.set_wakeup_fd`) at
once, whatever the main thread is doing, and a watcher thread reading that fd gives the main
thread ``grace_s`` to take the ``KeyboardInterrupt``. A rank that takes it cleans up as it
would anyway (Lightning's shutdown, the main job removing its partial run); one that does not
is ended with exit code 130, the shell's code for Ctrl-C, and one line saying why.

The forwarding has a second consequence. When torchrun is slow between two ranks (a loaded
machine), rank 0 can take its signal and leave before rank 1's arrives; rank 1's next
collective then fails with gloo's "Connection closed by peer", and without help rank 1 dies
with that traceback, as if the run had crashed (one CI run in many). In the ``except`` around
training, :func:`wait_for_forwarded_ctrl_c` gives such a rank a few seconds for its own
signal, which then arrives as the ``KeyboardInterrupt`` the rank handles as usual.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time

#: Seconds the main thread has to take Ctrl-C before the rank is ended: well under torchrun's
#: 30 s, well over what a training step's C++ calls take (a rank that takes the signal after a
#: long collective still shuts down in Python).
GRACE_S = 10.0
#: The exit code of a process ended by Ctrl-C (128 + SIGINT), as a shell reports it.
CTRL_C_EXIT_CODE = 128 + signal.SIGINT

#: Seconds a rank whose peer left waits for its own Ctrl-C, forwarded by torchrun after the
#: peer's (the module docstring): far above the gap between two of torchrun's signals, short
#: enough that a real crash of the peer is still reported promptly.
FORWARDED_WAIT_S = 5.0
#: What gloo (its TCP transport) and NCCL say when the process at the other end has gone.
PEER_GONE_MESSAGES = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                      "remote process exited")

_watching = False  # this process's watcher is running (one per process, as its signal handlers)


def exit_promptly_on_ctrl_c(grace_s: float = GRACE_S) -> bool:
    """From now on, end this process ``grace_s`` seconds after a Ctrl-C (SIGINT) its main
    thread did not take (see the module docstring). Call it from the main thread, first thing.

    Returns ``False``, changing nothing, where SIGINT does not raise ``KeyboardInterrupt``
    anyway: its handler is the default action (the process ends at once) or ignored (it should
    not end). Raises :class:`RuntimeError` when something else (an asyncio loop) already owns
    the wakeup fd, and :class:`ValueError` for a ``grace_s`` that is not a positive number.
    A second call keeps the first one's watcher (signal handling is the process's, not a call's)."""
    global _watching
    if not (isinstance(grace_s, (int, float)) and 0 < grace_s < math.inf):
        raise ValueError(f"grace_s={grace_s!r}: give the seconds the main thread has to take Ctrl-C (a number > 0)")
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("exit_promptly_on_ctrl_c must be called from the main thread (Python's signal handlers live there)")
    if _watching:
        return True
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # SIG_DFL ends the process at once; SIG_IGN asked for no ending
        return False
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # the C handler must never block on it
    owner = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    if owner != -1:
        signal.set_wakeup_fd(owner)
        os.close(read_end)
        os.close(write_end)
        raise RuntimeError(f"the signal wakeup fd is already in use (fd {owner}, e.g. by an asyncio loop): "
                           "call exit_promptly_on_ctrl_c before starting it, or leave Ctrl-C to it")
    taken = _Taken()

    def on_sigint(signum, frame):
        taken.one_more()
        return previous(signum, frame)  # Python's default raises KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    threading.Thread(target=_watch, args=(read_end, taken, grace_s), name="ctrl-c watcher", daemon=True).start()
    _watching = True
    return True


class _Taken:
    """How many SIGINTs the main thread's handler has run for, and a way to wait for the next."""

    def __init__(self) -> None:
        self._count = 0
        self._changed = threading.Condition()

    def one_more(self) -> None:
        with self._changed:
            self._count += 1
            self._changed.notify_all()

    def wait_for(self, count: int, timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self._count >= count, timeout=timeout)


def _watch(read_end: int, taken: _Taken, grace_s: float) -> None:
    """The watcher thread: for each SIGINT the interpreter saw, wait for the main thread to take
    it; end the process when it does not in time."""
    arrived = 0
    while True:
        for number in os.read(read_end, 64):  # blocks until a signal arrives
            if number != signal.SIGINT:
                continue  # another signal with a Python handler (e.g. Lightning's SIGTERM)
            arrived += 1
            if not taken.wait_for(arrived, grace_s):
                rank = os.environ.get("RANK")
                who = f"rank {rank}" if rank is not None else f"process {os.getpid()}"
                print(f"{who}: Ctrl-C, but its main thread is waiting in C++ (a store, a connect or a collective a "
                      f"peer left) and did not take it in {grace_s:g} s: ending it now (exit {CTRL_C_EXIT_CODE})",
                      file=sys.stderr, flush=True)
                with contextlib.suppress(Exception):
                    sys.stdout.flush()  # what the rank printed before, as a normal exit would
                os._exit(CTRL_C_EXIT_CODE)


def peer_left(error: BaseException) -> bool:
    """Whether ``error``, or an exception it was raised from, says that the process at the other
    end of a connection has gone (gloo's "Connection closed by peer", torch's ``DistNetworkError``)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if type(error).__name__ == "DistNetworkError" or any(text in str(error) for text in PEER_GONE_MESSAGES):
            return True
        error = error.__cause__ or error.__context__
    return False


def wait_for_forwarded_ctrl_c(error: BaseException, wait_s: float = FORWARDED_WAIT_S) -> None:
    """In the ``except`` around training: when ``error`` says a peer left (:func:`peer_left`),
    wait up to ``wait_s`` seconds for this rank's own Ctrl-C, which torchrun may still be
    forwarding::

        try:
            train()
        except Exception as error:
            wait_for_forwarded_ctrl_c(error)  # raises KeyboardInterrupt if Ctrl-C ended the peer
            raise                             # a peer that crashed, or any other failure

    The signal arrives as ``KeyboardInterrupt``, raised from here with ``error`` as its context,
    and the caller's own Ctrl-C handling takes over. Returns at once for other errors, off the
    main thread, or where Ctrl-C raises nothing (SIGINT ignored, or its default action, which
    ends the process at once); after ``wait_s`` when no signal came: then the peer really
    failed, and the caller re-raises ``error``."""
    if not (isinstance(wait_s, (int, float)) and 0 <= wait_s < math.inf):
        raise ValueError(f"wait_s={wait_s!r}: give the seconds to wait for a forwarded Ctrl-C (a number >= 0)")
    if threading.current_thread() is not threading.main_thread() or not callable(signal.getsignal(signal.SIGINT)):
        return
    if not peer_left(error):
        return
    time.sleep(wait_s)  # a SIGINT ends the sleep: its handler raises KeyboardInterrupt here
