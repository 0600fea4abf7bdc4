"""The advisor for a live hook state: ``state.advise()`` and the ``comm/advice`` TensorBoard panel.

The advisor itself is pure (:mod:`ddp_ring_hooks.advisor`); this module hands it the state's
in-memory timeline, and when the state closes writes the advice as a text panel next to the
``comm/*`` charts (the hook group's rank 0, when the state has a ``log_dir``).
"""

from __future__ import annotations

import warnings

from ..advisor import advise, format_advice

ADVICE_TAG = "comm/advice"


def advise_state(state, **options) -> dict:
    """:func:`~ddp_ring_hooks.advisor.advise` of ``state.timeline``'s records."""
    return advise(state.timeline.records(), **options)


def advice_text(state) -> str:
    """The advisor's table for a hook state, or why there is none (too few steps)."""
    try:
        return "communication advice (ddp_ring_hooks advisor):\n" + format_advice(state.advise())
    except ValueError as error:
        return f"communication advice: none ({error})"


def close_timeline(state) -> None:
    """Close the state's timeline; on the group's rank 0 with a ``log_dir``, write the advice panel first."""
    timeline = state.timeline
    if timeline.attached and not timeline.closed and timeline.directory is not None and timeline.run["rank"] == 0 and timeline.steps:
        try:
            text = format_advice(advise_state(state))
        except ValueError as error:  # too few steps, nothing measured: say why
            text = f"no advice: {error}"
        try:
            _write_text(timeline.directory, text)
        except Exception as error:  # noqa: BLE001 - advice must never break closing
            warnings.warn(f"could not write the {ADVICE_TAG} panel: {error!r}", stacklevel=2)
    timeline.close()


def _write_text(log_dir: str, text: str) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=log_dir, filename_suffix=".advice")
    try:
        writer.add_text(ADVICE_TAG, advice_panel(text), global_step=0)
    finally:
        writer.close()


def advice_panel(text: str) -> str:
    """``text`` as a TensorBoard text panel: TensorBoard renders Markdown, and indenting every
    line makes it a code block, which keeps the table's columns."""
    return "\n".join("    " + line for line in text.splitlines())
