"""``algorithm="auto"`` moved to :mod:`ddp_ring_hooks.runtime.selection` (the hook, ``all_reduce``
and the benchmark share one choice code there); these names stay importable from here."""

from ..runtime.selection import (  # noqa: F401 - re-exported
    AUTO,
    NATIVE,
    AutoSelector,
    agreed_local_size,
    calibrate,
    default_candidates,
    schedule_options,
    selector_for,
)

__all__ = [
    "AUTO", "NATIVE", "AutoSelector", "agreed_local_size", "calibrate", "default_candidates", "schedule_options",
    "selector_for",
]
