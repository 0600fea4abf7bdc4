"""Which labs exist, who owns them, and which slot (prefix and subnet) is free.

Each lab has one record, ``/run/ddp_ring_hooks/labs/drhN.json``: its slot, what was asked
for, and its owner (the process that made it, by pid and start time, so that a reused pid is
not mistaken for it; or none for a lab made by ``lab up``, which lives until ``lab down``).
The record is written *before* anything is made and removed only after everything is gone, so
a lab whose owner was killed half-way is still known and ``lab down --stale`` can remove it.
Slots are claimed under an exclusive lock, so two labs starting at once get different ones.
``/run`` is a tmpfs: records vanish at reboot, together with the namespaces they describe.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from .iproute import LabError, existing_namespaces
from .topology import MAX_LABS, NAME_PREFIX, LabSpec, Plan, spec_from_dict

RECORDS = Path("/run/ddp_ring_hooks/labs")


@dataclass(frozen=True, slots=True)
class LabRecord:
    """One lab as the registry knows it."""

    slot: int
    spec: dict  # LabSpec.as_dict()
    owner_pid: int | None  # None: kept until `lab down`
    owner_started: int | None  # the owner's start time in clock ticks after boot (/proc/PID/stat)
    created: float  # time.time()

    @property
    def name(self) -> str:
        return f"{NAME_PREFIX}{self.slot}"

    @property
    def plan(self) -> Plan:
        return Plan(slot=self.slot, spec=spec_from_dict(self.spec))

    def owner_alive(self) -> bool:
        """Whether the owning process still runs (always true for a lab kept until `lab down`)."""
        return self.owner_pid is None or _started(self.owner_pid) == self.owner_started


def claim(spec: LabSpec) -> LabRecord:
    """A free slot for ``spec``, recorded as owned by this process: no record and no namespace
    of anyone's carries its prefix."""
    with _locked():
        taken = {record.slot for record in records()}
        namespaces = existing_namespaces()
        for slot in range(MAX_LABS):
            prefix = f"{NAME_PREFIX}{slot}-"
            if slot in taken or any(name.startswith(prefix) for name in namespaces):
                continue
            record = LabRecord(slot=slot, spec=spec.as_dict(), owner_pid=os.getpid(),
                               owner_started=_started(os.getpid()), created=time.time())
            save(record)
            return record
    raise LabError(f"all {MAX_LABS} lab slots are taken; `ddp-ring-hooks lab status` lists them, "
                   "`ddp-ring-hooks lab down --stale` removes those whose owner is gone")


def save(record: LabRecord) -> None:
    path = RECORDS / f"{record.name}.json"
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(asdict(record), indent=1) + "\n")
    partial.replace(path)  # readers never see half a record


def find(name: str) -> LabRecord | None:
    return next((record for record in records() if record.name == name), None)


def forget(name: str) -> None:
    (RECORDS / f"{name}.json").unlink(missing_ok=True)


def records() -> list[LabRecord]:
    """Every recorded lab, by slot."""
    found = []
    for path in RECORDS.glob(f"{NAME_PREFIX}*.json") if RECORDS.is_dir() else ():
        try:
            found.append(LabRecord(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue  # being replaced right now, or not ours
    return sorted(found, key=lambda record: record.slot)


@contextmanager
def _locked() -> Iterator[None]:
    RECORDS.mkdir(parents=True, exist_ok=True)
    with open(RECORDS / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _started(pid: int) -> int | None:
    """The start time of process ``pid`` (field 22 of /proc/PID/stat), ``None`` if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # fields after the command name start at field 3
