"""``HookState``'s options, sorted and checked where it is built, and the messages that refuse them.

``HookState(...)`` takes five kinds of keywords; :func:`sort_options` tells them apart once:

1. the state's own numbers (``check_layout_steps``, ``concurrent_buckets``): :func:`check_counts`;
   ``error_feedback`` (a bool, only with a narrower ``wire_dtype``: :func:`~.error_feedback.feedback_for`);
   ``sparse`` (how sparse buckets go: :data:`SPARSE_MODES`);
2. the telemetry fields (:data:`~ddp_ring_hooks.telemetry.TELEMETRY_OPTIONS`), given to the
   observation as they are (it checks them: :class:`~ddp_ring_hooks.telemetry.TelemetryOptions`);
3. the algorithm's options, as ``algorithm_options={...}`` or as keywords, not the same both ways;
   checked against its registry record and resolved (defaults filled in, ``LOCAL_WORLD_SIZE``
   read once, here), so a typo fails at construction, not at the first backward;
4. for ``auto``: its own options and every algorithm's (:func:`~ddp_ring_hooks.runtime.selection.auto_option_names`);
5. or, instead of 3 and 4, ``hook=`` (a user's own DDP hook, with ``hook_state=`` and
   ``wire_bytes=``: :func:`~.foreign.foreign_hook`), which refuses our algorithm's options next to it.

An unknown name is a ``TypeError`` that names every option the state takes, with a "did you mean".
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..runtime.names import AUTO, check_algorithm_name
from ..runtime.selection import auto_option_names
from ..schedules import get_algorithm, resolve_options
from ..telemetry import TELEMETRY_OPTIONS
from ..telemetry.options import collect_telemetry_options
from .error_feedback import ErrorFeedback, feedback_for
from .foreign import ForeignHook, foreign_hook

#: ``HookState``'s own options that ``register`` and the Lightning strategy pass on (besides the
#: algorithm's options and the telemetry fields, ``TELEMETRY_OPTIONS``).
HOOK_OPTIONS = ("telemetry", "observers", "check_layout_steps", "concurrent_buckets", "error_feedback",
                "network_probe", "sparse", "hook", "hook_state", "wire_bytes")

#: ``sparse=``: what a sparse gradient bucket goes through. ``"gather"`` (the default): the group's
#: sparse all-reduce, as PyTorch's allreduce_hook does (``runtime/sparse.py``); ``"dense"``: the
#: chosen schedule, as a dense tensor, then back to sparse (the whole table on the wire).
SPARSE_MODES = ("gather", "dense")

#: What ``HookState`` itself takes besides an algorithm's options (for error messages).
STATE_OPTIONS = ("process_group", "algorithm", "algorithm_options", *TELEMETRY_OPTIONS, *HOOK_OPTIONS, "device")


@dataclass(frozen=True)
class SortedOptions:
    """A ``HookState``'s keywords, told apart: the algorithm's (resolved; ``auto``'s as given,
    checked by name), the telemetry fields (for the observation to check), and the residuals'
    keeper when ``error_feedback=True`` (``None`` otherwise)."""

    algorithm: dict[str, object]
    telemetry: dict[str, object]
    feedback: ErrorFeedback | None = None
    foreign: ForeignHook | None = None  # hook=: the user's own hook, instead of our algorithm
    sparse: str = "gather"


#: The algorithm when none is named (and no ``hook=``).
DEFAULT_ALGORITHM = "ring"


def sort_options(
    algorithm: str | None, algorithm_options: Mapping[str, object] | None, keywords: Mapping[str, object], *,
    check_layout_steps: int, concurrent_buckets: int, error_feedback: bool = False, network_probe: bool | None = None,
    sparse: str = "gather", hook=None, hook_state=None, wire_bytes=None,
) -> SortedOptions:
    """Check everything ``HookState`` was given that can be checked without a process group
    (``algorithm=None``: the ring, or nothing with ``hook=``)."""
    check_counts(check_layout_steps=check_layout_steps, concurrent_buckets=concurrent_buckets)
    if network_probe not in (None, True, False):
        raise ValueError(f"network_probe must be None (the default: probe the network for the advisor when the "
                         f"run's timeline is written, with a log_dir), True (always) or False (never), "
                         f"got {network_probe!r}")
    check_sparse(sparse)
    telemetry = {name: keywords[name] for name in TELEMETRY_OPTIONS if name in keywords}
    given = _merged(algorithm_options, {name: value for name, value in keywords.items() if name not in telemetry})
    if hook is not None:
        _known_to_auto(given, shown=None)  # a typo is named as one, not as an option of ours
        # each of our options by its own name (``wire_dtype=``, not "algorithm_options="): given is given
        ours = {"algorithm": algorithm, **dict.fromkeys(given, True), "error_feedback": error_feedback,
                "sparse": None if sparse == "gather" else sparse}
        return SortedOptions({}, telemetry, foreign=foreign_hook(hook, hook_state, wire_bytes=wire_bytes, given=ours))
    foreign_hook(None, hook_state, wire_bytes=wire_bytes)  # hook_state= or wire_bytes= alone: refused
    algorithm = DEFAULT_ALGORITHM if algorithm is None else algorithm
    check_algorithm_name(algorithm)
    options = _known_to_auto(given) if algorithm == AUTO else _resolved(algorithm, given)
    return SortedOptions(options, telemetry, feedback_for(error_feedback, algorithm=algorithm, options=options),
                         sparse=sparse)


def check_register_options(
    *, algorithm: str | None = None, algorithm_options: Mapping[str, object] | None = None, telemetry=None,
    check_layout_steps: int = 2, concurrent_buckets: int = 2, observers=(), device=None, process_group=None,
    error_feedback: bool = False, network_probe: bool | None = None, sparse: str = "gather", hook=None, hook_state=None,
    wire_bytes=None, **options,
) -> None:
    """Everything ``register`` (and so ``HookState``) would be given, checked now, without a
    process group: what a framework's strategy calls when it is built, so a typo fails there
    and not when training starts. The telemetry options are collected as the observation will
    (one given both in ``telemetry=`` and as a keyword is refused)."""
    given = sort_options(algorithm, algorithm_options, options, check_layout_steps=check_layout_steps,
                         concurrent_buckets=concurrent_buckets, error_feedback=error_feedback,
                         network_probe=network_probe, sparse=sparse, hook=hook, hook_state=hook_state,
                         wire_bytes=wire_bytes)
    collect_telemetry_options(getattr(telemetry, "options", telemetry), given.telemetry)


def check_sparse(sparse: object) -> None:
    """``sparse=`` is one of :data:`SPARSE_MODES`."""
    if sparse not in SPARSE_MODES:
        raise ValueError(
            f"sparse={sparse!r}: a sparse gradient bucket goes either through the group's sparse all-reduce "
            "(sparse='gather', the default, as PyTorch's allreduce_hook) or through the algorithm as a dense tensor "
            "(sparse='dense'; its whole table on the wire)"
        )


def split_options(options: Mapping[str, object], elsewhere: frozenset[str]) -> tuple[dict, dict]:
    """``options`` told apart: those a framework's own class takes (``elsewhere``), and the rest,
    ``register``'s (see :func:`parameter_names`)."""
    theirs = {name: value for name, value in options.items() if name in elsewhere}
    return theirs, {name: value for name, value in options.items() if name not in elsewhere}


def parameter_names(*functions: Callable) -> frozenset[str]:
    """The keyword names ``functions`` take by name (not ``self``, ``module``, ``*args`` or ``**kwargs``):
    what a framework's strategy and ``DistributedDataParallel`` accept."""
    return frozenset(
        name for function in functions for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
        and name not in ("self", "module")
    )


def check_counts(*, check_layout_steps: int = 2, concurrent_buckets: int = 2) -> None:
    """``HookState``'s own numbers, checked (also by the Lightning strategy, when it is built)."""
    if isinstance(check_layout_steps, bool) or not isinstance(check_layout_steps, int) or check_layout_steps < 0:
        raise ValueError(f"check_layout_steps must be an integer >= 0, got {check_layout_steps!r}")
    if isinstance(concurrent_buckets, bool) or not isinstance(concurrent_buckets, int) or concurrent_buckets < 1:
        raise ValueError(f"concurrent_buckets must be an integer >= 1, got {concurrent_buckets!r}")


def _merged(mapping: Mapping[str, object] | None, keywords: dict[str, object]) -> dict[str, object]:
    both = sorted(set(mapping or {}) & set(keywords))
    if both:
        raise TypeError(f"option {', '.join(map(repr, both))} given twice: in algorithm_options and as a keyword")
    return {**(mapping or {}), **keywords}


def _resolved(algorithm: str, options: dict[str, object]) -> dict[str, object]:
    """The algorithm's options checked against its registry record, defaults filled in; an
    unknown name is reported with everything ``HookState`` accepts."""
    try:
        return resolve_options(algorithm, options)
    except TypeError as error:
        accepted = get_algorithm(algorithm).option_names
        raise TypeError(unknown_option_message(sorted(set(options) - set(accepted)), algorithm, accepted)) from error


def _known_to_auto(options: dict[str, object], *, shown: str | None = AUTO) -> dict[str, object]:
    accepted = auto_option_names()
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TypeError(unknown_option_message(unknown, shown, accepted))
    return options


def unknown_option_message(unknown: list[str], algorithm: str | None, algorithm_options: tuple[str, ...]) -> str:
    """``HookState got unknown option 'log_dirr' (did you mean 'log_dir'?). HookState takes ...``
    (``algorithm=None``: a state with ``hook=``, whose algorithm options are not named)."""
    everything = (*STATE_OPTIONS, *algorithm_options)
    close = difflib.get_close_matches(unknown[0], everything, n=1)
    takes = "" if algorithm is None else (
        f"; the {algorithm} algorithm takes " + (", ".join(algorithm_options) if algorithm_options else "no options"))
    return (
        f"HookState got unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}"
        + (f" (did you mean {close[0]!r}?)" if close else "")
        + f". HookState takes {', '.join(STATE_OPTIONS)}" + takes
    )
