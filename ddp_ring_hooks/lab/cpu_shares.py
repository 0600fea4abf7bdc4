"""Cores of their own: each host of a lab in a CPU cgroup capped at its share of the machine.

On one machine every host computes on the same cores, so ``p`` hosts computing at once each
take longer than one would alone, which a cluster's hosts, each with CPUs of its own, do not.
On this project's 2-core machine, 8 hosts stretched the part of a step that is not exposed
communication from 26-32 ms (2 hosts) to 103-119 ms (``docs/advisor.md``), and every
prediction for 8 machines read 8-12% fast against it. With ``cpus=c`` (``EmulatedCluster``),
every process started on a host runs in a cgroup of that host whose CFS quota is ``c`` cores::

    /sys/fs/cgroup/cpu/ddp_ring_hooks/drh0/host0   cpu.cfs_quota_us = c · cpu.cfs_period_us   (cgroup v1)
    /sys/fs/cgroup/ddp_ring_hooks/drh0/host0       cpu.max = "c·period period"                 (cgroup v2)

so a host computes as fast whether one host or all of them run, as long as ``hosts · c`` is
at most the machine's cores (measured on the lab, 8 hosts of 0.25 cores on 2: that part of the
step 78-85 ms at 2 hosts, 78-100 ms at 3 to 8 in two runs; 121-168 ms at 8 in three more, where
the quotas take every core and the kernel's network work, which no quota counts, takes from
them). What a quota does not give is a slower core: a
host of 0.25 cores runs at full speed for a quarter of each period and waits out the rest, so
a short burst of work can wait up to ``(1 - c)·period``, and one after an idle spell starts a
quota ahead; :func:`period_us` keeps the period as short as the kernel allows. A host of
``c`` cores is also ``c`` times a core for the executor's own work per message (a 16 KiB ring
all-reduce costs 0.8 ms of CPU per rank here): its α grows as on a slower machine.

A process joins its host's cgroup in the child before it runs (``preexec_fn``, still in the
root namespace, where the cgroup files are: ``ip netns exec`` mounts a sysfs of its own), so
its threads and children are all counted. The cgroups are named after the lab's prefix, made
with it, and removed with it (:func:`remove`, after its processes are killed), by its owner or
by the housekeeping of stale labs; nothing else in the hierarchy is touched.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

from .iproute import LabError, LabUnavailable
from .topology import Plan

#: The directory under the cpu controller's hierarchy that every lab's cgroups live in.
ROOT_NAME = "ddp_ring_hooks"
#: The kernel's least CFS quota (µs): a host runs at least this long before it is throttled.
LEAST_QUOTA_US = 1000
_MOUNTS = Path("/proc/self/mounts")


def period_us(cpus: float) -> int:
    """The CFS period of a host of ``cpus`` cores: as short as the kernel allows (a quota of
    :data:`LEAST_QUOTA_US`, and a period of at least that), since a throttled host waits out the
    rest of its period. So a short burst after an idle spell runs at most one quota ahead of a
    sustained one: measured on the lab at a 10 ms period and 0.25 cores, the 3 micro-batches
    that k = 4 adds, run back to back, took 67 ms each where the base's, after its idle wait for
    the link, took 58 (``docs/advisor.md``, the ninth series); at 4 ms the head start is 1 ms."""
    return max(LEAST_QUOTA_US, round(LEAST_QUOTA_US / cpus))


@functools.cache
def hierarchy() -> tuple[Path, int] | None:
    """The cpu controller's mount and its cgroup version: cgroup v1's ``cpu`` hierarchy, else a
    cgroup v2 one whose root offers ``cpu``; ``None`` when neither is mounted (read once: a
    process's mounts do not move under a lab)."""
    v2 = None
    for line in _MOUNTS.read_text().splitlines():
        _, where, kind, options, *_ = line.split()
        if kind == "cgroup" and "cpu" in options.split(","):
            return Path(where), 1
        if kind == "cgroup2" and "cpu" in _read(Path(where) / "cgroup.controllers").split():
            v2 = Path(where)
    return (v2, 2) if v2 is not None else None


def unavailable_reason() -> str | None:
    """Why hosts cannot get CPU shares here (``None`` when they can)."""
    found = hierarchy()
    if found is None:
        return ("cpus= needs the cgroup cpu controller (cgroup v1's cpu hierarchy, or cgroup v2 with cpu in "
                "cgroup.controllers) and none is mounted; leave cpus unset to share the machine's cores")
    if not os.access(found[0], os.W_OK):
        return f"cpus= needs to make cgroups under {found[0]}, which this user cannot write (run as root)"
    return None


def lab_cgroup(plan: Plan) -> Path:
    """The directory of ``plan``'s lab's cgroups (whether or not it exists); :class:`LabUnavailable`
    where no cpu controller is mounted."""
    found = hierarchy()
    if found is None:
        raise LabUnavailable(unavailable_reason())
    return found[0] / ROOT_NAME / plan.name


def host_cgroup(plan: Plan, host: int) -> Path:
    """The cgroup of one host of ``plan``'s lab (whether or not it exists)."""
    return lab_cgroup(plan) / f"host{host}"


def make(plan: Plan) -> None:
    """Make each host's cgroup, capped at ``plan.spec.cpus`` cores; :class:`LabUnavailable` when
    this machine cannot."""
    reason = unavailable_reason()
    if reason:
        raise LabUnavailable(reason)
    root, version = hierarchy()
    period = period_us(plan.spec.cpus)
    quota = round(plan.spec.cpus * period)  # at least LEAST_QUOTA_US (lab_spec: MIN_CPUS)
    hosts = [host_cgroup(plan, host) for host in range(plan.spec.hosts)]
    for directory in (root / ROOT_NAME, lab_cgroup(plan), *hosts):
        if version == 2:  # a v2 cgroup gets the cpu controller only where its parent passes it on
            (directory.parent / "cgroup.subtree_control").write_text("+cpu")
        directory.mkdir(exist_ok=True)
    for directory in hosts:
        if version == 1:
            (directory / "cpu.cfs_period_us").write_text(str(period))
            (directory / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (directory / "cpu.max").write_text(f"{quota} {period}")


def join(plan: Plan, host: int) -> None:
    """Move the calling process into ``host``'s cgroup (a child's ``preexec_fn``: before it runs)."""
    (host_cgroup(plan, host) / "cgroup.procs").write_text(str(os.getpid()))


def remove(plan: Plan, *, wait_s: float = 5.0) -> None:
    """Remove the lab's cgroups (its processes already killed: a cgroup goes once its last task
    has exited, which can take a moment after SIGKILL); :class:`LabError` naming what is left."""
    if hierarchy() is None or not lab_cgroup(plan).exists():
        return
    lab = lab_cgroup(plan)
    deadline = time.monotonic() + wait_s
    while True:
        left = [d for d in (*(host_cgroup(plan, h) for h in range(plan.spec.hosts)), lab) if not _rmdir(d)]
        if not left:
            break
        if time.monotonic() > deadline:
            raise LabError(f"could not remove cgroups {[str(d) for d in left]} of lab {plan.name} (processes still "
                           f"in them: see their cgroup.procs); remove them with rmdir once those have ended")
        time.sleep(0.05)
    _rmdir(lab.parent)  # ROOT_NAME, only when no other lab's cgroups are left in it


def _rmdir(directory: Path) -> bool:
    """Remove an empty cgroup; whether it is gone."""
    try:
        directory.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
