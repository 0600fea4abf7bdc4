"""A tiny DDP training run with the hook, launched by ``torchrun`` from the reliability tests.

Each optimizer step it checks the hook's averaged gradients against ``dist.all_reduce`` of
the same local gradients, checkpoints (model, optimizer and the pickled ``HookState``) to
``--out``, and at the end writes one ``result_rank{r}.json`` per rank. With ``--kill-rank``
and ``--kill-step``, that rank SIGKILLs itself at that step on the first attempt only, so
``torchrun --max-restarts=1`` restarts the job, which resumes from the last checkpoint::

    attempt 0:  step 0 -> ckpt 1, step 1 -> ckpt 2, step 2: rank 1 killed   (agent restarts all)
    attempt 1:  load ckpt 2 (hook state: iteration 2), step 2, step 3, ... -> results

With ``--stall-rank`` and ``--stall-step`` that rank freezes for good instead (SIGSTOP, as a
debugger, a page storm or a hung driver would stop it), on the first attempt only, after
writing ``frozen`` (its pid and the time) to ``--out``. The others' stall watchdog
(``--stall-after``, ``--stall-timeout``) fails their bucket at the timeout naming it and
sends the stopped rank SIGCONT; it runs into the aborted group and fails, everyone exits, and
the agent restarts everyone (or, without restarts, the job ends). Every rank writes
``pid_rank{r}_attempt{a}`` (its pid) when it starts, so a test can look for processes left.

Used by ``tests/test_faults.py`` (elastic restart), ``tests/test_stall.py`` (restart after a
stall) and ``tests/test_multinode.py`` (two agents, hierarchical hook).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, when not installed

import ddp_ring_hooks  # noqa: E402
from ddp_ring_hooks.hooks import ring_hook  # noqa: E402

FEATURES = 12


def torchrun_command(
    *, out: Path, port: int, nnodes: int = 1, node_rank: int = 0, nproc: int = 2,
    max_restarts: int = 0, extra: tuple[str, ...] = (),
) -> list[str]:
    """The ``torchrun`` command line that runs this script, rendezvous on loopback only."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}", "--monitor-interval=0.2",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=reliability-test",
        f"--rdzv-conf=is_host={int(node_rank == 0)},join_timeout=60", "--local-addr=127.0.0.1",
        str(Path(__file__).resolve()), f"--out={out}", *extra,
    ]


def loopback_environment() -> dict[str, str]:
    """The environment for the launch: gloo connects over the loopback interface only."""
    return {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


def env_rank_variables(rank: int, port: int, world_size: int = 2) -> dict[str, str]:
    """What one rank started as a plain process (no torchrun) needs to join its group by
    ``init_method="env://"`` on this host: the variables torchrun would set. A test that starts
    its ranks itself decides the order in which they start, fail or take a signal."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size)}


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def make_model() -> torch.nn.Module:
    """The same initial weights on every rank and in the test's reference."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))


def make_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank- and step-dependent data, reproducible after a restart."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, FEATURES, generator=generator), torch.randn(8, 3, generator=generator)


def loss_of(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    return torch.nn.functional.mse_loss(model(inputs), targets)


def uninterrupted_params(steps: int, world_size: int = 2) -> torch.Tensor:
    """The parameters after ``steps`` steps of the same training without a fault, in one
    process: the mean of the ranks' losses (what the job's averaged gradients descend)."""
    reference = make_model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(steps):
        optimizer.zero_grad()
        (sum(loss_of(reference, make_batch(step, r)) for r in range(world_size)) / world_size).backward()
        optimizer.step()
    return torch.cat([p.detach().view(-1) for p in reference.parameters()])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for checkpoint and results")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps in total")
    parser.add_argument("--algorithm", default="ring", help="hook algorithm (ring, hierarchical, ...)")
    parser.add_argument("--kill-rank", type=int, default=-1, help="rank that SIGKILLs itself (first attempt only)")
    parser.add_argument("--kill-step", type=int, default=-1, help="step at which it does")
    parser.add_argument("--stall-rank", type=int, default=-1, help="rank that freezes for good (first attempt only)")
    parser.add_argument("--stall-step", type=int, default=-1, help="step at which it does")
    parser.add_argument("--stall-after", type=float, help="the hook's stall_after (seconds)")
    parser.add_argument("--stall-timeout", type=float, help="the hook's stall_timeout (seconds)")
    return parser.parse_args()


def init_process_group(attempt: int) -> None:
    """``env://`` rendezvous with the store's keys scoped to this restart attempt.

    torchrun shares its agent's TCPStore with the workers and keeps it across restarts, so a
    restarted worker can read the address a dead worker of the previous attempt published
    and fail with "Gloo connectFullMesh failed ... Connection refused". A per-attempt prefix
    makes every attempt start from an empty key space.
    """
    store, rank, world_size = next(dist.rendezvous("env://"))
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"attempt_{attempt}", store), rank=rank, world_size=world_size
    )


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    init_process_group(attempt)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    (args.out / f"pid_rank{rank}_attempt{attempt}").write_text(str(os.getpid()))
    checkpoint = args.out / "checkpoint.pt"

    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=False)  # our own file: it holds the HookState
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        state = saved["hook_state"]
        model.register_comm_hook(state, ring_hook)
        start = saved["step"]
    else:
        watchdog = {name: value for name, value in (("stall_after", args.stall_after), ("stall_timeout", args.stall_timeout))
                    if value is not None}
        state = ddp_ring_hooks.register(model, algorithm=args.algorithm, **watchdog)
        start = 0
    resumed_iteration = state.iteration

    reference = make_model()  # gradients from dist.all_reduce, for comparison
    worst_error = 0.0
    for step in range(start, args.steps):
        if attempt == 0 and rank == args.kill_rank and step == args.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if attempt == 0 and rank == args.stall_rank and step == args.stall_step:
            time.sleep(0.5)  # its watchdog (polling every stall_after / 10) has published that much
            (args.out / "frozen").write_text(f"{os.getpid()} {time.time()!r}")
            os.kill(os.getpid(), signal.SIGSTOP)  # until the others' watchdog continues it
        batch = make_batch(step, rank)
        optimizer.zero_grad()
        loss_of(model, batch).backward()

        reference.load_state_dict(model.module.state_dict())
        reference.zero_grad()
        loss_of(reference, batch).backward()
        for mine, theirs in zip(model.parameters(), reference.parameters()):
            dist.all_reduce(theirs.grad)
            worst_error = max(worst_error, (mine.grad - theirs.grad / world_size).abs().max().item())

        optimizer.step()
        if rank == 0:  # write then rename: a kill never leaves half a checkpoint
            payload = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                       "hook_state": state, "step": step + 1}
            torch.save(payload, checkpoint.with_suffix(".tmp"))
            os.replace(checkpoint.with_suffix(".tmp"), checkpoint)
        dist.barrier()  # nobody starts step + 1 before checkpoint step + 1 is on disk

    result = {
        "rank": rank,
        "world_size": world_size,
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "node": int(os.environ["GROUP_RANK"]),
        "attempt": attempt,
        "resumed_from": start,
        "resumed_iteration": resumed_iteration,
        "iteration": state.iteration,
        "algorithm": state.algorithm,
        "hook": model._get_ddp_logging_data().get("comm_hook"),
        "worst_grad_error": worst_error,
        "params": torch.cat([p.detach().view(-1) for p in model.parameters()]).tolist(),
    }
    (args.out / f"result_rank{rank}.json").write_text(json.dumps(result))
    state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
