"""Do all ranks hand the hook the same buckets? A cheap cross-rank check for the first steps.

The ring sends chunk ``c`` of a bucket to its neighbour, which expects chunk ``c`` of the same
bucket. If the ranks built different buckets (a parameter of another size on one rank, a
different ``bucket_cap_mb``, parameters created only on some ranks), a ring would deadlock or,
worse, add unrelated gradients together and train on garbage.

The same goes for *how* the bucket is reduced: ranks that build different schedules
(``hierarchical`` with a different ``local_size``, or ``LOCAL_WORLD_SIZE`` that differs between
nodes; a ring with a different ``ring_order`` or ``node_of``) send chunks their peers do not expect, and ranks that put the bucket on different
worker lanes (a different ``concurrent_buckets``, or ``observers`` on some ranks only) tag
their messages differently, so the peers wait forever; ranks that send different wire dtypes
(``wire_dtype``) send messages of a size their peers do not expect, and gloo aborts.

The same goes for the *kind* of bucket: a sparse bucket gathered on one rank and densified
through a schedule on another (a different ``sparse=``), or a user's own hook on some ranks
only (``hook=``) or a different one, would wait for messages that never come.

So, for the first few iterations, each rank describes the bucket it is about to reduce and
the schedule it will run in nine integers, and the ranks all-gather these rows before any
gradient moves::

             bucket  elements  dtype    last  algorithm  schedule    lanes  wire      kind
    rank 0:  [    0,   50410,  float32,  0,   ring,      0x5c1d...,  2,     bfloat16, dense ]
    rank 1:  [    0,   50610,  float32,  1,   ring,      0x5c1d...,  2,     bfloat16, dense ]   <- they disagree: raise

(A sparse bucket's elements are its size as a dense tensor: the same on every rank, whatever
rows each touched. A user's hook has no schedule: its name's checksum stands in the schedule's
place.)

Every rank sees the same table, so every rank raises the same error at the same bucket: no
rank is left waiting for a partner, and the process group stays usable. "last" catches ranks
with different numbers of buckets at the first bucket where they differ.

Cost: one all-gather of ``9 * world_size`` integers per bucket, on the hook's thread before the
bucket is queued (so it stays in the same order as DDP's own collectives on every rank). On
CUDA it runs on a gloo control group with the same ranks
(the group context's :meth:`~ddp_ring_hooks.runtime.group_context.GroupContext.control_group`): host messages only, no CUDA tensor
to copy back, so no host sync with the GPU. :class:`~ddp_ring_hooks.HookState` runs it
for its first ``check_layout_steps`` iterations only (default 2: DDP's first iteration uses
one big bucket, the second the rebuilt ones), then never again.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..runtime.collectives import all_gather_ints
from ..runtime.names import NATIVE, runnable_algorithms
from ..runtime.wire import DENSE, DENSIFIED, FOREIGN, SPARSE
from ..schedules import Schedule, get_algorithm

#: dtype <-> small integer code for the all-gathered row (same table on every rank).
_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)

#: Kinds of bucket <-> small integer codes (``runtime/wire.py``).
_KINDS = (DENSE, SPARSE, DENSIFIED, FOREIGN)

#: The fields of a row, as they are named in error messages.
_FIELDS = ("bucket index", "number of elements", "dtype", "last bucket", "algorithm", "schedule", "worker lanes",
           "dtype on the wire", "kind of bucket")
_NUMEL, _DTYPE, _LAST, _ALGORITHM, _SCHEDULE, _LANES, _WIRE, _KIND = range(1, 9)


class BucketLayoutMismatchError(RuntimeError):
    """The ranks reduce buckets that differ (index, size, dtype or count), or would reduce
    them differently (algorithm, schedule, worker lanes).

    Attributes:
        rows: every rank's row (see :meth:`BucketLayout.as_row`), by group rank.
    """

    def __init__(self, message: str, rows: list[list[int]] | None = None) -> None:
        super().__init__(message)
        self.rows = rows or []


@dataclass(frozen=True)
class BucketLayout:
    """What a rank says about the bucket it is about to reduce, and how it will reduce it."""

    index: int
    numel: int
    dtype: torch.dtype
    is_last: bool
    schedule: Schedule | None  # None: "native" (the group's own all-reduce, no schedule)
    lanes: int  # worker lanes the buckets are spread over (1 on CUDA and for native: no lanes)
    wire: torch.dtype | None = None  # what its transfers carry (None: its own dtype)
    kind: str = DENSE  # the executor's kind (runtime/wire.py)
    label: str = ""  # what reduces it, as telemetry names it (a user's hook: its name)

    def as_row(self) -> list[int]:
        """``[bucket index, numel, dtype code, is_last, algorithm code, schedule digest, lanes,
        wire dtype code, kind code]`` (ranks sending different wire dtypes would read messages of the
        wrong size: gloo aborts the process)."""
        code = _DTYPES.index(self.dtype) if self.dtype in _DTYPES else -1
        name = self.schedule.algorithm if self.schedule is not None else self.label or NATIVE
        known = runnable_algorithms()
        algorithm = known.index(name) if name in known else -1
        if self.schedule is not None:
            digest = self.schedule.digest()
        else:  # a user's hook by its name; native and the sparse gather have nothing more to say
            digest = zlib.crc32(self.label.encode()) if self.kind == FOREIGN else 0
        wire = -1 if self.wire is None else _DTYPES.index(self.wire)
        return [self.index, self.numel, code, int(self.is_last), algorithm, digest, self.lanes, wire,
                _KINDS.index(self.kind)]


def check_bucket_layout(layout: BucketLayout, *, group: dist.ProcessGroup | None, iteration: int) -> None:
    """All-gather ``layout`` over ``group``; raise :class:`BucketLayoutMismatchError` on every
    rank if any two ranks differ."""
    rows = all_gather_ints(layout.as_row(), group, device="cpu")  # the control group: CPU tensors
    if any(other != rows[0] for other in rows[1:]):
        raise BucketLayoutMismatchError(describe_mismatch(rows, iteration=iteration), rows)


def describe_mismatch(rows: list[list[int]], *, iteration: int) -> str:
    """Say which fields the ranks disagree on and each rank's value, then the usual causes."""
    differing = [field for field in range(len(_FIELDS)) if len({row[field] for row in rows}) > 1]
    lines = [
        f"ring_hook: the ranks disagree on the gradient bucket they are about to reduce, or on how "
        f"to reduce it (bucket {rows[0][0]} on rank 0, iteration {iteration}); going on would "
        "deadlock or mix unrelated gradients, so every rank stops here:"
    ]
    for field in differing:
        shown = ", ".join(f"rank {r}: {_show(field, row[field])}" for r, row in enumerate(rows))
        lines.append(f"  - {_FIELDS[field]} differs: {shown}")
    if _LAST in differing:
        lines.append("    (so the ranks have different numbers of buckets)")
    if any(field <= _LAST for field in differing):
        lines.append(
            "Every rank must build the same model (same parameter shapes and dtypes, created in the "
            "same order) and wrap it with the same DistributedDataParallel arguments (bucket_cap_mb, "
            "find_unused_parameters, static_graph)."
        )
    if _ALGORITHM in differing or _SCHEDULE in differing:
        lines.append(
            "Every rank must run the same algorithm with the same values of its options"
            + _options_of(rows) + "."
        )
    if _WIRE in differing:
        lines.append("Every rank must pass the same wire_dtype (fp32, the default, sends a bucket as it is).")
    if _KIND in differing:
        lines.append(
            "Every rank must reduce the bucket the same way: the same hook= (your own hook, or none) and the same "
            "sparse= (a sparse bucket gathered on one rank and densified on another waits forever)."
        )
    if _LANES in differing:
        lines.append(
            "Every rank must spread buckets over the same number of worker lanes: pass the same "
            "concurrent_buckets on every rank; observers= keep buckets on one lane, so give every "
            "rank observers or none (or pass concurrent_buckets=1)."
        )
    lines.append("HookState(check_layout_steps=0) turns this check off.")
    return "\n".join(lines)


def _options_of(rows: list[list[int]]) -> str:
    """``"; ring's options: ring_order, node_of"``, for each algorithm the ranks chose, and where
    a default comes from the environment (which can differ between nodes)."""
    known = runnable_algorithms()
    named = sorted({known[row[_ALGORITHM]] for row in rows if 0 <= row[_ALGORITHM] < len(known)}, key=known.index)
    parts = []
    for name in named:
        options = get_algorithm(name).options
        if options:
            shown = ", ".join(
                option.name + (f" (default: {option.environment}, which differs when nodes run different "
                               "numbers of ranks)" if option.environment else "")
                for option in options
            )
            parts.append(f"{name}'s options: {shown}")
    return "".join(f"; {part}" for part in parts)


def _show(field: int, value: int) -> str:
    if field == _NUMEL:
        return f"{value:,}"
    if field == _DTYPE:
        return str(_DTYPES[value]).removeprefix("torch.") if 0 <= value < len(_DTYPES) else "other"
    if field == _LAST:
        return "yes" if value else "no"
    if field == _ALGORITHM:
        known = runnable_algorithms()
        return known[value] if 0 <= value < len(known) else "other"
    if field == _SCHEDULE:
        return f"{value:#010x}"
    if field == _WIRE:
        return "as the bucket" if value < 0 else str(_DTYPES[value]).removeprefix("torch.")
    if field == _KIND:
        return _KINDS[value] if 0 <= value < len(_KINDS) else "other"
    return str(value)
