"""What a lab is made of, worked out before anything is made: names, addresses, links, rates.

Flat (``nodes=None``): every host is a machine of its own, with one link to the switch, shaped
in both directions (the host's end shapes what it sends, the switch's port what it receives)::

    [drh0-h0] drh0-eth ══tbf══ drh0-h0 ┐
    [drh0-h1] drh0-eth ══tbf══ drh0-h1 ┼ drh0-br   in [drh0-sw]
    [drh0-h2] drh0-eth ══tbf══ drh0-h2 ┘

Two tiers (``nodes=2``): the hosts of a node meet on the node's own bridge, unshaped (like GPUs
in one box), and each node reaches the core switch over one shaped uplink::

    [drh0-h0] ──┐
    [drh0-h1] ──┴ drh0-br in [drh0-n0]  drh0-up ══tbf══ drh0-n0 ┐
    [drh0-h2] ──┐                                               ┼ drh0-br in [drh0-sw]
    [drh0-h3] ──┴ drh0-br in [drh0-n1]  drh0-up ══tbf══ drh0-n1 ┘

Every name starts with the lab's prefix (``drh`` and its slot number) and every address lies in
the lab's own subnet ``10.(100 + slot).0.0/24``: host ``i`` is ``.i+1``, the switch (which
only answers the reachability probe) ``.254``. Nothing here runs a command; :mod:`.iproute`
makes what this describes.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .rates import format_rate, parse_rate

NAME_PREFIX = "drh"
MAX_LABS = 100  # slots 0..99: subnets 10.100.0.0/24 .. 10.199.0.0/24
MAX_HOSTS = 250  # host addresses .1 .. .250 of the /24
_SUBNET_BASE = 100


@dataclass(frozen=True, slots=True)
class LabSpec:
    """What the user asked for, checked; rates in bits per second (``None``: unshaped)."""

    hosts: int
    link: int | None = None  # every host's own link
    nodes: int | None = None  # None: flat, every host a node of its own
    uplink: int | None = None  # each node's link to the core switch (two tiers only)
    slow: tuple[tuple[int, int], ...] = ()  # (host, rate): that host's link instead of ``link``
    placement: tuple[int, ...] = ()  # the node of each host (two tiers only)
    cpus: float | None = None  # each host's share of this machine's cores (None: every host shares all of them)

    @property
    def node_count(self) -> int:
        """Nodes of the lab; on a flat lab every host is a node of its own."""
        return self.nodes or self.hosts

    def host_rate(self, host: int) -> int | None:
        """The rate of ``host``'s own link (its slow rate if it has one)."""
        return dict(self.slow).get(host, self.link)

    def as_dict(self) -> dict:
        """Plain JSON data (rates as text), read back by :func:`spec_from_dict`."""
        return {
            "hosts": self.hosts,
            "link": _text(self.link),
            "nodes": self.nodes,
            "uplink": _text(self.uplink),
            "slow": {str(host): format_rate(rate) for host, rate in self.slow},
            "placement": list(self.placement) if self.nodes else None,
            "cpus": self.cpus,
        }

    def describe(self) -> str:
        """One line: ``4 hosts, 400Mbit links`` / ``4 hosts in 2 nodes, 400Mbit uplinks, host 2 at 100Mbit``."""
        parts = [f"{self.hosts} host{'s' * (self.hosts != 1)}"]
        if self.nodes:
            parts[0] += f" in {self.nodes} node{'s' * (self.nodes != 1)} (hosts of node: {_groups(self.placement)})"
        parts.append(f"{_text(self.link) or 'unshaped'} host links")
        if self.nodes:
            parts.append(f"{_text(self.uplink)} uplinks")
        parts += [f"host {host} at {format_rate(rate)}" for host, rate in self.slow]
        if self.cpus is not None:
            parts.append(f"{self.cpus:g} cores per host")
        return ", ".join(parts)


def lab_spec(
    *,
    hosts: int,
    link: str | None = None,
    nodes: int | None = None,
    uplink: str | None = None,
    slow: Mapping[int, str] | None = None,
    placement: Sequence[int] | None = None,
    cpus: float | None = None,
) -> LabSpec:
    """Check the user's choices and parse the rates; every refusal names the fix."""
    if not isinstance(hosts, int) or not 1 <= hosts <= MAX_HOSTS:
        raise ValueError(f"hosts must be a whole number from 1 to {MAX_HOSTS}, got {hosts!r}")
    return dataclasses.replace(_network_spec(hosts, link, nodes, uplink, slow, placement), cpus=_cpus(cpus, hosts))


#: The least CPU share a host can get: the kernel's least CFS quota (1 ms) in a 10 ms period
#: (a longer period would leave a throttled host waiting longer; ``cpu_shares.period_us``).
MIN_CPUS = 0.1


def _cpus(cpus: float | None, hosts: int) -> float | None:
    """Each host's CPU share, checked: at least MIN_CPUS, and no more than the machine has
    (beyond that the quota would promise cores that are not there)."""
    if cpus is None:
        return None
    cores = os.cpu_count() or 1
    if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or not MIN_CPUS <= cpus <= cores:
        raise ValueError(f"cpus (each host's share of the cores) must be a number from {MIN_CPUS} to this machine's "
                         f"{cores} cores, got {cpus!r}; e.g. cpus={cores / hosts:g} gives each of the {hosts} hosts an equal share")
    if hosts * cpus > cores + 1e-9:
        warnings.warn(f"{hosts} hosts of {cpus:g} cores each ask for {hosts * cpus:g} cores and this machine has {cores}: "
                      f"hosts that compute at once will still slow each other; cpus={cores / hosts:g} gives each a share "
                      "of its own", stacklevel=3)
    return float(cpus)


def _network_spec(hosts, link, nodes, uplink, slow, placement) -> LabSpec:
    """The links of :func:`lab_spec`, checked."""
    slow = dict(slow or {})
    for host in slow:
        if not isinstance(host, int) or not 0 <= host < hosts:
            raise ValueError(f"slow host {host!r} is not a host of this lab; hosts are numbered 0 to {hosts - 1}")
    if nodes is None:
        if uplink is not None or placement is not None:
            raise ValueError("uplink and placement describe a two-tier lab; give nodes=M (--nodes M) as well")
        if link is None and not slow:
            raise ValueError("a flat lab needs link=RATE (--link RATE), e.g. 400Mbit: without it nothing is shaped")
        return LabSpec(hosts=hosts, link=_rate(link), slow=_slow(slow))
    if not isinstance(nodes, int) or not 1 <= nodes <= hosts:
        raise ValueError(f"nodes must be a whole number from 1 to hosts ({hosts}), got {nodes!r}")
    if uplink is None:
        raise ValueError(f"nodes={nodes} needs uplink=RATE (--uplink RATE), e.g. 400Mbit: the link from each node to the core switch")
    if placement is None:
        if hosts % nodes:
            raise ValueError(f"{hosts} hosts do not split evenly into {nodes} nodes; give placement=(node of host 0, "
                             "node of host 1, ...) (--placement 0,0,1,...) to place them yourself")
        placement = [host // (hosts // nodes) for host in range(hosts)]  # numbered node by node
    placement = tuple(placement)
    if len(placement) != hosts or not all(isinstance(n, int) and 0 <= n < nodes for n in placement):
        raise ValueError(f"placement must give a node from 0 to {nodes - 1} for each of the {hosts} hosts, got {placement!r}")
    empty = sorted(set(range(nodes)) - set(placement))
    if empty:
        raise ValueError(f"placement {placement!r} leaves node(s) {empty} without a host")
    return LabSpec(hosts=hosts, link=_rate(link), nodes=nodes, uplink=_rate(uplink), slow=_slow(slow), placement=placement)


def spec_from_dict(data: Mapping) -> LabSpec:
    """The inverse of :meth:`LabSpec.as_dict`."""
    return lab_spec(
        hosts=data["hosts"], link=data["link"], nodes=data["nodes"], uplink=data["uplink"],
        slow={int(host): rate for host, rate in data["slow"].items()}, placement=data["placement"],
        cpus=data.get("cpus"),  # absent from the records of labs made before CPU shares
    )


@dataclass(frozen=True, slots=True)
class Link:
    """One veth pair: the near end in a host (or a node), the far end a port of a bridge."""

    near_namespace: str
    near_device: str
    far_namespace: str
    far_device: str
    rate: int | None  # bits per second, each direction; None: unshaped


@dataclass(frozen=True, slots=True)
class Plan:
    """Every name, address and link of one lab, from its spec and its slot."""

    slot: int
    spec: LabSpec

    @property
    def name(self) -> str:
        """The lab's prefix, e.g. ``drh3``: the start of every namespace and device it makes."""
        return f"{NAME_PREFIX}{self.slot}"

    @property
    def subnet(self) -> str:
        return f"10.{_SUBNET_BASE + self.slot}.0.0/24"

    @property
    def interface(self) -> str:
        """The device name of every host's link, inside its namespace (``GLOO_SOCKET_IFNAME``)."""
        return f"{self.name}-eth"

    @property
    def bridge(self) -> str:
        return f"{self.name}-br"

    @property
    def switch_namespace(self) -> str:
        return f"{self.name}-sw"

    @property
    def switch_address(self) -> str:
        """The switch's own address on its bridge, from which every host is probed."""
        return self._address(254)

    def host_namespace(self, host: int) -> str:
        return f"{self.name}-h{host}"

    def node_namespace(self, node: int) -> str:
        return f"{self.name}-n{node}"

    def address(self, host: int) -> str:
        return self._address(host + 1)

    def host_name(self, host: int) -> str:
        """``host``'s name in every host's ``/etc/hosts`` (``drh0-host007``): zero-padded, so
        that names sort in host order (torchrun's c10d rendezvous ranks its agents that way)."""
        return f"{self.name}-host{host:03d}"

    def node_of_host(self, host: int) -> int:
        """The node that holds ``host`` (on a flat lab, each host is its own node)."""
        return self.spec.placement[host] if self.spec.nodes else host

    def hosts_of(self, node: int) -> tuple[int, ...]:
        return tuple(host for host in range(self.spec.hosts) if self.node_of_host(host) == node)

    @property
    def namespaces(self) -> tuple[str, ...]:
        """Every namespace of the lab, hosts first (the order to remove them in)."""
        nodes = [self.node_namespace(n) for n in range(self.spec.nodes or 0)]
        return (*(self.host_namespace(h) for h in range(self.spec.hosts)), *nodes, self.switch_namespace)

    @property
    def bridges(self) -> tuple[str, ...]:
        """The namespaces that hold a bridge (named :attr:`bridge`): the switch, and each node."""
        return (self.switch_namespace, *(self.node_namespace(n) for n in range(self.spec.nodes or 0)))

    def host_link(self, host: int) -> Link:
        """``host``'s link: to the switch on a flat lab, to its node's bridge on two tiers."""
        far = self.node_namespace(self.node_of_host(host)) if self.spec.nodes else self.switch_namespace
        return Link(self.host_namespace(host), self.interface, far, f"{self.name}-h{host}", self.spec.host_rate(host))

    def uplink(self, node: int) -> Link:
        """``node``'s uplink to the core switch (two tiers only)."""
        if not self.spec.nodes:
            raise ValueError("a flat lab has no uplinks; a host's own link is host_link(host)")
        return Link(self.node_namespace(node), f"{self.name}-up", self.switch_namespace, f"{self.name}-n{node}", self.spec.uplink)

    @property
    def links(self) -> tuple[Link, ...]:
        return (*(self.host_link(h) for h in range(self.spec.hosts)), *(self.uplink(n) for n in range(self.spec.nodes or 0)))

    @property
    def bottleneck(self) -> int | None:
        """The slowest shaped rate on the way between hosts: what bounds a ring all-reduce."""
        rates = [link.rate for link in self.links if link.rate is not None]
        return min(rates) if rates else None

    def _address(self, last: int) -> str:
        return f"10.{_SUBNET_BASE + self.slot}.0.{last}"


def _rate(text: str | None) -> int | None:
    return None if text is None else parse_rate(text)


def _slow(slow: Mapping[int, str]) -> tuple[tuple[int, int], ...]:
    return tuple(sorted((host, parse_rate(rate)) for host, rate in slow.items()))


def _text(rate: int | None) -> str | None:
    return None if rate is None else format_rate(rate)


def _groups(placement: Sequence[int]) -> str:
    nodes = sorted(set(placement))
    return " | ".join(",".join(str(h) for h, n in enumerate(placement) if n == node) for node in nodes)
