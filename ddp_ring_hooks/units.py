"""Byte sizes on the command line: one reading for every command.

Sizes are binary, as in nccl-tests (``-b 4K -e 64M``) and as buffers are allocated:
``K``, ``KB`` and ``KiB`` all mean 1024 bytes, ``M``/``MB``/``MiB`` 1024², ``G``/``GB``/``GiB``
1024³, ``T``/``TB``/``TiB`` 1024⁴ (case does not matter; ``B`` or nothing means bytes).
Bandwidths are another matter: ``GB/s`` there means 1e9 bytes per second, as nccl-tests and
link vendors quote them (see ``ddp-ring-hooks model --help``).
"""

from __future__ import annotations

import re

#: The sentence each command's --help shows for its size arguments.
SIZE_HELP = "Sizes are bytes with binary suffixes: K, KB, KiB = 1024; M, MB, MiB = 1024^2; G, GB, GiB = 1024^3."

#: Element types by the names nccl-tests' ``-d`` takes (and torch's own names), each with the
#: name of its ``torch`` dtype: ``bench.DTYPES`` maps them to dtypes, and the command line lists
#: them without importing torch.
ELEMENT_TYPES = {
    "float": "float32", "float32": "float32",
    "double": "float64", "float64": "float64",
    "half": "float16", "float16": "float16",
    "bfloat16": "bfloat16",
}

_PREFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(?:I?B)?\s*")


def parse_size(text: str) -> int:
    """Bytes: ``"4K"``, ``"4KB"`` and ``"4KiB"`` -> 4096; ``"1.5M"`` -> 1572864; ``"512"`` -> 512
    (fractions round to the nearest byte)."""
    match = _SIZE.fullmatch(str(text).upper())
    if not match:
        raise ValueError(f"cannot read size {text!r}; write bytes like 4096, 64K, 1.5MB or 1G ({SIZE_HELP})")
    return round(float(match.group(1)) * _PREFIXES[match.group(2)])  # "5.42MiB", as printed, reads back


def format_size(nbytes: int) -> str:
    """4096 -> ``"4K"``, the form ``parse_size`` reads; sizes that are not a whole number of
    K/M/G stay in bytes (table columns, where every row is a power of two)."""
    for suffix in ("G", "M", "K"):
        unit = _PREFIXES[suffix]
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit}{suffix}"
    return str(int(nbytes))


def format_bytes(nbytes: float) -> str:
    """``1 GiB``, ``392 KiB``: three significant digits with binary units, for prose."""
    for unit in ("T", "G", "M", "K"):
        scale = _PREFIXES[unit]
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}iB"
    return f"{nbytes:.3g} B"
