"""The advisor's words for a live hook state.

The advisor itself is pure (:mod:`ddp_ring_hooks.advisor`) and reads a run's timeline records;
this module turns them into the texts a hook shows: the ``comm/advice`` panel, which the
observation writes through the TensorBoard sink when the state closes (:func:`advice_table`),
the lines the integrations print at the end of training (:func:`advice_text`), and the line
the summary ends with when the ring's order costs time (:func:`ring_order_line`).
"""

from __future__ import annotations

from ..advisor import advise, format_advice, hierarchy_note, ring_order_note, step_model
from ..advisor.advice import ring_order_of_run
from ..runtime.names import has_schedule
from ..schedules import checked_schedule, grouped_by_size, has_ring_order, schedule_nodes


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


def ring_order_line(state) -> str | None:
    """``ring order: the ring crosses the node boundary 4 times; ...`` for an algorithm with a
    ring order (its registry record declares one) whose ranks' nodes are known and which crosses
    them more than it must (priced with the run's own buckets when its timeline has steps, else
    by the bytes alone), or the hierarchy's note when its nodes are not the ranks'
    (:func:`placement_warning`); ``None`` otherwise."""
    hierarchy = placement_warning(state)
    if hierarchy is not None:
        return f"ring order: {hierarchy}"
    if not has_ring_order(state.algorithm_options):  # native, tree, ..., or auto's mix
        return None
    try:
        note = ring_order_of_run(step_model(state.timeline.records()))
    except ValueError:  # no timeline steps yet (a state attached by hand, or too short a run)
        nodes = state.nodes  # None also before the process group exists
        note = None if nodes is None else ring_order_note(order=state.ring, nodes=nodes)
    return None if note is None else f"ring order: {note.line()}"


def placement_warning(state) -> str | None:
    """For an algorithm whose schedule groups the ranks into nodes of its own (``local_size``:
    hierarchical), when those are not the ranks' nodes (as the ranks said: ``GROUP_RANK``): what
    the hook state warns of when it is built."""
    if state.algorithm is None or not has_schedule(state.algorithm) or state.nodes is None:  # None: hook=
        return None
    schedule = checked_schedule(state.algorithm, state.world_size, **state.algorithm_options)
    if not grouped_by_size(schedule):
        return None
    return hierarchy_note(schedule_nodes=schedule_nodes(schedule), nodes=state.nodes)
