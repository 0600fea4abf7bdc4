"""The advisor's probe: the network as the hook sees it, measured once when the hook is registered.

The advisor predicts other settings from one run; a run whose buckets are all large leaves
the per-message latency α undetermined, and every extra bucket and every step of a larger
world is priced with it. So, as ``auto`` calibrates, every rank takes part in a short probe
when :func:`~ddp_ring_hooks.register` attaches the hook (collective, the same on every rank)::

    for each size in PROBE_SIZES, on the run's own algorithm and wire:     (α, β: the timeline
        one warm-up, then PROBE_REPEATS blocks of PROBE_CALLS all-reduces,   records the block
        more while they took under PROBE_BUDGET_S (at most PROBE_MOST)       times, the advisor
        (a barrier before each block; a block counts for its slowest rank)    fits each size's
    the other wire (bf16 for an fp32 run, fp32 for a narrower one), as many  lower quartile, and
    bytes on the wire as WIRE_SIZES on its own: what the casts cost (γ)      its fastest and
    MESSAGES_PROBE at the small size: more messages in one call (per call)   median are its
                                                                             error bar)

1. The calls go through the executors the hook uses (:func:`~.selection.time_all_reduce_blocks`,
   ``auto``'s own timing), so the probe's α holds the executor's per-step overheads.
2. A block's time is the slowest rank's (all-reduced with MAX), so every rank holds the same
   numbers: nothing to broadcast.
3. Sizes: a small one (the per-message cost) and two large ones, 1 and 2 MiB: their
   difference is the link's rate for large buckets alone (``step_model.link_scale``), without
   the waits of a busy or throttled core that a long transfer hides and the small size's α
   holds (on the lab's hosts of a fifth of a core a 16 KiB block took 10-30 ms beside a 2 MiB
   block of 43 ms: fitted with it, the 50 MB/s links read 67 MB/s), and without a shaper's
   burst (5 ms of the rate on the lab), which both pass alike. The other wire at
   the same bytes on the wire as the own wire's 2 MiB (bf16 at 4 MiB beside fp32's 2 MiB):
   what depends on the wire's bytes (a shaper's burst, TCP's window) is then the same in both,
   and their difference is the casts. At the same buffer size instead, the lab's burst passed
   a quarter of bf16's 1 MiB on the wire free against an eighth of fp32's 2 MiB, which hid the
   casts (γ fitted 0 in every lab run) that bf16's buckets then paid in training: its row read
   4-10% fast (``docs/advisor.md``, the tenth series). Blocks of one call each, after one
   warm-up call per size: three, then more while the size's blocks took under 30 ms in all,
   up to 15. On 2-core loopback a block now
   and then waits out another thread's time slice (2-7 ms where its neighbours took 0.3-0.6),
   and with three blocks two such made the median: a 16 KiB median of 6.9 ms, slower than
   2 MiB's, fitted β = 0 (bandwidth unbounded) in three of six runs, and every row's bytes free
   (``docs/advisor.md``, the eighth series). A quick size gets up to 15 blocks, and the fit
   takes each size's lower quartile (:class:`~ddp_ring_hooks.cost_model.ProbeFit`), which
   holds until three in four of them are disturbed; a 2 MiB block on the lab's 400 Mbit/s
   takes 42 ms, so there it keeps three, and the probe its time.
4. A second message count at the small size (:data:`MESSAGES_PROBE`: the double binary tree
   cut into 8 segments, 16 messages at p = 2 against the ring's 2): a call's own hand-offs
   (the executor giving it to its worker and taking it back) cost once per call, its messages
   each; with one count they cannot be told apart, and a schedule of many messages in one call
   was priced as many calls (on loopback, 2 ranks: a 16 KiB call of 2 messages 0.8 ms, of 16
   3.6 ms, of 64 12.2 ms: 0.44 ms per call and 0.18 ms per message, where one count read
   0.40 ms per message). Not timed for ``native`` (the group's own call, not the executor's).
   20 all-reduces at least (16 for ``native``).

What it costs is measured in ``docs/advisor.md`` (p = 2 and 4, loopback and the lab): the
2 MiB blocks decide it. ``network_probe=False`` (a ``register`` / ``HookState`` option) turns it
off; the advisor then fits the run's own buckets and says so. Not run for ``auto`` (its own
probe calibrated every candidate: the advisor reads that), on one rank, or off the CPU (the
advisor reads CPU runs only).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import torch
import torch.distributed as dist

from ..cost_model import ProbeSample
from ..schedules import WIRE_BYTES, is_narrow, wire_of, with_wire
from ..schedules.double_binary_tree import MANY_MESSAGES
from ..schedules.wire import AS_IS
from .collectives import all_gather_ints, device_of
from .names import has_schedule
from .selection import time_all_reduce_blocks

#: Bytes per rank of the probe's all-reduces: latency-bound, and two bandwidth-bound sizes whose
#: difference is the link's rate alone (point 3 of the module docstring).
PROBE_SIZES = (16 * 1024, 1024 * 1024, 2 * 1024 * 1024)
#: The other wire dtype is timed at as many bytes on the wire as these on the run's own (γ: what
#: the casts cost, on top of the bytes; :func:`other_wire_size`).
WIRE_SIZES = (2 * 1024 * 1024,)
#: Blocks per size, at least, and calls per block (the fit takes each size's lower quartile;
#: its fastest and its median are the error bar).
PROBE_REPEATS, PROBE_CALLS = 3, 1
#: More blocks of a size while its blocks took less than this in all, up to PROBE_MOST (point 3).
PROBE_BUDGET_S, PROBE_MOST = 0.03, 15
#: The wire dtype timed beside an fp32 run's (and fp32 beside a narrower run's).
OTHER_WIRE = "bf16"
#: The schedule timed at the small size for a second message count (point 4 of the module docstring).
MESSAGES_PROBE = MANY_MESSAGES
_BLOCKS = {"calls": PROBE_CALLS, "budget_s": PROBE_BUDGET_S, "most": PROBE_MOST}


def probe_network(
    group: dist.ProcessGroup | None, *, algorithm: str, options: Mapping[str, object],
    device: torch.device | str | None = None, wanted: bool = True,
) -> tuple[ProbeSample, ...]:
    """Time ``algorithm`` (with its resolved ``options``) at :data:`PROBE_SIZES` on its own
    wire and at :data:`WIRE_SIZES` on the other (see the module docstring). Collective: every
    rank of ``group`` calls it and gets the same samples; ``()`` on every rank when the ranks'
    arguments differ (checked first, with one all-gather of a fingerprint), or when no rank
    ``wanted`` it (the same all-gather: ranks that differ on it, e.g. a ``log_dir`` on rank 0
    only, still agree, and probe if any rank asked)."""
    device = device_of(group, device)
    # Ranks given different options (a wire dtype on one rank only) would send messages of
    # different sizes, which gloo cannot survive: they are not probed, and the layout check at
    # the first step names the difference (as it would without a probe).
    fingerprint = zlib.crc32(repr((algorithm, sorted((k, repr(v)) for k, v in options.items()))).encode())
    rows = all_gather_ints([fingerprint, int(wanted)], group, device=device)
    if not any(row[1] for row in rows) or len({row[0] for row in rows}) > 1:
        return ()
    own, other = wire_of(options), AS_IS if is_narrow(options) else OTHER_WIRE
    samples = []
    for wire, sizes in ((own, PROBE_SIZES), (other, [other_wire_size(n, own=own, other=other) for n in WIRE_SIZES])):
        wired = with_wire(options, wire)
        for nbytes in sizes:
            seconds = time_all_reduce_blocks(algorithm, wired, nbytes, group, device, PROBE_REPEATS, **_BLOCKS)
            samples.append(ProbeSample(nbytes, wire, tuple(seconds)))
    if has_schedule(algorithm):
        counted, counted_options = MESSAGES_PROBE
        wired = with_wire(dict(counted_options), wire_of(options))
        seconds = time_all_reduce_blocks(counted, wired, PROBE_SIZES[0], group, device, PROBE_REPEATS, **_BLOCKS)
        samples.append(ProbeSample(PROBE_SIZES[0], wire_of(options), tuple(seconds), counted, counted_options))
    return tuple(samples)


def other_wire_size(nbytes: int, *, own: str, other: str) -> int:
    """The buffer the ``other`` wire dtype is timed at beside ``nbytes`` on the ``own`` one: as
    many bytes on the wire (point 3 of the module docstring)::

        >>> other_wire_size(2 << 20, own="fp32", other="bf16") >> 20   # MiB
        4
        >>> other_wire_size(2 << 20, own="bf16", other="fp32") >> 20
        1
    """
    return nbytes * WIRE_BYTES[own] // WIRE_BYTES[other]
