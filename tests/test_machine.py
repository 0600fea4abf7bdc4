"""What the examples say about the machine they measure on: load, steal, ranks per core."""

from __future__ import annotations

import pytest

from ddp_ring_hooks.machine import MachineLoad, describe_load, load_record, oversubscription_warning, usable_cores

pytestmark = pytest.mark.fast  # no test here starts a process


def reading(load: float, *, steal: int = 0, busy_ticks: int = 0, cores: int = 2) -> MachineLoad:
    # /proc/stat order: user nice system idle iowait irq softirq steal guest guest_nice
    return MachineLoad(load_average=load, cores=cores, cpu_ticks=(busy_ticks, 0, 0, 1000, 0, 0, 0, steal, 0, 0))


def test_a_reading_of_this_machine_is_sane():
    now = MachineLoad.now()
    assert now.load_average >= 0 and now.cores == usable_cores() >= 1
    assert now.steal_since(now) in (None, 0.0)


def test_steal_is_the_share_of_cpu_time_between_two_readings():
    start, end = reading(0.1), reading(0.2, steal=100, busy_ticks=300)
    assert end.steal_since(start) == 100 / 400
    assert MachineLoad(load_average=0.0, cores=2, cpu_ticks=None).steal_since(start) is None


def test_a_busy_start_is_said_next_to_the_numbers():
    quiet = describe_load(reading(0.2), reading(2.1), own_processes=2)
    assert quiet == ("machine: load average 0.2 at start, 2.1 at end, on 2 cores (this run's 2 processes count "
                     "in the end value); CPU steal 0.0% during the run")
    busy = describe_load(reading(3.4), reading(5.0), own_processes=2)
    assert "\nbusy at start: other work held 3.4 of 2 cores, so every timing above includes waiting for a core" in busy
    stolen = describe_load(reading(0.2), reading(2.0, steal=50, busy_ticks=50), own_processes=2)
    assert "CPU steal 50.0% during the run\nthe hypervisor took cores away" in stolen
    # a trace of steal (0.04%, printed as 0.0%) is no reason to say every timing stretched
    trace = describe_load(reading(0.2), reading(2.0, steal=4, busy_ticks=10000), own_processes=2)
    assert trace.endswith("CPU steal 0.0% during the run"), trace
    assert load_record(reading(3.4), reading(5.0)) == {
        "load_average_start": 3.4, "load_average_end": 5.0, "cores": 2, "steal_fraction": 0.0, "busy_at_start": True}


def test_more_processes_than_cores_says_what_it_does_to_the_numbers():
    assert oversubscription_warning(2, cores=2) is None
    text = oversubscription_warning(3, cores=2)
    assert text.startswith("warning: 3 processes on 2 cores: ranks take turns on the cores")
    assert "communication times include the scheduler's delays" in text and "--nproc_per_node=2" in text
