"""A user's own DDP hook, run unchanged inside ours, timed like every other bucket.

DDP has one hook slot (``register_comm_hook`` once per model), so a job that runs PowerSGD or
``bf16_compress_hook`` could not also have this package's timing. With ``hook=`` it can::

    state = ddp_ring_hooks.register(model, hook=powerSGD_hook, hook_state=PowerSGDState(None, ...),
                                    log_dir="runs/powersgd")

1. **At construction** (:func:`foreign_hook`): the hook is checked (a callable DDP could register:
   ``hook(state, bucket) -> Future[Tensor]``), our own algorithm's options are refused next to it
   (they would not run: ``algorithm=``, its options, ``wire_dtype``, ``error_feedback``,
   ``sparse``), and its process group is read off its state (``hook_state.process_group``, as
   PowerSGD's state holds it, or the state itself, as PyTorch's default hooks take their group):
   the hook state watches that group, so a state for another group is refused.
2. **Per bucket**, on DDP's hook thread, in DDP's order, as DDP alone would run it
   (:class:`~.executors.ForeignExecutor`): the bucket is checked (the layout check compares the
   hook's name across ranks), handed over (the hand-over mark), its phase ``hook`` starts, the
   hook is called with DDP's own ``GradBucket``, and the bucket ends when the hook's Future
   completes; its value goes to DDP unchanged, so the parameters are the ones the hook alone
   gives, bit for bit. Not on a lane of ours: a hook that issues its next collective from a
   Future's callback (PowerSGD) relies on every rank issuing buckets in one order, which lanes
   running buckets side by side would not keep.
3. **What it is shown as**: its ``__name__`` (``powerSGD_hook``) where the algorithm's name goes
   (TensorBoard's summary, the timeline, ``advise``), the phase ``hook`` (``comm/bucket_{i}/hook_ms``),
   ``bytes`` the bucket's own (what DDP handed over). Its bytes on the wire are the same unless
   the hook says otherwise: ``wire_bytes=f`` is called as ``f(hook_state, bucket)`` right after
   the hook returned (its state updated for this bucket), and its answer is the bucket's
   ``wire_bytes`` (and what bus bandwidth is computed on).

Timing adds one clock mark at the hook's start and a callback on its Future
(``benchmarks/telemetry_overhead.py --foreign powersgd``); the stall watchdog waits on
that Future as on ``native``'s (no peer known: the hook's own collectives show no progress).

PyTorch's compress hooks on the CPU: DDP refuses ``bf16_compress_hook`` by its name unless CUDA
and NCCL are there ("BF16 all reduce communication hook required CUDA 11+ and NCCL 2.10+"),
though gloo all-reduces bf16. Through ``hook=`` DDP sees ``ring_hook``, so
``register(model, hook=bf16_compress_hook)`` runs on CPU as it is. To register one *alone*
(a baseline without our hook), :func:`registrable` gives it a name DDP does not refuse.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch.distributed as dist

#: The phase a foreign hook's bucket reports: the hook, from its call to its Future's completion.
PHASE = "hook"

#: The keywords that configure our own algorithms, refused next to ``hook=`` (they would not run).
OUR_REDUCTION = ("algorithm", "algorithm_options", "error_feedback", "sparse")


@dataclass(frozen=True)
class ForeignHook:
    """A user's DDP hook and its state, as the plan keeps them (pickled with the hook state:
    a module-level hook pickles by name; PyTorch's hook states drop their process group).

    ``name``: how telemetry shows it; ``wire_bytes``: ``f(hook_state, bucket) -> int``, the bytes
    the hook sent for ``bucket`` (``None``: the bucket's own bytes)."""

    hook: Callable
    state: object
    name: str
    wire_bytes: Callable[[object, dist.GradBucket], int] | None = None

    def group(self) -> dist.ProcessGroup | None:
        """The process group the hook reduces over, as its state says (``None``: the default
        group, or a state that does not say)."""
        return group_of_hook_state(self.state)


def foreign_hook(
    hook: Callable | None, hook_state: object = None, *, wire_bytes: Callable | None = None,
    given: Mapping[str, object] | None = None,
) -> ForeignHook | None:
    """The checked :class:`ForeignHook` for ``hook=`` (``None`` without one); ``given``: the other
    keywords of the state that configure our own reduction (see :data:`OUR_REDUCTION`), refused
    next to a hook with the reason and the fix."""
    if hook is None:
        if hook_state is not None or wire_bytes is not None:
            named = "hook_state=" if hook_state is not None else "wire_bytes="
            raise TypeError(f"{named} belongs to hook=: pass the DDP hook it goes with (hook=powerSGD_hook, say)")
        return None
    if not callable(hook):
        raise TypeError(f"hook= takes a DDP communication hook, hook(state, bucket) -> Future[Tensor]; got {hook!r}")
    try:
        inspect.signature(hook).bind(hook_state, None)
    except TypeError as error:
        raise TypeError(
            f"hook={hook_name(hook)} cannot be called as hook(state, bucket), as DDP calls a communication hook: {error}"
        ) from None
    except ValueError:  # a builtin without a signature: DDP would take it as it is
        pass
    if wire_bytes is not None and not callable(wire_bytes):
        raise TypeError(f"wire_bytes= takes a function f(hook_state, bucket) -> int; got {wire_bytes!r}")
    ours = [name for name, value in (given or {}).items() if value not in (None, False, {}, ())]
    if ours:
        raise TypeError(
            f"hook={hook_name(hook)} runs your own DDP hook, which reduces every bucket itself, so "
            f"{', '.join(f'{name}=' for name in ours)} would not run: pass either hook= (your hook, timed) or "
            "algorithm= and its options (ours), not both"
        )
    return ForeignHook(hook, hook_state, hook_name(hook), wire_bytes)


def check_hook_group(foreign: ForeignHook, group: dist.ProcessGroup | None) -> None:
    """Refuse a hook whose state reduces over another group than the hook state watches (the
    watchers would time, gather and abort on the wrong ranks)."""
    theirs = foreign.group()
    world = dist.group.WORLD
    if (theirs if theirs is not None else world) is not (group if group is not None else world):
        raise ValueError(
            f"hook={foreign.name}'s state reduces over another process group than this hook state's: pass "
            "process_group= the hook's own group (the one in its state), so that its buckets are watched on "
            "the ranks that reduce them"
        )


def group_of_hook_state(state: object) -> dist.ProcessGroup | None:
    """The group in a hook's state: the state itself (PyTorch's default hooks take a process
    group), or its ``process_group`` (PowerSGD's, post-local SGD's); ``None`` otherwise."""
    if isinstance(state, dist.ProcessGroup):
        return state
    group = getattr(state, "process_group", None)
    return group if isinstance(group, dist.ProcessGroup) else None


def hook_name(hook: Callable) -> str:
    """``powerSGD_hook``; a ``functools.partial`` by its function's name."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    return getattr(hook, "__name__", None) or type(hook).__name__


def registrable(hook: Callable) -> Callable:
    """``hook`` under a name DDP registers on any machine: DDP refuses ``bf16_compress_hook``
    (and ``bf16_compress_wrapper_hook``) by name without CUDA and NCCL, though gloo runs it.
    For registering PyTorch's own hook *alone* (``model.register_comm_hook(None,
    registrable(bf16_compress_hook))``: a baseline); through ``register(model, hook=...)``
    it needs nothing."""

    def pytorch_hook(state, bucket):
        return hook(state, bucket)

    pytorch_hook.__qualname__ = pytorch_hook.__name__ = f"{hook_name(hook)}_on_any_device"
    return pytorch_hook
