"""A bucket's bytes and its wire dtype: the one place that counts them.

Every byte count of a bucket asks here (:func:`tensor_bytes`, :func:`bucket_bytes`), never
``numel() * element_size()`` inline: the hook's choice of algorithm by size, the telemetry's
``bytes`` and ``wire_bytes``, the executor's per-link counts, ``all_reduce`` and the benchmark.
Each kind of bucket answers here:

=============  =====================================  =========================================
kind           ``nbytes`` (the ``bytes`` tag)          ``wire_bytes``
=============  =====================================  =========================================
``dense``      its elements times their size           as its transfers carry them (the wire dtype)
``sparse``     its indices and values (this rank's,    ``(p - 1) x nbytes``: the gather takes every
               as the gather coalesces them)           rank's indices and values to every other rank
``densified``  the dense tensor the schedule reduces   as ``dense``
``foreign``    as ``dense`` (a sparse one: its indices     what the user's hook says it sent, else ``nbytes``
               and values, coalesced)
=============  =====================================  =========================================

A sparse bucket (``nn.Embedding(sparse=True)``) is a COO tensor whose ``numel()`` counts the
rows it does not store: :func:`tensor_bytes` of it is its size *as a dense tensor*
(``dense_bytes``), what densifying it would move, never what the gather moves.

The wire dtype is an option of every algorithm (``wire_dtype=``, declared in
``schedules/wire.py``): its name, resolved with the other options, travels with the schedule.
:func:`wire_dtype_for` turns it into the ``torch.dtype`` a given bucket travels in, or ``None``
when it travels as it is:

==================  ==============  ==============================================
bucket              ``wire_dtype``  travels as
==================  ==============  ==============================================
any                 ``"fp32"``      itself (the default: no cast)
float32 / float64   ``"bf16"``      bfloat16 (``"fp16"``: float16)
bfloat16            ``"bf16"``      itself
float16 / bfloat16  the other one   refused: not narrower (the fix: ``"fp32"``)
integer, complex    bf16, fp16      refused: only real floating point is rounded
==================  ==============  ==============================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..schedules import WIRE_DTYPE, wire_of
from ..schedules.wire import DENSE, DENSIFIED, FOREIGN, SPARSE, short_name

#: The torch dtype of each narrower wire dtype's name (``fp32`` means "as the bucket is").
NARROW_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, slots=True)
class BucketBytes:
    """A bucket's size (see the module docstring's table): ``nbytes``, ``wire_bytes`` as its
    transfers carry it (``wire``: the dtype on the wire, e.g. ``"bfloat16"``), its ``kind``; for
    a sparse bucket (gathered or densified) also ``nnz`` (its stored entries, coalesced),
    ``sparse_bytes`` (their indices and values) and ``dense_bytes`` (its size as a dense tensor):
    what the advisor prices both ways with."""

    nbytes: int
    wire_bytes: int
    wire: str
    kind: str = DENSE
    nnz: int | None = None
    sparse_bytes: int | None = None
    dense_bytes: int | None = None

    @property
    def ratio(self) -> float:
        """``wire_bytes / nbytes`` (1.0 for an empty bucket)."""
        return self.wire_bytes / self.nbytes if self.nbytes else 1.0


def tensor_bytes(tensor: torch.Tensor) -> int:
    """The bytes ``tensor`` holds as a dense tensor: its elements times their size (a sparse
    tensor's ``numel()`` counts the elements it does not store too: its size densified)."""
    return tensor.numel() * tensor.element_size()


def sparse_bytes(tensor: torch.Tensor) -> int:
    """The indices and values a sparse COO ``tensor`` puts in a gather once coalesced (what gloo's
    sparse all-reduce sends of it): :func:`coalesced_nnz` index columns of ``sparse_dim``
    integers, and as many values (each a row of its dense dimensions)."""
    indices, values = tensor._indices(), tensor._values()
    row = values[0].numel() * values.element_size() if values.dim() > 1 else values.element_size()
    return coalesced_nnz(tensor) * (indices.size(0) * indices.element_size() + row)


def coalesced_nnz(tensor: torch.Tensor) -> int:
    """The stored entries of a sparse COO ``tensor`` once coalesced (duplicate indices added),
    counted without coalescing it: the gather coalesces it itself, on its own thread, and a
    tensor coalesced beforehand is gathered slower (0.5-0.6 ms at 2 ranks for a 512-row
    gradient of a 100000 x 64 table, ``benchmarks/sparse_bucket.py``)."""
    if tensor.is_coalesced() or tensor._nnz() < 2:
        return tensor._nnz()
    indices = tensor._indices()
    if indices.size(0) == 1:  # an embedding's rows: one index each
        return int(torch.unique(indices[0]).numel())
    return int(torch.unique(indices, dim=1).size(1))


def wire_dtype_for(dtype: torch.dtype, options: Mapping[str, object] | tuple | str) -> torch.dtype | None:
    """The dtype a buffer of ``dtype`` travels in under ``options`` (resolved options, a
    schedule's option pairs, or the wire dtype's name); ``None``: as it is, no cast.

    Raises ``TypeError`` with the fix when the wire dtype is not narrower than ``dtype``
    (see the module docstring).
    """
    name = options if isinstance(options, str) else wire_of(options)
    wire = NARROW_DTYPES.get(name)
    if wire is None or wire == dtype:
        return None
    if not dtype.is_floating_point:
        raise TypeError(
            f"{WIRE_DTYPE.name}={name!r} rounds floating-point values, and this buffer is {_named(dtype)}: "
            f"pass {WIRE_DTYPE.name}='fp32' (as it is) for it"
        )
    if wire.itemsize >= dtype.itemsize:
        raise TypeError(
            f"{WIRE_DTYPE.name}={name!r} is not narrower than this {_named(dtype)} bucket, so it would send as many "
            f"bytes and round them differently. Pass {WIRE_DTYPE.name}='fp32' (the default: a bucket travels as it is), "
            f"or {WIRE_DTYPE.name}={short_name(str(dtype))!r}"
        )
    return wire


def bucket_bytes(tensor: torch.Tensor, wire: torch.dtype | None, *, kind: str = DENSE, world_size: int = 1,
                 wire_bytes: int | None = None) -> BucketBytes:
    """``tensor``'s bytes as a bucket of ``kind`` (the module docstring's table), and the bytes its
    transfers carry on ``wire`` (``None``: its own dtype). ``world_size``: the group's, for a
    gathered sparse bucket; ``wire_bytes``: a foreign hook's own count of what it sent."""
    nbytes = tensor_bytes(tensor)
    named = str(wire if wire is not None else tensor.dtype).removeprefix("torch.")
    on_wire = nbytes if wire is None else tensor.numel() * wire.itemsize
    if not tensor.is_sparse:
        if kind == FOREIGN:
            return BucketBytes(nbytes, nbytes if wire_bytes is None else int(wire_bytes), named, kind)
        return BucketBytes(nbytes, on_wire, named, kind)
    stored = sparse_bytes(tensor)
    sparse = {"nnz": coalesced_nnz(tensor), "sparse_bytes": stored, "dense_bytes": nbytes}
    if kind == FOREIGN:  # what DDP handed the user's hook: its indices and values
        return BucketBytes(stored, stored if wire_bytes is None else int(wire_bytes), named, kind, **sparse)
    if kind == SPARSE:  # the group's gather: its own indices and values, to each of the other ranks
        return BucketBytes(stored, (world_size - 1) * stored, str(tensor.dtype).removeprefix("torch."), kind, **sparse)
    return BucketBytes(nbytes, on_wire, named, kind, **sparse)


def _named(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    return f"{name} ({short_name(name)})" if short_name(name) != name else name
