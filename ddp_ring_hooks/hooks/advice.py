"""The advisor's words for a live hook state.

The advisor itself is pure (:mod:`ddp_ring_hooks.advisor`) and reads a run's timeline records;
this module turns them into the two texts a hook shows: the ``comm/advice`` panel, which the
observation writes through the TensorBoard sink when the state closes (:func:`advice_table`),
and the lines the integrations print at the end of training (:func:`advice_text`).
"""

from __future__ import annotations

from ..advisor import advise, format_advice


def advice_table(records: list) -> str:
    """The advisor's table for timeline ``records`` (the ``comm/advice`` panel's text); raises
    ``ValueError`` when the run is too short to advise on."""
    return format_advice(advise(records))


def advice_text(state) -> str:
    """The advisor's table for a hook state, or why there is none (too few steps)."""
    try:
        return "communication advice (ddp_ring_hooks advisor):\n" + advice_table(state.timeline.records())
    except ValueError as error:
        return f"communication advice: none ({error})"
