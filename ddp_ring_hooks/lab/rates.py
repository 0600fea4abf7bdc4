"""Link rates as people and ``tc`` write them: ``400Mbit``, ``1Gbit``, ``2.5Gbit``.

A rate is bits per second with a decimal prefix (``K`` = 1e3, ``M`` = 1e6, ``G`` = 1e9,
``T`` = 1e12), as link vendors quote them; ``/s`` may follow (``400Mbit/s``). Spellings with
``bps`` are refused: ``tc`` reads ``mbps`` as *megabytes* per second and people mean megabits,
so the word ``bit`` is required.
"""

from __future__ import annotations

import re

_PREFIXES = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_RATE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)BIT(?:/S)?\s*")

#: The sentence each command's --help shows for its rate arguments.
RATE_HELP = "Rates are bits per second with decimal prefixes: 100Mbit, 400Mbit, 1Gbit, 2.5Gbit (K=1e3, M=1e6, G=1e9)."


def parse_rate(text: str) -> int:
    """Bits per second: ``"400Mbit"`` -> 400_000_000, ``"1.5Gbit/s"`` -> 1_500_000_000."""
    match = _RATE.fullmatch(str(text).upper())
    if not match:
        hint = " (bps is ambiguous: tc reads mbps as megabytes per second)" if "BPS" in str(text).upper() else ""
        raise ValueError(f"cannot read rate {text!r}{hint}; write bits per second like 100Mbit, 400Mbit or 1Gbit")
    bits = round(float(match.group(1)) * _PREFIXES[match.group(2)])
    if bits < 8000:  # tc cannot shape below a few kbit/s, and nothing here trains at that speed
        raise ValueError(f"rate {text!r} is below 8Kbit; give a link speed like 100Mbit or 1Gbit")
    return bits


def format_rate(bits_per_second: int) -> str:
    """400_000_000 -> ``"400Mbit"``: the shortest form that :func:`parse_rate` reads back exactly."""
    for prefix in ("T", "G", "M", "K"):
        text = f"{bits_per_second / _PREFIXES[prefix]:g}{prefix}bit"
        if bits_per_second >= _PREFIXES[prefix] and parse_rate(text) == bits_per_second:
            return text
    return f"{bits_per_second}bit"
