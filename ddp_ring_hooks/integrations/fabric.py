"""Lightning Fabric with the ring hook: a DDP strategy that registers it, also by name.

::

    import ddp_ring_hooks.integrations.fabric                     # registers strategy="ddp_ring"

    fabric = Fabric(strategy="ddp_ring", accelerator="cpu", devices=2)
    # or, with options: Fabric(strategy=RingDDPFabricStrategy(algorithm="tree", log_dir="runs/fabric"), ...)

Fabric has no communication-hook option (its ``DDPStrategy`` passes unknown arguments on to
``DistributedDataParallel``, which refuses ``ddp_comm_hook=``), and what ``fabric.setup``
returns hides the DDP model: attributes fall through to the raw model. The public seam is
the strategy's ``setup_module``, which wraps the model in DDP: :class:`RingDDPFabricStrategy`
registers the hook right after it, before ``fabric.setup`` compiles anything and before
the first backward, on CPU (gloo) as on CUDA (NCCL).

Accumulation works as Fabric documents it: ``with fabric.no_backward_sync(model,
enabled=accumulating)`` around the micro-batches that do not step, so the hook runs once
per optimizer step.

This is the only module of the package that imports Lightning Fabric.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..hooks import HookState, register
from ..hooks.options import check_register_options, parameter_names, split_options

STRATEGY_NAME = "ddp_ring"

#: Where each keyword goes: Fabric's DDPStrategy and DistributedDataParallel take these; every
#: other keyword is one of :func:`ddp_ring_hooks.register`'s, checked when the strategy is built.
_STRATEGY_KEYWORDS = parameter_names(DDPStrategy.__init__, DistributedDataParallel.__init__)


class RingDDPFabricStrategy(DDPStrategy):
    """Fabric's ``DDPStrategy`` whose gradients are averaged by :func:`~ddp_ring_hooks.ring_hook`.

    Args:
        **options: what :func:`ddp_ring_hooks.register` takes (``algorithm=``, ``log_dir=``,
            ``log_every=``, ...), and what Fabric's ``DDPStrategy`` and
            ``DistributedDataParallel`` take (``process_group_backend=``, ``timeout=``,
            ``bucket_cap_mb=``, ``find_unused_parameters=``, ...), each sent where it belongs;
            the hook's are checked here (an unknown name, a bad value), not at ``fabric.setup``.

    After ``fabric.setup(model, ...)``, :attr:`hook_state` is that model's
    :class:`~ddp_ring_hooks.HookState` (``summary()``, ``advise()``, ``state_dict()`` for
    ``fabric.save``, ``close()`` at the end: Fabric never tears its strategy down).

    Example::

        >>> fabric = Fabric(strategy=RingDDPFabricStrategy(algorithm="ring", bucket_cap_mb=5), devices=4)
    """

    def __init__(self, **options: Any) -> None:
        strategy, self.register_options = split_options(options, _STRATEGY_KEYWORDS)
        check_register_options(**self.register_options)  # a typo fails here, not at fabric.setup
        super().__init__(**strategy)
        self.hook_state: HookState | None = None

    def setup_module(self, module: nn.Module) -> DistributedDataParallel:
        """Wrap the module in DDP (Fabric's code), then register the hook on it."""
        ddp = super().setup_module(module)
        # Each model set up gets a hook of its own (a GAN trains two); the last one's state is kept here.
        self.hook_state = register(ddp, **self.register_options)
        return ddp

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``strategy="ddp_ring"`` with Fabric (done when this module is imported)."""
        if STRATEGY_NAME not in strategy_registry:
            strategy_registry.register(
                STRATEGY_NAME, cls,
                description="DDP with the ddp_ring_hooks ring all-reduce hook, on CPU (gloo) and GPU (NCCL)",
            )


RingDDPFabricStrategy.register_strategies(STRATEGY_REGISTRY)
