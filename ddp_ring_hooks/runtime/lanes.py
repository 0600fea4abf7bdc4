"""Lanes and point-to-point tags: every stream of jobs a group runs, and the tag its messages carry.

gloo matches a point-to-point message by (peer, tag), first in first out. Two threads that post
to the same peer with the same tag could take each other's messages, so every thread that
talks point-to-point on a group has a tag of its own, and the tags are handed out here, in one
table, not by whoever needs one::

    tag                 who posts with it                             lane (its worker thread)
    0 .. MAX_LANES-1    bucket lane i of the hook (CPU)               bucket_lane(i): ddp-ring-hooks-comm-{i}
    0                   a CUDA bucket lane (NCCL has no tags)         cuda_lane(d): ddp-ring-hooks-cuda-{d}
    EXCHANGE_TAG        the watchers' exchange after a step           EXCHANGE: ddp-ring-hooks-exchange
    ABORT_PROBE_TAG     the abort's probe (a receive nobody answers)  no lane: the stall watchdog's thread

A :class:`Lane` is one value: the key of its worker in the group's context
(:class:`~ddp_ring_hooks.runtime.group_context.GroupContext`), the thread's name and the tag.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Bucket lanes a hook state may use (``concurrent_buckets``); their tags are 0 .. MAX_LANES - 1.
MAX_LANES = 1 << 16
#: The watchers' exchange after a step (``telemetry/exchange.py``), above every bucket lane.
EXCHANGE_TAG = MAX_LANES
#: The abort's probe (``runtime/abort.py``); gloo picks a context by tag modulo their number, so
#: the probe of context ``c`` uses ``ABORT_PROBE_TAG - ABORT_PROBE_TAG % n + c`` (all far above the others).
ABORT_PROBE_TAG = 0x7FFF0000


@dataclass(frozen=True)
class Lane:
    """A stream of jobs run in order on one worker thread of a group, its messages tagged ``tag``.

    ``device``: the CUDA device index of a CUDA lane (its thread keeps that device's side
    stream current), ``None`` on the host."""

    name: str
    tag: int
    device: int | None = None

    @property
    def thread_name(self) -> str:
        return f"ddp-ring-hooks-{self.name}"


def bucket_lane(index: int) -> Lane:
    """Lane ``index`` of a hook's CPU buckets (bucket ``i`` goes to lane ``i % concurrent_buckets``)."""
    if not 0 <= index < MAX_LANES:
        raise ValueError(f"a bucket lane is 0 .. {MAX_LANES - 1}, got {index}")
    return Lane(f"comm-{index}", tag=index)


def cuda_lane(device_index: int) -> Lane:
    """The lane of a hook group's CUDA buckets on GPU ``device_index`` (one per group and device)."""
    return Lane(f"cuda-{device_index}", tag=0, device=device_index)


#: The watchers' exchange after a step: one lane per group.
EXCHANGE = Lane("exchange", tag=EXCHANGE_TAG)
