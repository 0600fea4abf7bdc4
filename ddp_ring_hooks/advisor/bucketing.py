"""DDP's bucketing rules, replayed for another ``bucket_cap_mb``.

DDP packs gradients into buckets twice (``torch/nn/parallel/distributed.py`` and the C++
``Reducer``; ``compute_bucket_assignment_by_size``)::

    step 1       every parameter in ONE bucket (DDP does not yet know the order in which
                 gradients become ready, so it does not guess)
    after step 1 rebuilt in the order gradients became ready, which for most models is the
                 reverse of the order parameters were registered in (the last layer's
                 gradient is computed first)

Packing walks the tensors in that order, keeping one open bucket per (dtype, device), adds
each tensor's bytes, and closes the bucket as soon as its size *reaches* the limit (a bucket
may exceed the cap by its last tensor). The limits are a list: the first bucket of each dtype
uses the first limit, every later one the last. With ``bucket_cap_mb`` left at its default
(25 MiB) the first limit is ``dist._DEFAULT_FIRST_BUCKET_BYTES`` = 1 MiB, so the first
gradients (ready earliest) start travelling early; with an explicit ``bucket_cap_mb`` (torch
>= 2.10) every bucket, the first included, uses the cap. Buckets still open at the end are
closed in the order their dtype was first seen.
"""

from __future__ import annotations

from collections.abc import Sequence

MIB = 1 << 20
DEFAULT_BUCKET_CAP_MB = 25
DEFAULT_FIRST_BUCKET_BYTES = 1 * MIB  # dist._DEFAULT_FIRST_BUCKET_BYTES


def bucket_limits(*, bucket_cap_mb: float | None, explicit_first_is_cap: bool = True) -> tuple[int, ...]:
    """DDP's byte limits for a ``bucket_cap_mb`` argument (``None``: DDP's default).

    ``explicit_first_is_cap``: whether an explicit cap also limits the first bucket (torch >=
    2.10; older versions always used 1 MiB for it)::

        >>> bucket_limits(bucket_cap_mb=None)
        (1048576, 26214400)
        >>> bucket_limits(bucket_cap_mb=5)
        (5242880,)
    """
    if bucket_cap_mb is not None and bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
    cap = int((DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb) * MIB)
    first = cap if (bucket_cap_mb is not None and explicit_first_is_cap) else DEFAULT_FIRST_BUCKET_BYTES
    return (first, cap) if first < cap else (cap,)


def assign_buckets(
    sizes: Sequence[int], limits: Sequence[int], *, dtypes: Sequence[str] | None = None
) -> list[list[int]]:
    """Pack tensors of ``sizes`` bytes, in the order given, into buckets: lists of positions.

    The order given is the order gradients become ready (DDP's rebuilt order); see the module
    docstring for the rules::

        >>> assign_buckets([600_000, 600_000, 3_000_000, 10], [1_000_000, 2_000_000])
        [[0, 1], [2], [3]]
    """
    if not limits or any(limit <= 0 for limit in limits):
        raise ValueError(f"bucket limits must be positive byte counts, got {list(limits)}")
    dtypes = list(dtypes) if dtypes is not None else ["float32"] * len(sizes)
    if len(dtypes) != len(sizes):
        raise ValueError(f"{len(sizes)} sizes but {len(dtypes)} dtypes")
    result: list[list[int]] = []
    open_buckets: dict[str, list[int]] = {}
    open_bytes: dict[str, int] = {}
    limit_index: dict[str, int] = {}
    for position, (size, dtype) in enumerate(zip(sizes, dtypes)):
        bucket = open_buckets.setdefault(dtype, [])
        bucket.append(position)
        open_bytes[dtype] = open_bytes.get(dtype, 0) + size
        index = limit_index.setdefault(dtype, 0)
        if open_bytes[dtype] >= limits[index]:
            result.append(bucket)
            open_buckets[dtype], open_bytes[dtype] = [], 0
            limit_index[dtype] = min(index + 1, len(limits) - 1)
    result.extend(bucket for bucket in open_buckets.values() if bucket)
    return result


def rebuilt_bucket_bytes(
    param_bytes: Sequence[int],
    limits: Sequence[int],
    *,
    dtypes: Sequence[str] | None = None,
) -> list[int]:
    """Bytes of each bucket DDP builds after step 1, in launch order, for parameters of
    ``param_bytes`` in *registration* order (``model.parameters()``), taking the gradient-ready
    order to be the reverse::

        >>> rebuilt_bucket_bytes([4, 4, 4], [8])   # the last two parameters first
        [8, 4]
    """
    order = list(range(len(param_bytes)))[::-1]
    sizes = [param_bytes[i] for i in order]
    kinds = None if dtypes is None else [dtypes[i] for i in order]
    return [sum(sizes[i] for i in bucket) for bucket in assign_buckets(sizes, limits, dtypes=kinds)]
