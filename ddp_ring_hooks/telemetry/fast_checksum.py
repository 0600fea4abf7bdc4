"""TensorBoard's record checksum in C, when the ``crc32c`` package is installed.

Every record in a TensorBoard event file ends with a masked CRC-32C of its bytes, and the
``tensorboard`` package computes it in pure Python, a byte at a time: about 0.2 µs per byte.
One step of 16 buckets' scalars is an event of about 3.5 KB, so its checksum alone costs
~0.7 ms of Python on the event writer's thread, holding the GIL that the training thread
(and DDP's hook, called from autograd's thread) needs. On a GPU, where a step can take a few
milliseconds of host time, that shows up as lost throughput (``benchmarks/gpu_check.py``).

:func:`use_fast_checksum` points tensorboard's record writer at the ``crc32c`` C extension
(``pip install crc32c``, part of this package's ``tensorboard`` extra): the same checksum,
byte for byte (checked on a probe before the switch), for every TensorBoard writer in the
process, Lightning's logger included. Without the package nothing changes.
"""

from __future__ import annotations

_PROBE = bytes(range(256)) * 3 + b"ddp_ring_hooks"
_MASK_DELTA = 0xA282EAD8  # TFRecord's checksum mask (tensorboard's masked_crc32c)


def use_fast_checksum() -> bool:
    """Make tensorboard checksum event records with the ``crc32c`` C extension; True when it does.

    Idempotent, and a no-op (False) when ``crc32c`` or tensorboard's record writer is missing
    or the two checksums disagree on the probe.
    """
    try:
        import crc32c
        from tensorboard.summary.writer import record_writer
    except ImportError:
        return False
    current = getattr(record_writer, "masked_crc32c", None)
    if current is None:
        return False
    if getattr(current, "is_c_extension", False):
        return True

    def masked_crc32c(data: bytes) -> int:
        crc = crc32c.crc32c(data)
        return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF

    if masked_crc32c(_PROBE) != current(_PROBE):
        return False
    masked_crc32c.is_c_extension = True
    record_writer.masked_crc32c = masked_crc32c
    return True
