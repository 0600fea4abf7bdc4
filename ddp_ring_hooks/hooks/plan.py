"""What a hook state runs: its algorithm settled on the group, prepared, and the schedule per bucket.

Built when the state is, on every rank of the group at once (collective):

1. **Settle** what depends on the group: a ``ring_order`` of ``"hosts"`` or ``"measured"``
   becomes a permutation (:func:`~ddp_ring_hooks.runtime.ring_orders.settle_ring_order`); for
   ``auto``, its probe calibrates every candidate (:class:`~ddp_ring_hooks.runtime.selection.AutoSelector`),
   which settles the candidates' orders on the way.
2. **Prepare** the group's context (:class:`~ddp_ring_hooks.runtime.group_context.GroupContext`)
   for exactly what these schedules need (:func:`~ddp_ring_hooks.runtime.group_context.needs_for`:
   a transport per two-way pair on gloo, the CUDA side groups on NCCL; nothing for
   ``native``), and hold it until :meth:`Plan.release`.

3. **Probe** the network for the advisor, when :func:`~ddp_ring_hooks.register` attaches the
   hook (:meth:`Plan.probe_network`, collective; by default only when the run's timeline is
   written to a ``log_dir``, where ``advise`` reads it; ``True``: always, ``False``: never): the run's
   algorithm timed at a few sizes (:mod:`~ddp_ring_hooks.runtime.network_probe`).

With ``hook=`` (a user's own DDP hook, :mod:`.foreign`) there is nothing to settle or prepare:
the plan keeps the hook (``foreign``) and runs no schedule; the probe times the group's own
all-reduce (``native``), the plain all-reduce the advisor compares the hook's run with.

Then, per bucket and local: :meth:`Plan.schedule_for` (``auto``: its choice for the size;
``native``: ``None``), checked and cached by the registry (:meth:`Plan.schedule_of_bucket`: none
for a foreign hook's bucket or a gathered sparse one; a densified one's by its dense size);
:meth:`Plan.wire_for`, the dtype its transfers carry (the ``wire_dtype`` option of what runs it); and, with ``error_feedback=True``
on a narrower wire, :meth:`Plan.residual_for`, the bucket's residual
(:class:`~.error_feedback.ErrorFeedback`, which the plan keeps). A plan pickles without its
context (and with empty residuals: a checkpoint keeps those); after unpickling (or when built
before ``init_process_group``) it prepares at its first bucket, on every rank's hook thread alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..cost_model import ProbeSample
from ..runtime.collectives import device_of
from ..runtime.group_context import GroupContext, context_of, needs_for
from ..runtime.names import AUTO, has_schedule
from ..runtime.network_probe import probe_network
from ..runtime.ring_orders import settle_ring_order
from ..runtime.selection import AutoSelector
from ..runtime.wire import tensor_bytes, wire_dtype_for
from ..schedules import Schedule, checked_schedule, options_for, resolve_options
from .error_feedback import ErrorFeedback
from .foreign import ForeignHook
from .validation import validate_algorithm


class Plan:
    """The algorithm a hook state runs on its group (see the module docstring).

    ``options``: the algorithm's resolved options (``auto``: its own and its candidates');
    ``selector``: ``auto``'s calibrated chooser, ``None`` otherwise; ``feedback``: every bucket's
    rounding residual (``error_feedback=True``, checked by :func:`~.options.sort_options`), ``None``
    otherwise; ``network_probe``: whether :meth:`probe_network` measures (``register`` calls it; ``None``: when the
    timeline is recorded);
    ``foreign``: the user's own hook (``hook=``; then ``algorithm`` is ``None``); ``sparse``: what a
    sparse bucket goes through (``"gather"`` or ``"dense"``)."""

    #: What ``auto``'s run is probed with: the advisor prices a mix of algorithms as the ring.
    AUTO_PROBED_AS = "ring"
    #: What a foreign hook's run is probed with: the plain all-reduce it stands in for.
    FOREIGN_PROBED_AS = "native"

    def __init__(
        self, group: dist.ProcessGroup | None, algorithm: str | None, options: dict, *,
        device: torch.device | str | None = None, feedback: ErrorFeedback | None = None,
        network_probe: bool | None = None, foreign: ForeignHook | None = None, sparse: str = "gather",
    ) -> None:
        self.algorithm = algorithm
        self.device = None if device is None else torch.device(device)
        self.feedback = feedback
        self.network_probe = network_probe
        self.probed: tuple[str, tuple[ProbeSample, ...]] | None = None  # what probe_network measured
        self.foreign = foreign
        self.sparse = sparse
        self.selector: AutoSelector | None = None
        if foreign is not None:  # the user's hook: nothing to settle
            self.options = {}
        elif algorithm == AUTO:  # every rank meets here: the probe (which settles the candidates' ring orders)
            self.selector = AutoSelector.probed(group, device=device, **options)
            self.options = options
        else:  # every rank meets here: "hosts", "measured" settle on one order
            self.options = settle_ring_order(options, group)
        self._context: GroupContext | None = None
        if dist.is_available() and dist.is_initialized():
            self.context(group)

    def schedule_for(self, nbytes: int, world_size: int) -> Schedule | None:
        """The (checked, cached) schedule of a bucket of ``nbytes``; ``None`` for ``native``."""
        if self.selector is not None:
            algorithm, options = self.selector.choose(nbytes)
        else:
            algorithm, options = self.algorithm, self.options
        return checked_schedule(algorithm, world_size, nbytes=nbytes, **options) if has_schedule(algorithm) else None

    @property
    def densifies(self) -> bool:
        """Whether a sparse bucket goes through the schedule as a dense tensor (``sparse="dense"``)."""
        return self.sparse == "dense"

    def schedule_of_bucket(self, buffer: torch.Tensor, world_size: int) -> Schedule | None:
        """The schedule of a bucket: none for a foreign hook's or a gathered sparse one; a
        densified one's for its size as a dense tensor (what the schedule then moves)."""
        if self.foreign is not None or (buffer.is_sparse and not self.densifies):
            return None
        return self.schedule_for(tensor_bytes(buffer), world_size)

    def wire_for(self, buffer: torch.Tensor, schedule: Schedule | None) -> torch.dtype | None:
        """The dtype ``buffer``'s transfers carry under ``schedule`` (``None``: native, whose wire
        is an option of its own; the result ``None``: the buffer's own dtype); a ``TypeError``
        naming the fix when the wire dtype is not narrower than the bucket. A foreign hook's
        bucket and a gathered sparse one travel as they are (``None``)."""
        if self.foreign is not None or (buffer.is_sparse and not self.densifies):
            return None
        if schedule is not None:
            return wire_dtype_for(buffer.dtype, schedule.options)
        native = self.selector.choose(tensor_bytes(buffer))[1] if self.selector is not None else self.options
        return wire_dtype_for(buffer.dtype, native)

    def residual_for(self, bucket: int, buffer: torch.Tensor, wire: torch.dtype | None, *, parameters=None,
                     is_last: bool) -> torch.Tensor | None:
        """Bucket ``bucket``'s residual (hook thread, in DDP's order: it follows DDP's rebuild of
        its buckets by ``parameters``), or ``None``: no error feedback, or nothing rounded."""
        if self.feedback is None or wire is None:
            return None
        if buffer.is_sparse:  # densified: its residual would be a dense copy of the whole table
            raise TypeError(
                "error_feedback=True keeps each bucket's rounding residual as a dense tensor of the bucket's size, "
                f"and this sparse bucket ({tuple(buffer.shape)}), densified by sparse='dense', would need one as large "
                "as its whole table: keep sparse='gather' (the default: sent as it is, nothing rounded) or "
                "error_feedback=False"
            )
        return self.feedback.prepare(bucket, buffer, parameters, is_last=is_last)

    def probe_network(self, group: dist.ProcessGroup | None, *,
                      recorded: bool) -> tuple[str, tuple[ProbeSample, ...]] | None:
        """``(algorithm, samples)``: the network probe for the advisor (collective: every rank of
        the group calls it, as ``register`` does), or ``None``: not wanted by any rank (``network_probe``
        ``False``, or ``None`` and the timeline not ``recorded`` to a ``log_dir`` for ``advise``),
        one rank, or not on the CPU (the advisor reads CPU runs only). ``auto`` is probed as the ring it is priced as, on
        its wire."""
        group = context_of(group).group
        if group.size() < 2 or device_of(group, self.device).type != "cpu":
            return None
        wanted = self.network_probe is True or (self.network_probe is None and recorded)
        if self.foreign is not None:
            algorithm, options = self.FOREIGN_PROBED_AS, {}
        elif self.selector is None:
            algorithm, options = self.algorithm, self.options
        else:
            algorithm = self.AUTO_PROBED_AS
            options = resolve_options(algorithm, options_for(algorithm, self.options))
        samples = probe_network(group, algorithm=algorithm, options=options, device=self.device, wanted=wanted)
        self.probed = (algorithm, samples) if samples else None  # () : the ranks disagree (the layout check says how)
        return self.probed

    def schedules(self, world_size: int) -> list[Schedule]:
        """Every schedule this plan can run (each candidate's, for ``auto``), at the smallest
        size: what it needs of the group does not change with the size (its two-way pairs)."""
        if self.foreign is not None:
            return []
        if self.selector is None:
            validate_algorithm(self.algorithm, world_size, self.options)  # a builder's complaint, with context
            runs = [(self.algorithm, self.options)]
        else:
            runs = [(a, self.selector.options.get(a, {})) for a in self.selector.candidates]
        return [checked_schedule(a, world_size, nbytes=0, **options) for a, options in runs if has_schedule(a)]

    def context(self, group: dist.ProcessGroup | None) -> GroupContext:
        """The group's context, prepared for this plan and held (collective the first time)."""
        context = self._context
        if context is None:
            context = context_of(group)
            group = context.group
            context.prepare(needs_for(self.schedules(group.size()), group, device=self.device))
            context.hold()
            self._context = context
        return context

    def release(self) -> None:
        """Let go of the context (the last holder's release closes it); the next bucket prepares anew."""
        context, self._context = self._context, None
        if context is not None:
            context.release()

    def __getstate__(self) -> dict:
        return {"algorithm": self.algorithm, "device": self.device, "selector": self.selector, "options": self.options,
                "feedback": self.feedback, "network_probe": self.network_probe, "foreign": self.foreign,
                "sparse": self.sparse}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update({"network_probe": None, **state, "probed": None})
        self._context = None
