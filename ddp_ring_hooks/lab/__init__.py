"""An emulated cluster on one Linux machine: network namespaces as hosts, veth links through
bridges in namespaces of their own, ``tbf``-shaped rates, optional two tiers (nodes with
uplinks) and slow hosts; run a command or one torchrun agent per host.

Depends on nothing else in the package (it never imports torch); the CLI (``ddp-ring-hooks
lab``), ``bench``, the tests and the benchmarks use it. See ``docs/lab.md``.
"""

from .cluster import LINK_ENVIRONMENT, EmulatedCluster, HostUnreachable
from .housekeeping import remove_kept_labs, remove_labs_of, remove_stale_labs, status_report
from .iproute import LabError, LabUnavailable, unavailable_reason
from .jobs import HostFailed, HostResult, Job, LabTimeout
from .rates import RATE_HELP, format_rate, parse_rate

__all__ = [
    "LINK_ENVIRONMENT", "RATE_HELP", "EmulatedCluster", "HostFailed", "HostResult", "HostUnreachable", "Job",
    "LabError", "LabTimeout", "LabUnavailable", "format_rate", "parse_rate", "remove_kept_labs", "remove_labs_of",
    "remove_stale_labs", "status_report", "unavailable_reason",
]
