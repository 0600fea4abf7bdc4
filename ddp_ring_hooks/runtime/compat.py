"""Every call whose signature depends on the torch version, in one place.

The package needs ``torch>=2.6`` (``pyproject.toml``): that is the first release whose
``P2POp`` takes ``group_peer=`` and whose ``broadcast`` takes ``group_src=``, i.e. ranks *of
the group*, which is what schedules speak (so subgroups work without translating to global
ranks). On 2.4/2.5 these keywords raise ``TypeError`` only on the first CUDA bucket (the gloo
path calls the group's own ``send``/``recv``), so the floor is checked here at import.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

MIN_TORCH = (2, 6)


def _version_tuple(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


if _version_tuple(torch.__version__) < MIN_TORCH:  # pragma: no cover - the floor of pyproject.toml
    raise ImportError(
        f"ddp_ring_hooks needs torch>={MIN_TORCH[0]}.{MIN_TORCH[1]} (P2POp(group_peer=), "
        f"broadcast(group_src=)); this is torch {torch.__version__}: pip install -U 'torch>=2.6'"
    )


def p2p_op(op, tensor: torch.Tensor, *, group: dist.ProcessGroup, peer: int) -> dist.P2POp:
    """A ``P2POp`` to ``peer``, a rank of ``group``."""
    return dist.P2POp(op, tensor, group=group, group_peer=peer)


def broadcast_from_first(tensor: torch.Tensor, *, group: dist.ProcessGroup | None) -> None:
    """Broadcast ``tensor`` from the group's rank 0 (not global rank 0)."""
    dist.broadcast(tensor, group=group, group_src=0)


def gloo_options_like(group: dist.ProcessGroup) -> dist.ProcessGroupGloo._Options:
    """Options for another gloo backend beside ``group``'s: the same devices (so its sockets
    join the same event-loop thread), the same timeout, one worker thread (point-to-point
    never uses them). Where this torch does not expose a backend's options
    (``Backend.options`` is recent), the default device and timeout."""
    options = dist.ProcessGroupGloo._Options()
    existing = getattr(group._get_backend(torch.device("cpu")), "options", None)
    options._devices = existing._devices if existing is not None else [dist.ProcessGroupGloo.create_default_device()]
    options._timeout = existing._timeout if existing is not None else dist.default_pg_timeout
    options._threads = 1
    return options


def group_store(group: dist.ProcessGroup) -> dist.Store:
    """The store ``group`` was made on (prefixed by the group's name)."""
    return dist.distributed_c10d._get_process_group_store(group)
