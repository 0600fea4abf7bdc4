"""The wire dtype: what the transfers carry, declared once for every algorithm (pure, no torch).

A wire dtype is a property of the transfers, not of a schedule's shape. The same schedule, with
the same steps and chunks, can send every chunk as ``bf16`` or ``fp16`` instead of the bucket's
own ``fp32``; what changes is what each transfer carries and what each rank does around it:

1. a chunk about to be sent is *narrowed* to the wire dtype (its first use also divides it by
   the world size, before narrowing: the average's guard against fp16 overflow);
2. a received partial sum is *widened* and added in the bucket's dtype (fp32): each reduction
   adds in fp32 and sends its partial sum rounded once;
3. the rank that completes a chunk rounds it to the wire dtype too, and the all-gather copies
   those rounded values, so every rank decodes the same bits (bit-identical results);
4. the bucket returns in its own dtype.

``fp32``, the default, means "as the bucket is": no cast for any bucket (an fp16 bucket travels
as fp16, a float64 tensor as float64). A bucket already in the wire dtype is sent as it is. A wire
dtype that is not narrower than the bucket is refused where the bucket's dtype is known
(``runtime/wire.py``).

The option is declared here, once, and added to every algorithm's record (``schedules/__init__``)
as a *transfer* option (:attr:`~.registry.Option.transfer`): the builders and the closed-form costs
do not take it; the schedule carries it in :attr:`~.ir.Schedule.options`, and the executor and the
cost model read it with :func:`wire_of`. The cost model prices an ``n``-byte fp32 buffer: on a
narrower wire it moves :func:`wire_ratio` ``· n`` bytes and casts ``2n`` (each rank narrows and
widens its whole buffer about once: priced like the reduction, per byte at γ).
"""

from __future__ import annotations

from collections.abc import Mapping

from .registry import Option

#: The kinds of bucket, by what its transfers carry (chosen with the executor,
#: ``hooks/executors.py``; counted by ``runtime/wire.py``): the schedule's dense transfers,
#: the group's sparse all-reduce, a sparse bucket densified through the schedule, or a user's
#: own hook. Names only, here below torch, so the records and the summary can read them.
DENSE, SPARSE, DENSIFIED, FOREIGN = "dense", "sparse", "densified", "foreign"

#: The wire dtypes by name, with bytes per element.
WIRE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}
#: "As the bucket is": the default, no cast.
AS_IS = "fp32"
#: The buffer the cost model prices: fp32 values (4 bytes each).
PRICED_ELEMENT_BYTES = 4
#: Bytes of the buffer cast per byte, on a narrower wire: narrowed once, widened once.
CAST_PASSES = 2.0


#: torch's names of the dtypes, as ``wire_dtype`` (and the summary) names them.
SHORT_NAMES: dict[str, str] = {"float32": "fp32", "float64": "fp64", "bfloat16": "bf16", "float16": "fp16"}


def short_name(dtype: str) -> str:
    """A dtype as ``wire_dtype`` names it: ``"bfloat16"`` -> ``"bf16"`` (others as they are)."""
    return SHORT_NAMES.get(dtype.removeprefix("torch."), dtype)


def check_wire_dtype(value: object) -> str | None:
    """The option's check: one of the names in :data:`WIRE_BYTES`."""
    if value in WIRE_BYTES:
        return None
    return f"is not a wire dtype; choose one of {', '.join(map(repr, WIRE_BYTES))} (fp32: as the bucket is, no cast)"


#: The one declaration, added to every algorithm's options.
WIRE_DTYPE = Option(
    "wire_dtype", AS_IS,
    "what the transfers carry: fp32 (as the bucket is), bf16 or fp16 (half the bytes; partial sums added in fp32)",
    check=check_wire_dtype, label="{} on the wire", metavar="fp32|bf16|fp16", parse=str, transfer=True,
)


def wire_of(options: Mapping[str, object] | tuple) -> str:
    """The wire dtype's name in resolved ``options`` (a mapping, or a schedule's ``(name, value)``
    pairs); :data:`AS_IS` when they do not say."""
    found = (options if isinstance(options, Mapping) else dict(options)).get(WIRE_DTYPE.name)
    return AS_IS if found is None else str(found)


def is_narrow(options: Mapping[str, object] | tuple) -> bool:
    """Whether ``options`` send fewer bytes than an fp32 buffer holds (bf16, fp16)."""
    return WIRE_BYTES[wire_of(options)] < PRICED_ELEMENT_BYTES


def wire_ratio(options: Mapping[str, object] | tuple) -> float:
    """Bytes on the wire per byte of an fp32 buffer: 1.0 for fp32, 0.5 for bf16 and fp16."""
    return WIRE_BYTES[wire_of(options)] / PRICED_ELEMENT_BYTES


def with_wire(options: Mapping[str, object], wire: str) -> dict:
    """``options`` with the wire dtype set to ``wire`` (for a what-if or a benchmark arm)."""
    problem = check_wire_dtype(wire)
    if problem:
        raise ValueError(f"{WIRE_DTYPE.name}={wire!r} {problem}")
    return {**options, WIRE_DTYPE.name: wire}
