"""Find the ``DistributedDataParallel`` inside the model a framework hands back.

Frameworks build the DDP model for the user and give back something around it::

    torch.compile(ddp)               OptimizedModule  ._orig_mod        -> DDP
    fabric.setup(model)              _FabricModule    ._forward_module  -> DDP (or OptimizedModule -> DDP)
    accelerator.prepare(model)       DDP, or OptimizedModule -> DDP with a dynamo backend
    trainer.model_wrapped (HF)       DDP, or OptimizedModule -> DDP with torch_compile=True

Each wrapper is an ``nn.Module`` that holds the DDP as a submodule, so one walk over the
submodules finds it without knowing any framework: :func:`find_ddp` goes down from the
model, stops at each DDP it meets (a DDP's own submodules are the user's model) and wants
exactly one. When there is none it says what it found instead (FSDP, ``DataParallel``, a
single process that nobody wrapped), because that is where the fix lies. And the DDP it found
must hold every trainable parameter of the model: ``nn.Sequential(DDP(a), nn.Linear(4, 4))``
trains the second layer on each rank's own gradients, never averaged, so the ranks drift apart
without a word; that is refused, naming the parameters and the fix.
"""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel


def find_ddp(model: object) -> DistributedDataParallel:
    """``model`` itself if it is a DDP model, else the one DDP model inside it.

    Raises ``TypeError`` for something that is not a module, ``ValueError`` when the module
    holds no DDP model or more than one; each message names what was found and the fix.
    """
    if isinstance(model, DistributedDataParallel):
        return model
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"register needs the DDP model: a DistributedDataParallel, or a module that wraps one "
            f"(torch.compile's OptimizedModule, Fabric's module, what accelerator.prepare returns); got "
            f"{type(model).__name__}, which is not a torch.nn.Module"
            + ("; for a transformers Trainer use ddp_ring_hooks.integrations.transformers.RingHookCallback"
               if hasattr(model, "model_wrapped") else "")
        )
    found = _outermost_ddps(model)
    if len(found) > 1:
        paths = ", ".join(repr(path) for path, _ in found)
        raise ValueError(
            f"{type(model).__name__} holds {len(found)} DistributedDataParallel models ({paths}); DDP keeps one "
            f"hook per model, so register each one: register(model.get_submodule({found[0][0]!r}))"
        )
    if not found:
        raise ValueError(f"found no DistributedDataParallel in {_described(model)}; {_advice_for(model)}")
    path, ddp = found[0]
    _check_holds_every_parameter(model, path, ddp)
    return ddp


def _check_holds_every_parameter(model: nn.Module, path: str, ddp: DistributedDataParallel) -> None:
    """Refuse a model with trainable parameters outside the DDP at ``path``: nothing averages
    their gradients (wrappers that share the DDP's parameters, like ``torch.compile``'s, pass)."""
    inside = {id(parameter) for parameter in ddp.parameters()}
    outside = [name for name, parameter in model.named_parameters() if parameter.requires_grad and id(parameter) not in inside]
    if outside:
        shown = ", ".join(outside[:4]) + (f" and {len(outside) - 4} more" if len(outside) > 4 else "")
        raise ValueError(
            f"{type(model).__name__} has trainable parameters outside the DistributedDataParallel at {path!r} "
            f"({shown}): their gradients would never be averaged across ranks, and the ranks would drift apart; "
            "wrap the whole model in one DistributedDataParallel (DDP(nn.Sequential(...)), not nn.Sequential(DDP(...), ...)), "
            "or freeze those parameters (requires_grad_(False))"
        )


def _outermost_ddps(model: nn.Module) -> list[tuple[str, DistributedDataParallel]]:
    """``(path, ddp)`` of every DDP model under ``model`` that no other DDP holds, each once
    (Fabric's module reaches the same DDP by two attributes when compiled)."""
    found: list[tuple[str, DistributedDataParallel]] = []
    seen: set[int] = set()
    pending = [("", model)]
    while pending:
        path, module = pending.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        if isinstance(module, DistributedDataParallel):
            found.append((path, module))
            continue  # below a DDP is the user's model
        pending += [(f"{path}.{name}" if path else name, child) for name, child in module.named_children()]
    return sorted(found, key=lambda item: item[0])


def _described(model: nn.Module) -> str:
    """``OptimizedModule(GPT2LMHeadModel)``: the model, and inside it each module that is the
    only child of the one before (the chain of wrappers)."""
    chain = [type(model).__name__]
    while len(children := list(model.children())) == 1:
        model = children[0]
        chain.append(type(model).__name__)
    return "(".join(chain) + ")" * (len(chain) - 1)


def _advice_for(model: nn.Module) -> str:
    """Where the fix lies, by what the model is instead of DDP."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    modules = list(model.modules())
    if any(isinstance(module, nn.DataParallel) for module in modules):
        return (
            "nn.DataParallel runs one process and calls no communication hook: use "
            "DistributedDataParallel, one process per device (torchrun)"
        )
    if any(isinstance(module, (FSDPModule, FullyShardedDataParallel)) for module in modules):
        return (
            "it is sharded by FSDP, which reduces gradients itself (there are no DDP buckets to hand to a "
            "hook); ring_hook works with DistributedDataParallel only"
        )
    if not (dist.is_available() and dist.is_initialized()):
        return (
            "torch.distributed is not initialized, so this is a single process and nothing wrapped the "
            "model in DDP: launch 2 or more processes (torchrun, accelerate launch)"
        )
    return (
        "wrap it first: DistributedDataParallel(model); where a framework wraps it (accelerator.prepare, "
        "fabric.setup, the transformers Trainer), register what the framework returns. A framework that "
        "leaves it unwrapped runs each process on its own (Accelerate does on CPU unless Accelerator(cpu=True))"
    )
