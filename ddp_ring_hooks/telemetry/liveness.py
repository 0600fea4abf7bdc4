"""What this host's kernel shows of a rank whose reports stopped: stopped, dead, hung, or busy.

The stall watchdog's heartbeat is a Python thread (:mod:`.stall`), and a Python thread cannot
run while another holds the GIL (pickling a large checkpoint, a long C call): such a rank
falls silent although it is merely busy. The kernel does not need the GIL. For a rank on the
reader's own host, ``/proc/<pid>/stat`` says what its process is doing::

    record unchanged for a poll  ->  sample /proc/<pid>/stat: state, CPU time (utime + stime)
    state T / t                  ->  "stopped" (SIGSTOP, job control) / "traced" (a debugger)
    no such process, Z, a new    ->  "dead"
      process under that pid
    later samples, CPU share     ->  "running" (>= RUNNING_SHARE of a CPU: busy, e.g. holding
                                     the GIL) or "idle" (asleep while silent: hung)

1. **Same host** means the same kernel boot and the same PID *and network* namespaces
   (:func:`host_identity`): the PID must name the same process here, and a process in another
   network namespace (an emulated host of the lab, a container) may be cut off while it runs.
2. A PID is trusted only with its start time (``started``, field 22): a reused PID is "dead".
3. Only ranks whose record stopped changing are sampled, a few reads of small files per poll.

Elsewhere nothing here can tell a frozen rank from one holding the GIL: the watchdog calls a
silent rank on another host stalled, and planned long work is marked with
``HookState.paused`` (docs/reliability.md says why and what that costs).

:func:`continue_stopped` is what the survivors do at ``stall_timeout`` for a stopped rank on
their host: ``SIGCONT``, so it runs into the aborted group, fails and exits (a stopped process
ignores torchrun's SIGTERM until it is continued, and keeps the job alive meanwhile).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal

#: A silent rank using at least this share of a CPU is running (busy), below it idle (hung).
RUNNING_SHARE = 0.1
_STOPPED_STATES = {"T": "stopped", "t": "traced"}
_DEAD_STATES = {"Z", "X", "x"}


@dataclasses.dataclass(frozen=True)
class ThisProcess:
    """Who this process is, as its record publishes it (``None`` s off Linux)."""

    pid: int
    host: int | None
    started: int | None


def this_process() -> ThisProcess:
    look = _read_stat(os.getpid())
    return ThisProcess(pid=os.getpid(), host=host_identity(), started=None if look is None else look[2])


def host_identity() -> int | None:
    """A number naming what a PID means here: the kernel's boot id and this process's PID and
    network namespaces (52 bits, exact in JSON and float64); ``None`` without ``/proc``."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            boot = file.read().strip()
        names = [os.readlink(f"/proc/self/ns/{kind}") for kind in ("pid", "net")]
    except OSError:
        return None
    return int.from_bytes(hashlib.sha1("/".join([boot, *names]).encode()).digest()[:7], "big") >> 4


def _read_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, CPU ticks used, start time in ticks) of ``pid``, or ``None`` if there is none."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            text = file.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    return fields[0], int(fields[11]) + int(fields[12]), int(fields[19])


class LocalEvidence:
    """The kernel's view of the ranks on this host whose reports stopped (see the module
    docstring); ``min_window``: seconds of samples before "running" or "idle" is decided."""

    def __init__(self, *, host: int | None, min_window: float) -> None:
        self.host = host
        self.min_window = min_window
        self._ticks_per_s = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._first: dict[int, tuple[tuple, float, int]] = {}  # rank -> (record's number, at, CPU ticks)

    def judge(self, rank: int, *, host, pid, started, number: tuple, unchanged_for: float, now: float) -> str | None:
        """What the kernel shows of ``rank`` (on ``host``, as ``pid`` started at ``started``;
        ``number``: its record's (attempt, seq), unchanged for ``unchanged_for`` of my seconds):
        ``"stopped"``, ``"traced"``, ``"dead"``, ``"running"``, ``"idle"``, or ``None``
        (reporting, on another host, or not decided yet)."""
        if self.host is None or host != self.host or pid is None or unchanged_for <= 0:
            self._first.pop(rank, None)
            return None
        look = _read_stat(pid)
        if look is None or look[2] != started or look[0] in _DEAD_STATES:
            return "dead"
        state, ticks, _ = look
        if state in _STOPPED_STATES:
            return _STOPPED_STATES[state]
        first = self._first.get(rank)
        if first is None or first[0] != number:
            self._first[rank] = (number, now, ticks)
            return None
        window = now - first[1]
        if window < self.min_window:
            return None
        share = (ticks - first[2]) / self._ticks_per_s / window
        return "running" if share >= RUNNING_SHARE else "idle"


def continue_stopped(pid: int, started: int | None) -> bool:
    """Send ``SIGCONT`` to ``pid`` if it is the process that started at ``started`` and it is
    stopped by a signal (state T; a debugger's stop, t, is left alone); whether it was sent."""
    look = _read_stat(pid)
    if look is None or look[2] != started or look[0] != "T":
        return False
    try:
        os.kill(pid, signal.SIGCONT)
    except OSError:
        return False
    return True
