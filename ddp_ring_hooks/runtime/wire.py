"""A bucket's bytes and its wire dtype: the one place that counts them.

Every byte count of a bucket asks here (:func:`tensor_bytes`, :func:`bucket_bytes`), never
``numel() * element_size()`` inline: the hook's choice of algorithm by size, the telemetry's
``bytes`` and ``wire_bytes``, the executor's per-link counts, ``all_reduce`` and the benchmark.
A bucket of another kind (sparse, later) answers here too.

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
from ..schedules.wire import short_name

#: The torch dtype of each narrower wire dtype's name (``fp32`` means "as the bucket is").
NARROW_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, slots=True)
class BucketBytes:
    """A bucket's size: ``nbytes`` in its own dtype, ``wire_bytes`` as its transfers carry it
    (``wire``: the dtype on the wire, e.g. ``"bfloat16"``)."""

    nbytes: int
    wire_bytes: int
    wire: str

    @property
    def ratio(self) -> float:
        """``wire_bytes / nbytes`` (1.0 for an empty bucket)."""
        return self.wire_bytes / self.nbytes if self.nbytes else 1.0


def tensor_bytes(tensor: torch.Tensor) -> int:
    """The bytes ``tensor`` holds (dense: its elements times their size)."""
    return tensor.numel() * tensor.element_size()


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


def bucket_bytes(tensor: torch.Tensor, wire: torch.dtype | None) -> BucketBytes:
    """``tensor``'s bytes, and the bytes its transfers carry on ``wire`` (``None``: its own dtype)."""
    nbytes = tensor_bytes(tensor)
    if wire is None:
        return BucketBytes(nbytes, nbytes, str(tensor.dtype).removeprefix("torch."))
    return BucketBytes(nbytes, tensor.numel() * wire.itemsize, str(wire).removeprefix("torch."))


def _named(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    return f"{name} ({short_name(name)})" if short_name(name) != name else name
