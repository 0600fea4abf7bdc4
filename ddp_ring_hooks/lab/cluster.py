"""``EmulatedCluster``: a cluster of hosts on one Linux machine, joined by shaped links.

Each host is a network namespace with one link (a veth pair) to a bridge in a switch namespace
of its own; every link is shaped in both directions with a ``tbf`` qdisc. Processes started on
a host see only that host's link, so gloo's TCP traffic between ranks crosses the emulated
network at the emulated rate::

    with EmulatedCluster(hosts=4, link="400Mbit") as lab:
        lab.run([sys.executable, "train.py"])           # one process per host, torchrun's variables set
        lab.torchrun(["train.py", "--steps", "10"])     # one torchrun agent per host, c10d on host 0
        lab.set_rate("100Mbit", host=2)                 # host 2's link slows down, now
        job = lab.start([sys.executable, "train.py"])   # or start, change links, then wait
        lab.disconnect(host=1); ...; lab.reconnect(host=1)
        job.wait(timeout=120)

Safe by construction: names and addresses come from a slot claimed in the registry
(:mod:`.registry`), so labs never collide; everything is removed when the ``with`` block ends,
on an error, on SIGTERM or SIGHUP, at interpreter exit, and later, when the owner died without
a chance to clean up (SIGKILL), by :func:`.housekeeping.remove_stale_labs`. Nothing touches
the root namespace.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import random
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from . import cpu_shares, iproute, registry
from .iproute import LabError, LabUnavailable
from .jobs import HostResult, Job
from .rates import format_rate, parse_rate
from .topology import LabSpec, Link, Plan, lab_spec

#: Exported to every process on a lab: the rate of its slowest link (``bench`` reads it).
LINK_ENVIRONMENT = "DDP_RING_HOOKS_LAB_LINK"

_PROBE = Path(__file__).with_name("tcp_probe.py")
_STORE = Path(__file__).with_name("rendezvous_store.py")
# torchrun's options that the lab sets itself, and torchrun's options that take no value
# (to find where torchrun's options end and the script's begin).
_LAB_SETS = {"--nnodes", "--node-rank", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf",
             "--master-addr", "--master-port", "--local-addr", "--standalone"}
_TORCHRUN_FLAGS = {"-m", "--module", "--no-python", "--run-path"}


class HostUnreachable(LabError):
    """Some hosts do not answer on their link; ``hosts`` names them."""

    def __init__(self, message: str, hosts: list[int]) -> None:
        super().__init__(message)
        self.hosts = hosts


class EmulatedCluster:
    """Hosts as network namespaces, links shaped to a rate; see the module docstring.

    Args:
        hosts: how many hosts (ranks, for ``run``; torchrun agents, for ``torchrun``).
        link: every host's own link, e.g. ``"400Mbit"`` or ``"1Gbit"``; on two tiers, ``None``
            (the default there) leaves the links inside a node unshaped.
        nodes: two tiers: the hosts are grouped into this many nodes, numbered node by node
            (hosts 0..k-1 in node 0, ...) unless ``placement`` says otherwise.
        uplink: two tiers: the rate of each node's one link to the core switch.
        slow: ``{host: rate}``: these hosts' own links at another rate (a bad NIC or cable).
        placement: two tiers: the node of each host, e.g. ``(0, 1, 0, 1)`` to alternate the
            ranks between two nodes.
        cpus: each host's share of this machine's cores (e.g. ``0.25`` for 8 hosts on 2 cores):
            every process started on a host runs capped at it, so a host computes as fast
            whether one or all of them run, as a cluster's hosts would (:mod:`.cpu_shares`).
            ``None`` (the default): the hosts share every core.
    """

    def __init__(
        self,
        *,
        hosts: int,
        link: str | None = None,
        nodes: int | None = None,
        uplink: str | None = None,
        slow: Mapping[int, str] | None = None,
        placement: Sequence[int] | None = None,
        cpus: float | None = None,
    ) -> None:
        self.spec: LabSpec = lab_spec(hosts=hosts, link=link, nodes=nodes, uplink=uplink, slow=slow, placement=placement,
                                      cpus=cpus)
        self._plan: Plan | None = None
        self._disconnected: set[tuple[str, int]] = set()  # ("host", i) / ("node", j), for the error messages

    # -- lifecycle ----------------------------------------------------------------------

    def __enter__(self) -> EmulatedCluster:
        return self.up()

    def __exit__(self, *exc_info) -> None:
        self.down()

    def up(self, *, keep: bool = False) -> EmulatedCluster:
        """Make the lab (also what ``with`` does); ``keep=True``: leave it up after this process
        ends, until :meth:`down` (what ``ddp-ring-hooks lab up`` does). Raises
        :class:`LabUnavailable` without root or iproute2."""
        if self._plan is not None:
            raise LabError(f"lab {self.name} is already up")
        reason = iproute.unavailable_reason()
        if reason:
            raise LabUnavailable(reason)
        record = registry.claim(self.spec)
        self._plan = record.plan
        _LIVE.add(self)
        _catch_termination()
        try:
            iproute.build(self._plan)
            if self.spec.cpus is not None:
                cpu_shares.make(self._plan)
        except BaseException:
            self.down()
            raise
        if keep:
            registry.save(dataclasses.replace(record, owner_pid=None, owner_started=None))
            _LIVE.discard(self)
        return self

    def down(self) -> None:
        """Remove everything the lab made (processes on its hosts are killed); idempotent."""
        if self._plan is None:
            return
        plan, self._plan = self._plan, None
        _LIVE.discard(self)
        left = iproute.destroy(plan)
        if left:
            raise LabError(f"could not remove namespaces {left} of lab {plan.name}; "
                           f"remove them with `ip netns delete NAME` (record kept: {registry.RECORDS}/{plan.name}.json)")
        cpu_shares.remove(plan)
        registry.forget(plan.name)

    @classmethod
    def attach(cls, name: str | None = None) -> EmulatedCluster:
        """The running lab ``name``, or the one lab that ``lab up`` made when ``name`` is ``None``;
        :meth:`down` removes it, leaving it does not."""
        records = registry.records()
        if name is None:
            kept = [record for record in records if record.owner_pid is None]
            if len(kept) != 1:
                made = ", ".join(record.name for record in kept)
                raise LabError("no lab made by `ddp-ring-hooks lab up` is running; start one with "
                               "`ddp-ring-hooks lab up --hosts 2 --link 400Mbit`, or give `lab run` and "
                               "`lab torchrun` --hosts (and --link) for a lab of their own" if not kept else
                               f"several labs made by `lab up` are running ({made}); name one")
            record = kept[0]
        else:
            record = registry.find(name)
            if record is None:
                raise LabError(f"no lab named {name!r} is running (`ddp-ring-hooks lab status` lists them)")
        lab = cls.__new__(cls)
        lab.spec, lab._plan, lab._disconnected = record.plan.spec, record.plan, set()
        return lab

    # -- what the lab is ---------------------------------------------------------------

    @property
    def plan(self) -> Plan:
        """Every name, address and link of the running lab."""
        if self._plan is None:
            raise LabError("the lab is not up: use `with EmulatedCluster(...) as lab:` or call lab.up()")
        return self._plan

    @property
    def name(self) -> str:
        """The lab's prefix (``drh0``), the start of the name of every namespace and device it made."""
        return self.plan.name

    @property
    def hosts(self) -> int:
        return self.spec.hosts

    @property
    def nodes(self) -> int:
        """Nodes of the lab (on a flat lab, every host is a node of its own)."""
        return self.spec.node_count

    @property
    def addresses(self) -> tuple[str, ...]:
        """Each host's address on its link, by host."""
        return tuple(self.plan.address(host) for host in range(self.hosts))

    @property
    def interface(self) -> str:
        """The name of every host's link device (what ``GLOO_SOCKET_IFNAME`` is set to)."""
        return self.plan.interface

    @property
    def link_limit_rate(self) -> int | None:
        """Bits per second of the slowest shaped link as made (``None``: nothing shaped)."""
        return self.plan.bottleneck

    def address(self, host: int) -> str:
        return self.plan.address(self._host(host))

    def namespace(self, host: int) -> str:
        return self.plan.host_namespace(self._host(host))

    def node_of_host(self, host: int) -> int:
        return self.plan.node_of_host(self._host(host))

    def hosts_of(self, node: int) -> tuple[int, ...]:
        return self.plan.hosts_of(node)

    def environment(self, host: int, *, port: int) -> dict[str, str]:
        """What ``run`` sets on ``host``: torchrun's variables for one process per host (a node's
        hosts are its local ranks), rendezvous on host 0, plus :meth:`agent_environment`."""
        node = self.node_of_host(host)
        neighbours = self.hosts_of(node)
        return {
            "RANK": str(host), "WORLD_SIZE": str(self.hosts),
            "LOCAL_RANK": str(neighbours.index(host)), "LOCAL_WORLD_SIZE": str(len(neighbours)),
            "GROUP_RANK": str(node), "MASTER_ADDR": self.address(0), "MASTER_PORT": str(port),
            **self.agent_environment(),
        }

    def agent_environment(self) -> dict[str, str]:
        """Set on every process the lab starts: gloo's interface, the link rate (for ``bench``),
        and one thread per process (every host shares this machine's cores) unless set already."""
        environment = {"GLOO_SOCKET_IFNAME": self.interface, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        if self.link_limit_rate is not None:
            environment[LINK_ENVIRONMENT] = format_rate(self.link_limit_rate)
        return environment

    # -- running ----------------------------------------------------------------------

    def command(self, argv: Sequence[str], *, host: int) -> list[str]:
        """``argv`` as a command line that runs it on ``host`` (``ip netns exec ...``)."""
        return _in_namespace(self.namespace(host), argv)

    def start(
        self, argv: str | Sequence[str], *, host: int | None = None, env: Mapping[str, str] | None = None,
        echo: bool = False, require_reachable: bool = True,
    ) -> Job:
        """Start ``argv`` on every host (or on ``host`` only) with :meth:`environment`, plus
        ``env``; a string runs through ``sh -c``. Returns the :class:`~.jobs.Job` at once.

        ``require_reachable``: first check that every host answers on its link, and raise
        :class:`HostUnreachable` naming those that do not (instead of a job that hangs)."""
        argv = ["sh", "-c", argv] if isinstance(argv, str) else list(argv)
        port = _port()
        hosts = range(self.hosts) if host is None else [self._host(host)]
        return self._start({h: argv for h in hosts}, lambda h: self.environment(h, port=port), env, echo,
                           require_reachable, what=f"lab {self.name}: {' '.join(argv)[:80]}")

    def run(
        self, argv: str | Sequence[str], *, host: int | None = None, env: Mapping[str, str] | None = None,
        echo: bool = False, timeout: float | None = 600.0, check: bool = True,
    ) -> list[HostResult]:
        """:meth:`start`, then wait: one :class:`~.jobs.HostResult` per host that ran, by host.

        ``check``: raise :class:`~.jobs.HostFailed` naming the host that failed (the others are
        stopped a few seconds later); past ``timeout`` seconds, :class:`~.jobs.LabTimeout`."""
        return self.start(argv, host=host, env=env, echo=echo).wait(timeout=timeout, check=check)

    def torchrun_command(self, args: Sequence[str], *, host: int, port: int) -> list[str]:
        """The torchrun agent of ``host``: ``--nnodes=N``, c10d rendezvous on host 0's address
        (served by :mod:`.rendezvous_store`), then ``args`` (torchrun's other options, the script
        and its arguments). c10d ranks the agents in the order of their ``--local-addr``, which
        is the host's zero-padded name, so host ``i`` is node ``i`` (``GROUP_RANK``); torchrun
        ignores ``--node-rank`` with c10d (and warns), so it is not passed."""
        _refuse_lab_options(args)
        return [
            sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.hosts}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={self.address(0)}:{port}", f"--rdzv-id={self.name}-{port}",
            "--rdzv-conf=is_host=0,join_timeout=120", f"--local-addr={self.plan.host_name(host)}", *args,
        ]

    def start_torchrun(
        self, args: Sequence[str], *, env: Mapping[str, str] | None = None, echo: bool = False,
        require_reachable: bool = True,
    ) -> Job:
        """Start one torchrun agent per host (:meth:`torchrun_command`) and the rendezvous store
        on host 0; returns the job at once."""
        port = _port()
        commands = {host: self.torchrun_command(args, host=host, port=port) for host in range(self.hosts)}
        store = [sys.executable, str(_STORE), self.address(0), str(port)]
        return self._start(commands, lambda host: self.agent_environment(), env, echo, require_reachable,
                           what=f"lab {self.name}: torchrun {' '.join(args)[:80]}", helpers={"rendezvous store": store})

    def torchrun(
        self, args: Sequence[str], *, env: Mapping[str, str] | None = None, echo: bool = False,
        timeout: float | None = 600.0, check: bool = True,
    ) -> list[HostResult]:
        """:meth:`start_torchrun`, then wait (as :meth:`run` does); one result per agent."""
        return self.start_torchrun(args, env=env, echo=echo).wait(timeout=timeout, check=check)

    def measure_transfer(self, *, source: int, destination: int, nbytes: int, timeout: float = 120.0) -> float:
        """Seconds to move ``nbytes`` over one TCP connection from ``source`` to ``destination``
        (until the receiver has them all)."""
        port = _port()
        receiver = self._popen([sys.executable, str(_PROBE), "receive", str(port), str(nbytes)], destination, {})
        ready = receiver.stdout.readline().strip() == "ready"  # listening: the sender may connect
        job = Job({destination: receiver}, echo=False, what=f"lab {self.name}: receiver on host {destination}")
        try:
            if not ready:
                job.wait(timeout=10)
                raise LabError(f"the receiver on host {destination} did not start")
            sent = self.run([sys.executable, str(_PROBE), "send", self.address(destination), str(port), str(nbytes)],
                            host=source, timeout=timeout)
            job.wait(timeout=10)
        finally:
            job.kill()
        return float(sent[0].stdout.split()[-1])

    # -- changing links while a job runs ---------------------------------------------------

    def set_rate(self, rate: str | None, *, host: int | None = None, node: int | None = None) -> None:
        """Shape ``host``'s own link (or ``node``'s uplink) to ``rate`` in both directions, now;
        ``None`` removes the shaping."""
        iproute.set_rate(self._link(host, node), None if rate is None else parse_rate(rate))

    def disconnect(self, *, host: int | None = None, node: int | None = None) -> None:
        """Pull the cable of ``host`` (or ``node``'s uplink: every host of the node) at the
        switch: packets are lost until :meth:`reconnect`; sockets stay open and TCP retransmits."""
        iproute.set_carrier(self._link(host, node), up=False)
        self._disconnected.add(("host", host) if host is not None else ("node", node))

    def reconnect(self, *, host: int | None = None, node: int | None = None) -> None:
        """Plug the cable back in (see :meth:`disconnect`)."""
        iproute.set_carrier(self._link(host, node), up=True)
        self._disconnected.discard(("host", host) if host is not None else ("node", node))

    def unreachable_hosts(self) -> list[int]:
        """Hosts that do not answer from the switch within a second (their link or uplink down)."""
        probe = subprocess.run(
            _in_namespace(self.plan.switch_namespace, [sys.executable, str(_PROBE), "reachable", *self.addresses]),
            capture_output=True, text=True, timeout=30,
        )
        if probe.returncode != 0:
            raise LabError(f"the reachability probe failed in {self.plan.switch_namespace}: {probe.stderr.strip()}")
        silent = set(probe.stdout.split())
        return [host for host in range(self.hosts) if self.address(host) in silent]

    def check_reachable(self) -> None:
        """Raise :class:`HostUnreachable` naming every host that does not answer on its link."""
        silent = self.unreachable_hosts()
        if not silent:
            return
        described = []
        for host in silent:
            why = ("its link was disconnected" if ("host", host) in self._disconnected else
                   f"the uplink of node {self.node_of_host(host)} was disconnected"
                   if ("node", self.node_of_host(host)) in self._disconnected else "its link is down or it is not up")
            described.append(f"host {host} ({self.address(host)}, namespace {self.namespace(host)}): {why}")
        raise HostUnreachable(f"lab {self.name}: {len(silent)} host(s) cannot be reached from the switch, so a job "
                              "would wait for them: " + "; ".join(described), silent)

    # -- inside -----------------------------------------------------------------------

    def _start(self, commands, environment_of, env, echo, require_reachable, *, what: str, helpers=None) -> Job:
        """Start ``commands`` (host -> argv), and ``helpers`` (name -> argv, on host 0) first."""
        if require_reachable:
            self.check_reachable()
        processes, started_helpers = {}, {}
        try:
            for name, argv in (helpers or {}).items():
                started_helpers[name] = self._popen(argv, 0, {})
            for host, argv in commands.items():
                processes[host] = self._popen(argv, host, {**environment_of(host), **(env or {})})
        except BaseException:
            Job(processes, echo=False, what=what, helpers=started_helpers).kill()
            raise
        return Job(processes, echo=echo, what=what, helpers=started_helpers)

    def _popen(self, argv: Sequence[str], host: int, env: Mapping[str, str]) -> subprocess.Popen:
        # With CPU shares the child joins its host's cgroup before it runs (cpu_shares: from the
        # root namespace, where the cgroup files are), so its threads and children are counted.
        plan = self.plan
        joining = (lambda: cpu_shares.join(plan, host)) if plan.spec.cpus is not None else None
        return subprocess.Popen(
            self.command(argv, host=host), env={**os.environ, **env}, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=joining,
        )

    def _host(self, host: int) -> int:
        if not isinstance(host, int) or not 0 <= host < self.hosts:
            raise ValueError(f"host {host!r} is not a host of lab {self.name}; hosts are 0 to {self.hosts - 1}")
        return host

    def _link(self, host: int | None, node: int | None) -> Link:
        if (host is None) == (node is None):
            raise ValueError("name exactly one link: host=i (that host's own link) or node=j (that node's uplink)")
        if host is not None:
            return self.plan.host_link(self._host(host))
        if not self.spec.nodes or not 0 <= node < self.spec.nodes:
            raise ValueError(f"node {node!r} has no uplink in lab {self.name} ({self.spec.describe()})")
        return self.plan.uplink(node)


def _in_namespace(namespace: str, argv: Sequence[str]) -> list[str]:
    return ["ip", "netns", "exec", namespace, *argv]


def _refuse_lab_options(args: Sequence[str]) -> None:
    """Refuse torchrun options the lab sets itself, looking only at torchrun's own options
    (those before the script), in either spelling (``--node-rank``, ``--node_rank``)."""
    previous_takes_value = False
    for word in args:
        if not word.startswith("-"):
            if previous_takes_value:
                previous_takes_value = False
                continue
            return  # the script (or module): what follows is its own
        name = word.split("=", 1)[0].replace("_", "-")
        if name in _LAB_SETS:
            raise ValueError(f"lab torchrun sets {name} itself (one agent per emulated host, c10d on host 0); "
                             f"leave {word!r} out")
        previous_takes_value = "=" not in word and name not in _TORCHRUN_FLAGS
        if name in ("-m", "--module"):
            return  # the next word is the module: the script


def _port() -> int:
    """A port for one job's rendezvous: the lab's hosts are fresh namespaces, so the only
    conflicts are with an earlier job's sockets in TIME_WAIT, which a new number avoids."""
    return random.randrange(20000, 40000)


# -- cleanup on termination ------------------------------------------------------------

_LIVE: set[EmulatedCluster] = set()  # labs this process owns and has not removed yet
_TERMINATION_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _remove_live_labs() -> None:
    for lab in list(_LIVE):
        try:
            lab.down()
        except LabError as error:
            print(f"ddp_ring_hooks.lab: {error}", file=sys.stderr)


def _on_termination(signum, frame) -> None:
    """Remove this process's labs, then die of the signal as the process would have."""
    _remove_live_labs()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _catch_termination() -> None:
    """SIGTERM and SIGHUP end a process without running ``finally`` blocks or ``atexit``: catch
    them (where nobody else has) so the labs go first. SIGINT already raises KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in _TERMINATION_SIGNALS:
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, _on_termination)


atexit.register(_remove_live_labs)
