"""Local ranks from the fork server (``ddp_ring_hooks.launch``): what a rank gets, and what it leaves.

1. A start that fails half-way (rank 1 cannot be sent its arguments) raises that error and
   leaves no earlier rank running: rank 0 was started and is killed.
2. Each rank sees ``LOCAL_RANK`` = its rank, as under torchrun, whatever the caller's own is
   (``spawn_ranks(backend="nccl")`` puts rank ``i`` on ``cuda:i``: the GPU test below).
3. The user's ``multiprocessing.set_forkserver_preload`` list is left as it was, and
   multiprocessing's shared fork server is not the one the ranks come from.
4. No rank runs ``fn`` before every rank's ``init_process_group`` has returned (gloo's connect
   can return on one rank while a peer still reads its handshake; a quick ``fn`` that exits then
   closed the socket under the peer: 1 start in 80 on two busy cores).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddp_ring_hooks.launch import _wait_for_every_rank, spawn_ranks


def _report_pid(path: str) -> None:
    """Runs in rank 0 as it unpickles its arguments: says which process it is."""
    Path(path).write_text(str(os.getpid()))


class _SentOnce:
    """An argument that can be sent to one rank only: rank 0 gets it (and writes its pid as it
    unpacks it); sending it to rank 1 fails, once rank 0 is surely running."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sent = False

    def __reduce__(self):
        if not self.sent:
            self.sent = True
            return _report_pid, (self.path,)
        deadline = time.monotonic() + 60
        while not Path(self.path).exists():  # rank 0 is up: the failed start comes after it
            assert time.monotonic() < deadline, "rank 0 never started"
            time.sleep(0.02)
        raise RuntimeError("this argument can be sent to one rank only")


def _never_reached(rank: int, world_size: int, argument) -> None:
    raise AssertionError("rank 1 never starts, so the group never forms")


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(120)
def test_a_start_that_fails_half_way_leaves_no_rank_running(tmp_path):
    path = str(tmp_path / "rank0.pid")
    with pytest.raises(RuntimeError, match="can be sent to one rank only"):
        spawn_ranks(_never_reached, 2, _SentOnce(path), timeout=60)
    pid = int(Path(path).read_text())
    try:
        # Rank 0 waits for rank 1 in the group's rendezvous until it is killed.
        assert not _running(pid), f"rank 0 (process {pid}) was left running after rank 1 failed to start"
    finally:
        if _running(pid):
            os.kill(pid, 9)


def _local_rank(rank: int, world_size: int) -> tuple[int, str]:
    return rank, os.environ["LOCAL_RANK"]


@pytest.mark.timeout(120)
def test_each_rank_sees_its_own_local_rank_and_the_users_preload_list_is_left_alone(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "7")  # e.g. a caller that itself runs under torchrun
    shared = multiprocessing.forkserver._forkserver
    users_preload = ["json", "__main__"]
    earlier_preload, earlier_server = list(shared._preload_modules), shared._forkserver_pid
    multiprocessing.set_forkserver_preload(users_preload)
    try:
        assert spawn_ranks(_local_rank, 3) == [(0, "0"), (1, "1"), (2, "2")]
        assert shared._preload_modules == users_preload  # a DataLoader's workers get what the user asked for
        assert shared._forkserver_pid == earlier_server  # and not a server the ranks started
    finally:
        multiprocessing.set_forkserver_preload(earlier_preload)


def _device(rank: int, world_size: int) -> int:
    return torch.cuda.current_device()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.timeout(180)
def test_nccl_ranks_each_use_their_own_gpu():
    assert spawn_ranks(_device, 2, backend="nccl") == [0, 1]


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_a_rank_waits_in_the_store_until_every_rank_has_joined(tmp_path):
    alone = dist.FileStore(str(tmp_path / "alone"), 2)
    with pytest.raises(TimeoutError, match="not every rank joined the group within 0s"):
        _wait_for_every_rank(alone, 2, 0.2)  # the other rank never counts itself
    store, other = (dist.FileStore(str(tmp_path / "pair"), 2) for _ in range(2))
    late = threading.Timer(0.5, _wait_for_every_rank, (other, 2, 10.0))  # the other rank joins late
    started = time.monotonic()
    late.start()
    try:
        _wait_for_every_rank(store, 2, 10.0)
        waited = time.monotonic() - started
    finally:
        late.join()
    assert waited >= 0.45, f"returned after {waited:.2f}s, before the other rank joined at 0.5s"
