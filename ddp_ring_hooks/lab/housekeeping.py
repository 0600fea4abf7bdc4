"""Labs seen from outside their owner: what runs (``lab status``), and removing what is left.

Only labs in the registry are ever touched (made by this code, see :mod:`.registry`), and of
those, a lab whose owner process still runs is never removed from outside: its owner removes
it; besides them, only the capability probe's namespace of a process that is gone
(``drh-probe-PID``, see :func:`.iproute.unavailable_reason`). Other namespaces on the machine,
whatever their names, are not looked at.
"""

from __future__ import annotations

import datetime

from . import cpu_shares, iproute, registry
from .iproute import LabError
from .registry import LabRecord


def remove_stale_labs() -> list[str]:
    """Remove every lab whose owner process is gone (killed before it could clean up), and the
    capability probe's namespace of a process killed mid-probe; return their names. Labs of
    running processes and labs made by ``lab up`` are left alone."""
    return iproute.remove_stale_probes() + [record.name for record in registry.records() if not record.owner_alive() and _remove(record)]


def remove_labs_of(pid: int) -> list[str]:
    """Remove the labs that process ``pid`` owns (a test session's finalizer: ``os.getpid()``)."""
    return [record.name for record in registry.records() if record.owner_pid == pid and _remove(record)]


def remove_kept_labs(name: str | None = None) -> list[str]:
    """Remove the lab ``name``, or every lab made by ``lab up`` when ``name`` is ``None``. A lab
    that a running process owns is refused: that process removes it when it ends."""
    if name is None:
        return [record.name for record in registry.records() if record.owner_pid is None and _remove(record)]
    record = registry.find(name)
    if record is None:
        raise LabError(f"no lab named {name!r}; `ddp-ring-hooks lab status` lists the labs")
    if record.owner_pid is not None and record.owner_alive():
        raise LabError(f"lab {name} belongs to running process {record.owner_pid}, which removes it when it ends; "
                       f"stop that process instead (kill {record.owner_pid})")
    return [name] if _remove(record) else []


def status_report() -> str:
    """Every lab: its shape, its owner, and each host's address, namespace and node."""
    records = registry.records()
    if not records:
        return "no lab is up (start one with `ddp-ring-hooks lab up --hosts 2 --link 400Mbit`)\n"
    present = iproute.existing_namespaces()
    lines = []
    for record in records:
        plan = record.plan
        made = datetime.datetime.fromtimestamp(record.created).strftime("%Y-%m-%d %H:%M:%S")
        missing = [name for name in plan.namespaces if name not in present]
        lines.append(f"{record.name}: {plan.spec.describe()}; subnet {plan.subnet}; made {made}; {_owner(record)}")
        if missing:
            lines.append(f"  incomplete: namespaces {missing} are missing")
        for host in range(plan.spec.hosts):
            lines.append(f"  host {host}  {plan.address(host):<12} netns {plan.host_namespace(host):<10} "
                         f"node {plan.node_of_host(host)}  device {plan.interface}")
    return "\n".join(lines) + "\n"


def _owner(record: LabRecord) -> str:
    if record.owner_pid is None:
        return "kept until `ddp-ring-hooks lab down`"
    if record.owner_alive():
        return f"owned by running process {record.owner_pid}"
    return f"stale: its owner (process {record.owner_pid}) is gone; `ddp-ring-hooks lab down --stale` removes it"


def _remove(record: LabRecord) -> bool:
    """Remove one recorded lab; whether everything went (its record too)."""
    if iproute.destroy(record.plan):
        return False
    try:
        cpu_shares.remove(record.plan)
    except LabError:
        return False
    registry.forget(record.name)
    return True
