"""Make and remove what a :class:`~.topology.Plan` describes, with iproute2's ``ip`` and ``tc``.

Every command names its namespace (``ip -n NS ...``, ``tc -n NS ...``), and veth pairs are
created with their far end already inside the switch's (or node's) namespace and the near end
sent straight into the host's: nothing is ever created in, moved through or changed in the
root namespace. Shaping is a ``tbf`` qdisc on the sending side of each end: the near end
shapes what the host sends, the far end (the bridge's port) what it receives.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from .topology import Link, Plan

#: Where ``ip netns exec`` finds per-namespace files it mounts over ``/etc`` (``hosts`` here).
NETNS_ETC = Path("/etc/netns")

# tbf: a bucket of 5 ms at the rate, at least 128 KiB (two 64 KiB GSO packets), and a queue of
# 5 ms. A smaller bucket starves full-duplex TCP, since a 64 KiB GSO packet waits for a full
# bucket while the other direction's ACKs keep draining it: measured at 400 Mbit/s, gloo's
# 16 MiB all-reduce between 2 hosts took 1.5-2.2x the link limit with a 64 KiB bucket and
# 1.03-1.06x with 250 KB (5 ms). The price: one bucket passes at link speed plus its size, so a
# transfer of about 1 MiB reads ~10% faster than the rate allows.
_BURST_SECONDS = 0.005
_MIN_BURST_BYTES = 128 * 1024
_QUEUE_LATENCY = "5ms"


class LabError(RuntimeError):
    """Something about the lab failed; the message says what and how to fix it."""


class LabUnavailable(LabError):
    """This machine (or this user) cannot make an emulated lab."""


#: The namespace :func:`unavailable_reason` makes and deletes, with the prober's pid appended
#: (``remove_stale_probes`` deletes one whose prober was killed half-way).
PROBE_PREFIX = "drh-probe-"


def unavailable_reason() -> str | None:
    """Why no lab can be made here (``None`` when one can), found by trying: root and iproute2,
    then a namespace with a veth pair and a ``tbf`` qdisc made and deleted (:func:`_probe`).
    Listing namespaces is not enough: a container's root without ``CAP_NET_ADMIN`` lists them
    and is refused the first link it adds."""
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        return "the emulated lab needs Linux network namespaces (/proc/self/ns/net is missing)"
    if os.geteuid() != 0:
        return ("the emulated lab needs root: network namespaces, veth links and tc qdiscs need CAP_NET_ADMIN "
                "(run as root, e.g. with sudo)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the emulated lab needs iproute2's `{tool}` on PATH (apt-get install iproute2)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns list` failed, so network namespaces cannot be used here: {probe.stderr.strip()}"
    return _probe()


@functools.cache
def _probe() -> str | None:
    """Make what a lab is made of, in a namespace of its own; delete it; what failed. Once per
    process: it is four commands, and every lab asks."""
    namespace = f"{PROBE_PREFIX}{os.getpid()}"
    steps = (
        ("ip", "netns", "add", namespace),
        ("ip", "-n", namespace, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1"),
        ("tc", "-n", namespace, "qdisc", "add", "dev", "probe0", "root", "tbf", "rate", "1mbit", "burst", "32kbit",
         "latency", "50ms"),
        ("tc", "-n", namespace, "qdisc", "del", "dev", "probe0", "root"),
    )
    try:
        for step in steps:
            run(*step)
    except LabError as error:
        return (f"this machine cannot make an emulated lab: {error} (network namespaces, veth links and tc "
                "qdiscs need CAP_NET_ADMIN; a container gets it with `--cap-add NET_ADMIN` or `--privileged`)")
    finally:
        run("ip", "netns", "del", namespace, check=False)
    return None


def remove_stale_probes() -> list[str]:
    """Delete the probe namespaces of processes that are gone (killed mid-probe); their names."""
    stale = [name for name in existing_namespaces() if name.startswith(PROBE_PREFIX)
             and name.removeprefix(PROBE_PREFIX).isdigit()
             and not Path("/proc", name.removeprefix(PROBE_PREFIX)).exists()]
    for name in stale:
        run("ip", "netns", "del", name, check=False)
    return stale


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run one ``ip``/``tc`` command; on failure raise :class:`LabError` with the command and its error."""
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise LabError(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done


def existing_namespaces() -> set[str]:
    """Names of the network namespaces ``ip netns`` knows, everyone's."""
    listed = run("ip", "netns", "list").stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def build(plan: Plan) -> None:
    """Make the lab: namespaces, bridges, links, addresses, shaping, and each host's hosts file."""
    for namespace in plan.namespaces:
        run("ip", "netns", "add", namespace)
        run("ip", "-n", namespace, "link", "set", "lo", "up")
    for namespace in plan.bridges:
        run("ip", "-n", namespace, "link", "add", plan.bridge, "type", "bridge")
        run("ip", "-n", namespace, "link", "set", plan.bridge, "up")
    run("ip", "-n", plan.switch_namespace, "addr", "add", f"{plan.switch_address}/24", "dev", plan.bridge)
    for link in plan.links:
        run("ip", "-n", link.far_namespace, "link", "add", link.far_device, "type", "veth",
            "peer", "name", link.near_device, "netns", link.near_namespace)
        run("ip", "-n", link.far_namespace, "link", "set", link.far_device, "master", plan.bridge, "up")
        set_rate(link, link.rate)
    for host in range(plan.spec.hosts):
        namespace = plan.host_namespace(host)
        run("ip", "-n", namespace, "addr", "add", f"{plan.address(host)}/24", "dev", plan.interface)
        run("ip", "-n", namespace, "link", "set", plan.interface, "up")
        _write_hosts_file(plan, host)
    for node in range(plan.spec.nodes or 0):
        uplink = plan.uplink(node)
        run("ip", "-n", uplink.near_namespace, "link", "set", uplink.near_device, "master", plan.bridge, "up")


def burst_bytes(rate: int) -> int:
    """The bytes a link shaped to ``rate`` bits per second lets through at veth speed after it
    idled (its tbf bucket, above): what a transfer of that size and less reads faster than the rate."""
    return max(_MIN_BURST_BYTES, round(rate / 8 * _BURST_SECONDS))


def set_rate(link: Link, rate: int | None) -> None:
    """Shape both directions of ``link`` to ``rate`` bits per second (``None``: unshaped)."""
    for namespace, device in ((link.near_namespace, link.near_device), (link.far_namespace, link.far_device)):
        if rate is None:
            run("tc", "-n", namespace, "qdisc", "del", "dev", device, "root", check=False)  # none there is fine
        else:
            run("tc", "-n", namespace, "qdisc", "replace", "dev", device, "root", "tbf",
                "rate", f"{rate}bit", "burst", str(burst_bytes(rate)), "latency", _QUEUE_LATENCY)


def set_carrier(link: Link, up: bool) -> None:
    """Pull (``up=False``) or plug back the cable at the bridge's port of ``link``. The host keeps
    its address and routes; what it sends meanwhile is lost, and TCP retransmits it once back."""
    run("ip", "-n", link.far_namespace, "link", "set", link.far_device, "up" if up else "down")


def destroy(plan: Plan) -> list[str]:
    """Remove the lab's namespaces that exist (killing the processes inside them first) and its
    hosts files; return what could not be removed (empty when everything went)."""
    present = existing_namespaces()
    ours = [namespace for namespace in plan.namespaces if namespace in present]
    for namespace in ours:
        _kill_processes_in(namespace)
    left = []
    for namespace in ours:
        if run("ip", "netns", "delete", namespace, check=False).returncode != 0:
            left.append(namespace)
    for host in range(plan.spec.hosts):
        shutil.rmtree(NETNS_ETC / plan.host_namespace(host), ignore_errors=True)
    try:
        NETNS_ETC.rmdir()  # only when no one else's files are left in it
    except OSError:
        pass
    return left


def _kill_processes_in(namespace: str) -> None:
    """SIGKILL every process running in ``namespace`` (all of them started through this lab)."""
    for _ in range(50):
        pids = [int(pid) for pid in run("ip", "netns", "pids", namespace, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def _write_hosts_file(plan: Plan, host: int) -> None:
    """Name every lab address, also in its IPv6-mapped form (how a dual-stack listener such as
    torch's TCPStore sees a peer), and this machine's hostname as this host: reverse lookups
    of peers then succeed, where c10d otherwise warns that it cannot get a client's hostname."""
    folder = NETNS_ETC / plan.host_namespace(host)
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
    for h in range(plan.spec.hosts):
        names = f"{plan.host_namespace(h)} {plan.host_name(h)}" + (f" {os.uname().nodename}" if h == host else "")
        lines += [f"{plan.address(h)} {names}", f"::ffff:{plan.address(h)} {names}"]
    (folder / "hosts").write_text("\n".join(lines) + "\n")
