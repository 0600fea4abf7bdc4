"""``HookState.state_dict()`` / ``load_state_dict()``: the hook's part of a training checkpoint.

Frameworks checkpoint objects through these two methods (Accelerate's
``register_for_checkpointing`` requires them; so does any ``torch.save`` of a dict of
``state_dict()`` s). The dict holds plain Python values (and, with error feedback, CPU
tensors), so ``torch.load(...,
weights_only=True)`` reads it back, and it is the same on every rank (rank 0 may save it alone).

Saved:

- ``iteration``: the optimizer steps reduced so far, the x axis of the ``comm/*`` tags, so a
  resumed run's curves continue where they stopped;
- ``algorithm``, ``algorithm_options``: how the buckets were reduced;
- ``auto`` (``algorithm="auto"`` only): the probe's α, β, γ per candidate, with the world size
  and the candidates they were measured for, so a resumed run chooses per bucket as before
  instead of trusting a new probe on a machine that may be busier or quieter now;
- ``telemetry``: the telemetry options (where the run logged, how often);
- ``error_feedback`` (``error_feedback=True`` only): every bucket's rounding residual, on the
  CPU, with what finds its bucket again (:meth:`~.error_feedback.ErrorFeedback.state_dict`),
  so a resumed run still adds back what the last steps' roundings lost.

Deliberately not saved: the process group, worker threads, ``observers`` and sinks (objects of
this process); what the telemetry and the timeline recorded (they describe the saving run, and
the resumed one measures its own); the failure record and the layout check's progress (a
resumed run builds its buckets anew and checks them again).

Loading restores the step counter and, where it applies, the calibration and the residuals. The algorithm, its
options and the telemetry stay as the resumed script registered them: they may differ on
purpose (say, after following the advisor), and a difference is named in a warning.

This dict is the one durable, versioned format. A pickle (a spawned process, a deep copy) is
not one: :class:`Checkpointing` pickles the state's options and counters without its process
group, threads or watchers, for the same version of this package to load.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping

from ..cost_model import Calibration

#: Bumped when the dict changes shape, so an old checkpoint fails with a clear message.
FORMAT = 1


class Checkpointing:
    """``HookState``'s part of a checkpoint and of a pickle (see the module docstring)."""

    __slots__ = ()
    #: What a pickle keeps (process groups and threads cannot be pickled; they are rebuilt on load).
    _PICKLED = ("algorithm", "algorithm_options", "iteration", "observation", "concurrent_buckets", "plan",
                "check_layout_steps")

    def state_dict(self) -> dict:
        """What a checkpoint keeps of this state, as plain values (``accelerator.register_for_checkpointing(state)``
        works with it); what is saved and what deliberately not: :mod:`~ddp_ring_hooks.hooks.checkpoint`."""
        return state_dict_of(self)

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Continue from a :meth:`state_dict`: the step counter, and ``auto``'s calibration where
        it applies; the algorithm and telemetry stay as registered (see :mod:`~ddp_ring_hooks.hooks.checkpoint`)."""
        load_state_dict_into(self, state_dict)

    def __getstate__(self) -> dict:
        return {name: getattr(self, name) for name in self._PICKLED}

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        self._restarted(process_group=None)


def state_dict_of(state) -> dict:
    """The checkpoint dict of a :class:`~ddp_ring_hooks.HookState` (see the module docstring)."""
    auto = state.plan.selector
    return {
        "format": FORMAT,
        "iteration": state.iteration,
        "algorithm": state.algorithm,
        "algorithm_options": _reduction_options(state),
        "auto": None if auto is None else {
            "world_size": auto.world_size,
            "candidates": list(auto.candidates),
            "calibration": {a: [c.alpha, c.beta, c.gamma] for a, c in auto.calibration.items()},
        },
        "telemetry": _plain_telemetry_options(state.telemetry.options),
        "error_feedback": None if state.plan.feedback is None else state.plan.feedback.state_dict(),
    }


def load_state_dict_into(state, saved: Mapping) -> None:
    """Continue ``state`` from a :func:`state_dict_of` dict (see the module docstring)."""
    if not isinstance(saved, Mapping) or saved.get("format") != FORMAT:
        got = saved.get("format") if isinstance(saved, Mapping) else type(saved).__name__
        raise ValueError(
            f"not a HookState.state_dict() of format {FORMAT} (got {got!r}): load what "
            "HookState.state_dict() saved, e.g. accelerator.load_state of a save_state that registered the state"
        )
    state.iteration = int(saved["iteration"])
    if state.plan.feedback is not None and saved.get("error_feedback") is not None:
        state.plan.feedback.load_state_dict(saved["error_feedback"])
    ran, runs = (saved["algorithm"], saved["algorithm_options"]), (state.algorithm, _reduction_options(state))
    if ran != runs:
        warnings.warn(
            f"the checkpoint's hook ran {ran[0]} with {ran[1] or 'no options'}; this one keeps {runs[0]} with "
            f"{runs[1] or 'no options'}, as registered (only the step counter was restored)", stacklevel=3,
        )
        return
    calibrated, selector = saved["auto"], state.plan.selector
    if calibrated is None or selector is None:
        return
    if calibrated["world_size"] != selector.world_size or tuple(calibrated["candidates"]) != selector.candidates:
        warnings.warn(
            f"auto: the checkpoint's calibration was measured on {calibrated['world_size']} ranks for "
            f"{', '.join(calibrated['candidates'])}; this run has {selector.world_size} ranks and "
            f"{', '.join(selector.candidates)}, so it keeps its own probe's calibration", stacklevel=3,
        )
        return
    state.plan.selector = selector.recalibrated(
        {a: Calibration(*values) for a, values in calibrated["calibration"].items()}
    )


def _reduction_options(state) -> dict:
    """The algorithm's options as plain values; ``auto``'s ``calibration=`` is saved under ``auto``."""
    return _plain({name: value for name, value in state.algorithm_options.items() if name != "calibration"})


def _plain(value):
    """Tuples become lists, mappings dicts: what a checkpoint stores and compares."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, tuple | list):
        return [_plain(item) for item in value]
    return value


def _plain_telemetry_options(options) -> dict:
    """Every telemetry option but the sinks (objects of this process), as plain values: a trace
    window as ``[start, stop]``, a path as a string."""
    def plain(value):
        if isinstance(value, range):
            return [value.start, value.stop]
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    return {f.name: plain(getattr(options, f.name)) for f in dataclasses.fields(options) if f.name != "sinks"}
