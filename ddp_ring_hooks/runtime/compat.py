"""Every call whose signature depends on the torch version, in one place.

The package needs ``torch>=2.6`` (``pyproject.toml``): that is the first release whose
``P2POp`` takes ``group_peer=`` and whose ``broadcast`` takes ``group_src=``, i.e. ranks *of
the group*, which is what schedules speak (so subgroups work without translating to global
ranks). On 2.4/2.5 these keywords raise ``TypeError`` only on the first CUDA bucket (the gloo
path calls the group's own ``send``/``recv``), so the floor is checked here at import.
"""

from __future__ import annotations

import datetime

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


def broadcast_from_first(tensor: torch.Tensor, *, group: dist.ProcessGroup | None) -> None:
    """Broadcast ``tensor`` from the group's rank 0 (not global rank 0)."""
    dist.broadcast(tensor, group=group, group_src=0)


def gloo_options_like(group: dist.ProcessGroup) -> dist.ProcessGroupGloo._Options:
    """Options for another gloo backend beside ``group``'s: the same devices (so its sockets
    join the same event-loop thread; the default device when the group has no gloo), the same
    timeout, one worker thread (callers that only send and receive set none). Where this torch
    does not expose a backend's options (``Backend.options`` is recent), the default device and
    timeout."""
    options = dist.ProcessGroupGloo._Options()
    existing = _backend_options(group, "cpu")
    devices = getattr(existing, "_devices", None)
    options._devices = devices if devices else [dist.ProcessGroupGloo.create_default_device()]
    options._timeout = group_timeout(group)
    options._threads = 1
    return options


def group_timeout(group: dist.ProcessGroup) -> datetime.timedelta:
    """``group``'s own timeout (``init_process_group(timeout=...)``, or its backend's default),
    read from the backend of either device; torch's default when no backend says."""
    for device in ("cpu", "cuda"):
        timeout = getattr(_backend_options(group, device), "_timeout", None)
        if timeout is not None:
            return timeout
    return dist.default_pg_timeout


def _backend_options(group: dist.ProcessGroup, device: str):
    try:
        return getattr(group._get_backend(torch.device(device)), "options", None)
    except (AttributeError, RuntimeError, ValueError):  # no backend for that device (or a custom one)
        return None


def group_store(group: dist.ProcessGroup) -> dist.Store:
    """The store ``group`` was made on (prefixed by the group's name)."""
    return dist.distributed_c10d._get_process_group_store(group)


def unregistered_group(
    store: dist.Store, rank: int, size: int, *, backend: str, like: dist.ProcessGroup
) -> dist.ProcessGroup:
    """A process group of ``size`` ranks with one ``backend`` (``"gloo"`` for CPU tensors or
    ``"nccl"`` for CUDA ones) on ``store``, with ``like``'s timeout (gloo: its devices too),
    made the way c10d makes one inside ``new_group`` but never registered with c10d: it takes
    no name from c10d's counters (see :func:`~.group_context.side_group`). Its own methods
    (``send``, ``recv``, ``allgather``, coalescing) and ``dist.all_gather`` work on it;
    ``dist`` calls that look a group up (``get_rank``, ``P2POp``) do not."""
    group = dist.ProcessGroup(store, rank, size)
    if backend == "gloo":
        made, kind, device = dist.ProcessGroupGloo(store, rank, size, gloo_options_like(like)), "GLOO", "cpu"
    elif backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        gloo_side = gloo_options_like(like)  # its timeout is the group's (NCCL's own options may not be exposed)
        options._timeout = gloo_side._timeout
        made, kind, device = dist.ProcessGroupNCCL(store, rank, size, options), "NCCL", "cuda"
    else:
        raise ValueError(f"a side group is made on gloo or nccl, not {backend!r}")
    backend_type = getattr(dist.ProcessGroup.BackendType, kind)
    group._set_default_backend(backend_type)
    group._register_backend(torch.device(device), backend_type, made)
    return group


def batched_p2p(carrier: dist.ProcessGroup, device: torch.device, posts) -> list[dist.Work]:
    """Start ``posts`` (``(is_receive, tensor, peer)``, peers in ``carrier``'s ranks) as one
    coalesced batch, as ``dist.batch_isend_irecv`` does (torch's ``_coalescing_manager``), on any
    group, registered with c10d or not (a side group is not); NCCL then launches them as one
    group call, so no order of sends and receives can deadlock."""
    carrier._start_coalescing(device)
    try:
        for is_receive, tensor, peer in posts:
            (carrier.recv if is_receive else carrier.send)([tensor], peer, 0)
    finally:
        work = carrier._end_coalescing(device)
    return [work] if work is not None else []
