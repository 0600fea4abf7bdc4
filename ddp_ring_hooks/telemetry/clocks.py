"""One time axis for every rank: which clocks are shared, and ping-pong across hosts.

Telemetry stamps events with ``time.perf_counter()``, which on Linux reads
``CLOCK_MONOTONIC``: one clock per booted kernel, so every rank on a host (every container
too, without a time namespace) reads the same clock and their times compare exactly. Across
hosts the clocks differ by an unknown offset, estimated here the way NTP does it::

    rank 0 (reference)                 leader of another host
      t0 = now --------- ping --------->  t1 = now
                                          t2 = now
      t3 = now <-------- pong ----------  (t1, t2)

    offset = ((t1 - t0) + (t2 - t3)) / 2      (leader's clock minus rank 0's)
    error  = ((t3 - t0) - (t2 - t1)) / 2      (half the round trip: the offset is exact
                                               when both directions took equally long)

Of :data:`PING_ROUNDS` round trips the one with the shortest round trip wins (the least
queueing). Every rank of a host takes its leader's offset. All of it is point-to-point
messages with a tag of their own, so it can run on a worker thread while DDP's collectives
and the buckets' messages go on (gloo pairs messages by peer and tag, in order).
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..runtime import context_of, run_schedule
from ..schedules import checked_schedule

#: Round trips per host pair; the shortest one gives the estimate.
PING_ROUNDS = 8
#: Names the clock a process reads, instead of the boot id (see :func:`host_id`).
CLOCK_DOMAIN_VARIABLE = "DDP_RING_HOOKS_CLOCK_DOMAIN"


@dataclass(frozen=True)
class ClockOffsets:
    """Each rank's clock minus rank 0's, in ms, and how far that may be off.

    ``error_ms[r]`` is 0 for ranks on rank 0's host (the same clock) and half the best
    round trip for the others. ``hosts[r]`` numbers the host of rank ``r`` (0 = rank 0's).
    """

    offsets_ms: tuple[float, ...]
    error_ms: tuple[float, ...]
    hosts: tuple[int, ...]

    @property
    def max_error_ms(self) -> float:
        return max(self.error_ms, default=0.0)


def host_id() -> int:
    """A number naming this machine's monotonic clock: the kernel's boot id (shared by every
    process and container of one boot) or, where there is none, the host name. 52 bits, so
    it travels exactly in a float64.

    ``DDP_RING_HOOKS_CLOCK_DOMAIN`` overrides it: processes in Linux time namespaces share a
    boot id but not ``CLOCK_MONOTONIC``; give each namespace its own value (or each rank, to
    have every clock measured)."""
    name = os.environ.get(CLOCK_DOMAIN_VARIABLE)
    if not name:
        try:
            with open("/proc/sys/kernel/random/boot_id") as file:
                name = file.read().strip()
        except OSError:
            name = socket.gethostname()
    return int.from_bytes(hashlib.sha1(name.encode()).digest()[:7], "big") >> 4


def all_gather_rows(row: Sequence[float], group: dist.ProcessGroup, *, tag: int) -> list[list[float]]:
    """Every rank's ``row`` of floats (the same length on every rank), by group rank.

    Point-to-point only (a ring all-reduce of a table in which each rank fills its own row:
    adding zeros is exact), never a collective: it may run on a worker thread while the
    training thread starts a collective of its own, and gloo pairs collectives in the order
    each process calls them. Every rank must call it, in the same order, with the same tag.
    """
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    table = torch.zeros(world_size, len(row), dtype=torch.float64)
    table[rank] = torch.tensor(list(row), dtype=torch.float64)
    if world_size > 1:
        # On what the group's context has made (never making anything: this runs on a worker
        # thread, beside the hook's lanes); the rows are small.
        run_schedule(checked_schedule("ring", world_size), table.view(-1), group=group, tag=tag,
                     context=context_of(group))
    return table.tolist()


def estimate_clock_offsets(
    group: dist.ProcessGroup,
    *,
    tag: int,
    hosts: Sequence[int] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    rounds: int = PING_ROUNDS,
) -> ClockOffsets:
    """Every rank's clock offset to rank 0 of ``group`` (see the module docstring). Every rank
    must call it together, with the same ``tag``.

    ``hosts`` (one number per group rank; ranks with equal numbers share a clock) defaults to
    :func:`host_id` gathered from every rank. ``clock`` returns seconds (tests skew it).
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if hosts is None:
        hosts = [int(row[0]) for row in all_gather_rows([float(host_id())], group, tag=tag)]
    numbered = {host: index for index, host in enumerate(dict.fromkeys([hosts[0], *hosts]))}
    host_of = [numbered[host] for host in hosts]
    leaders = {host: hosts.index(host) for host in dict.fromkeys(hosts) if host != hosts[0]}
    estimates: dict[int, tuple[float, float]] = {hosts[0]: (0.0, 0.0)}
    stamp = torch.zeros(2, dtype=torch.float64)
    for host, leader in leaders.items():
        if rank == 0:
            estimates[host] = _ping(group, leader, tag, clock, rounds, stamp)
        elif rank == leader:
            _pong(group, tag, clock, rounds, stamp)
    table = [0.0] * (2 * world_size)
    if rank == 0:  # only rank 0 knows the answers; the gather hands them to everyone
        for member, host in enumerate(hosts):
            table[2 * member], table[2 * member + 1] = estimates[host]
    gathered = all_gather_rows(table, group, tag=tag)
    summed = [sum(column) for column in zip(*gathered)]
    return ClockOffsets(
        offsets_ms=tuple(summed[0::2]), error_ms=tuple(summed[1::2]), hosts=tuple(host_of),
    )


def _ping(group, peer: int, tag: int, clock, rounds: int, stamp: torch.Tensor) -> tuple[float, float]:
    best: tuple[float, float] | None = None
    for _ in range(rounds):
        t0 = clock()
        group.send([stamp], peer, tag).wait()
        group.recv([stamp], peer, tag).wait()
        t3 = clock()
        t1, t2 = stamp.tolist()
        offset, error = ((t1 - t0) + (t2 - t3)) / 2, ((t3 - t0) - (t2 - t1)) / 2
        if best is None or error < best[1]:
            best = (offset * 1e3, max(error, 0.0) * 1e3)
    assert best is not None
    return best


def _pong(group, tag: int, clock, rounds: int, stamp: torch.Tensor) -> None:
    for _ in range(rounds):
        group.recv([stamp], 0, tag).wait()
        t1 = clock()
        stamp[0] = t1
        stamp[1] = clock()
        group.send([stamp], 0, tag).wait()


def gather_bytes_to_rank0(payload: bytes, group: dist.ProcessGroup, *, tag: int) -> list[bytes] | None:
    """Rank 0 gets every rank's ``payload`` (by group rank); the others get None.
    Point-to-point, like :func:`all_gather_rows`; every rank must call it with the same tag."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if rank != 0:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.zeros(0, dtype=torch.uint8)
        group.send([torch.tensor([len(payload)], dtype=torch.int64)], 0, tag).wait()
        if payload:
            group.send([data], 0, tag).wait()
        return None
    payloads = [payload]
    for peer in range(1, world_size):
        length = torch.zeros(1, dtype=torch.int64)
        group.recv([length], peer, tag).wait()
        data = torch.empty(int(length.item()), dtype=torch.uint8)
        if data.numel():
            group.recv([data], peer, tag).wait()
        payloads.append(data.numpy().tobytes())
    return payloads
