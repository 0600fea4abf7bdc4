"""``register``: one call that builds the hook state and attaches the hook to a DDP model."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .foreign import group_of_hook_state
from .ring_hook import ring_hook
from .state import HookState
from .unwrap import find_ddp
from .validation import validate_algorithm, validate_reducer, validate_registration, validate_sparse, validate_wire


def register(
    ddp_model: DistributedDataParallel | nn.Module,
    *,
    algorithm: str | None = None,
    process_group: dist.ProcessGroup | None = None,
    **options,
) -> HookState:
    """Attach :func:`ring_hook` to ``ddp_model`` and return its :class:`HookState`.

    ``ddp_model`` is the DDP model, or whatever wraps exactly one (``torch.compile``'s
    ``OptimizedModule``, Fabric's module, what ``accelerator.prepare`` returns): the hook goes
    on the ``DistributedDataParallel`` inside (see :mod:`~ddp_ring_hooks.hooks.unwrap`).

    ``algorithm`` defaults to the ring. ``process_group`` defaults to the model's own group (with
    ``hook=``, the one in its ``hook_state``). ``options`` go to :class:`HookState`:
    the algorithm's own options (e.g. ``local_size=`` for hierarchical; ``wire_dtype="bf16"``,
    every algorithm's, for half the bytes on the wire), ``error_feedback=True`` (with a narrower
    wire: what rounding lost goes back in at the next step), ``network_probe`` (a probe of the
    network for the advisor when the hook is attached: by default when a ``log_dir`` is given,
    ``True`` always, ``False`` never), ``sparse="dense"`` (sparse
    gradients through the algorithm as dense tensors; by default the group's sparse all-reduce),
    ``check_layout_steps``, ``concurrent_buckets``, ``observers``; or, instead of an algorithm,
    ``hook=`` (your own DDP hook, with ``hook_state=``, run unchanged and timed); and the
    watching of every bucket, as
    ``telemetry=TelemetryOptions(...)`` or as its fields (nothing is recorded unless asked):

    - ``log_dir``: TensorBoard events (``comm/bucket_{i}/time_ms``, ...) from rank 0.
    - ``log_every``: record every N-th optimizer step.
    - ``trace_steps``: a Chrome/Perfetto trace ``log_dir/comm_trace.json`` of the optimizer
      steps ``(start, stop)`` (stop excluded), or of N steps after the first: every rank's
      tracks on rank 0's clock (see ``docs/stragglers.md``).
    - ``per_rank``: every rank writes to ``log_dir/rank_{r}``.
    - ``spread_every``: every N-th step, gather when each rank arrived (handed its last bucket
      over) and log the straggler (the rank that arrived last), how long the others waited for
      it and the ranks' step times (``comm/ranks/...``, a line in ``summary()``).
    - ``sinks``: more :class:`~ddp_ring_hooks.telemetry.sinks.Sink` s, on every rank.

    (See :class:`~ddp_ring_hooks.telemetry.TelemetryOptions` for every field.)

    ``state.summary()`` returns the per-bucket table; ``state.close()`` flushes the files.

    Example::

        >>> model = DistributedDataParallel(net)
        >>> state = ddp_ring_hooks.register(model, algorithm="ring")
        >>> state = ddp_ring_hooks.register(model, log_dir="runs/ring", log_every=10)
        >>> # DDP's own all-reduce (NCCL/gloo), bit-identical to no hook, timed per bucket:
        >>> state = ddp_ring_hooks.register(model, algorithm="native", log_dir="runs/native")
        >>> # half the bytes on the wire, partial sums added in fp32, rounding losses fed back:
        >>> state = ddp_ring_hooks.register(model, wire_dtype="bf16", error_feedback=True)
        >>> # your own hook (PowerSGD, bf16_compress_hook, ...), unchanged, timed per bucket:
        >>> state = ddp_ring_hooks.register(model, hook=powerSGD_hook, hook_state=PowerSGDState(None))
        >>> state = ddp_ring_hooks.register(accelerator.prepare(net))  # the DDP inside, compiled or not
    """
    ddp_model = find_ddp(ddp_model)
    validate_reducer(ddp_model)
    attached = reported_comm_hook(ddp_model)
    if attached:
        raise RuntimeError(
            f"this DDP model already has the communication hook {attached!r}; DDP allows one "
            "hook per model, so build a new DistributedDataParallel to register another"
        )
    group = process_group or group_of_hook_state(options.get("hook_state")) or ddp_model.process_group
    validate_registration(ddp_model.module, group)
    # auto's probe runs on the model's device, not on whatever GPU happens to be current.
    options.setdefault("device", ddp_model.device)
    state = HookState(group, algorithm, **options)
    foreign = state.plan.foreign
    if foreign is None:  # a user's hook takes every bucket as it comes, sparse ones included
        validate_algorithm(state.algorithm, state.world_size, state.algorithm_options)
        validate_wire(ddp_model.module, state.algorithm_options)
        validate_sparse(ddp_model.module, state.group, densify=state.plan.densifies,
                        feedback=state.plan.feedback is not None)
    ddp_model.register_comm_hook(state, ring_hook)
    # Every rank meets here: the advisor's network probe (when a rank records the timeline for
    # `advise`, or asked with network_probe=True; never with False).
    probed = state.plan.probe_network(state.group, recorded=state.observation.timeline.log_dir is not None)
    state.observation.attach(
        ddp_model, algorithm=foreign.name if foreign is not None else state.algorithm,
        concurrent_buckets=state.concurrent_buckets, group=state.group,
        run_facts={"nodes": state.nodes, "ring": state.ring, "options": state.algorithm_options,
                   "probe_algorithm": None if probed is None else probed[0],
                   "probe": None if probed is None else probed[1]},
    )
    return state


def reported_comm_hook(ddp_model: DistributedDataParallel) -> str | None:
    """The name of the communication hook DDP itself reports for ``ddp_model`` (None if none)."""
    return ddp_model._get_ddp_logging_data().get("comm_hook") or None
