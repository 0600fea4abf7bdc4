"""What else the CPUs are doing while something is timed: load, steal, ranks per core.

A timing on a shared machine measures the other jobs too. Two readings say how much:

- the **load average** (``os.getloadavg``): runnable processes, averaged over the last
  minute. On ``c`` cores, a load near 0 before a run means the run had the cores to itself;
  a load of ``c`` or more means every core was already taken by someone else.
- **CPU steal** (``/proc/stat``, Linux): the share of time a virtual machine's cores were
  taken away by the hypervisor for other guests. Nothing inside the machine shows up in
  the load for it, but every timing stretches by it.

And one the launcher decides: more processes than cores (``--nproc_per_node=3`` on 2 cores)
makes ranks queue for a core. A rank that waits for a core looks, to its peers, like a slow
link: the communication time absorbs the scheduler's delays, and which setting wins
depends on who got scheduled when.

::

    before = MachineLoad.now()
    ...                                   # the measurement
    print(describe_load(before, MachineLoad.now(), own_processes=2))
    # machine: load average 1.9 at start, 3.8 at end, on 2 cores (this run's 2 processes count
    # in the end value); CPU steal 0.0% during the run; busy at start: ...
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: Load per core at the start above which a run is called busy (other work holds half the cores).
BUSY_LOAD_PER_CORE = 0.5
#: Steal below this share of the CPU time is not worth a line: it stretches the timings less
#: than a single run moves by (5-10% here); the number itself is still printed.
STEAL_NOTICED = 0.01


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the system has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


@dataclass(frozen=True)
class MachineLoad:
    """One reading: the 1-minute load average, the cores, and the CPU time counters (``None``
    where ``/proc/stat`` does not exist) that two readings turn into the steal in between."""

    load_average: float
    cores: int
    cpu_ticks: tuple[int, ...] | None

    @classmethod
    def now(cls) -> MachineLoad:
        return cls(load_average=os.getloadavg()[0], cores=usable_cores(), cpu_ticks=_cpu_ticks())

    def steal_since(self, earlier: MachineLoad) -> float | None:
        """The share of CPU time stolen by the hypervisor between ``earlier`` and this reading."""
        if self.cpu_ticks is None or earlier.cpu_ticks is None or len(self.cpu_ticks) < 8:
            return None
        elapsed = [now - then for now, then in zip(self.cpu_ticks, earlier.cpu_ticks)]
        total = sum(elapsed[:8])  # user nice system idle iowait irq softirq steal (guest is in user)
        return elapsed[7] / total if total > 0 else 0.0

    @property
    def busy(self) -> bool:
        return self.load_average >= BUSY_LOAD_PER_CORE * self.cores


def _cpu_ticks() -> tuple[int, ...] | None:
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            first = stat.readline().split()
    except OSError:
        return None
    return tuple(int(value) for value in first[1:]) if first and first[0] == "cpu" else None


def load_record(start: MachineLoad, end: MachineLoad) -> dict:
    """The two readings as plain data (for a results file)."""
    return {
        "load_average_start": start.load_average,
        "load_average_end": end.load_average,
        "cores": start.cores,
        "steal_fraction": end.steal_since(start),
        "busy_at_start": start.busy,
    }


def describe_load(start: MachineLoad, end: MachineLoad, *, own_processes: int) -> str:
    """One or two lines for next to a verdict: the load at start and end, the steal, and
    what a busy start means for the numbers."""
    steal = end.steal_since(start)
    text = (f"machine: load average {start.load_average:.1f} at start, {end.load_average:.1f} at end, on "
            f"{start.cores} cores (this run's {own_processes} processes count in the end value)")
    if steal is not None:
        text += f"; CPU steal {steal:.1%} during the run"
    if start.busy:
        text += (f"\nbusy at start: other work held {start.load_average:.1f} of {start.cores} cores, so every "
                 "timing above includes waiting for a core; expect slower steps and rounds that disagree")
    elif steal is not None and steal >= STEAL_NOTICED:
        text += "\nthe hypervisor took cores away during the run: every timing above stretches by that share"
    return text


def oversubscription_warning(processes: int, cores: int | None = None) -> str | None:
    """What running ``processes`` ranks on this node's cores does to the numbers; ``None``
    when every process has a core of its own."""
    cores = usable_cores() if cores is None else cores
    if processes <= cores:
        return None
    return (f"warning: {processes} processes on {cores} cores: ranks take turns on the cores, and a rank "
            "waiting for a core looks to the others like a slow link, so communication times include "
            "the scheduler's delays and the comparison measures the oversubscription as much as the "
            f"all-reduce; launch at most --nproc_per_node={cores} here")
