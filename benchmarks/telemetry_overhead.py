"""How much does per-bucket telemetry slow a DDP step? Telemetry on (log every step) vs off.

Two identical DDP models run the same ring hook; the only difference is
``register(model, log_dir=..., log_every=1)`` versus ``register(model)``. Blocks of steps
alternate between them (off, on, on, off, off, on, ...) so drifting machine load hits both
arms alike; each pair of blocks gives one ratio, and the script prints the median ratio
(target: <= 1.02; with ``--spread-every N``, which also gathers every rank's arrival every
N-th step, <= 1.03). With ``--links`` both arms log and gather with ``--spread-every N`` and
the "on" arm also times every link (``links=True``): the ratio is per-link timing's own cost
on top of the straggler gather (target: <= 1.01). A block's time includes flushing the
telemetry written during it, so the writer thread's work is charged to the telemetry arm,
not hidden in the next block. With ``--diagnose`` the "off" arm asks for nothing and the
"on" arm for ``diagnose=True`` (the straggler gather and link timing at ``spread_every="auto"``,
the watchdog): what leaving diagnosis on costs (target: <= 1.01 on loopback), with
``--algorithm ring`` or ``native``; each block waits for its exchanges too. With
``--foreign powersgd`` the arms are PyTorch's PowerSGD registered alone on DDP ("off") and the
same hook run inside ours with telemetry on (``hook=``, "on"): what timing a foreign hook costs
(target: <= 1.02), in one bucket (PowerSGD on gloo with several can hang, ``docs/hook.md``)::

    python benchmarks/telemetry_overhead.py --rounds 60 --steps 4        # spawns 2 local gloo ranks
    python benchmarks/telemetry_overhead.py --rounds 60 --steps 4 --spread-every 1
    python benchmarks/telemetry_overhead.py --rounds 60 --steps 4 --spread-every 1 --links --nproc 4
    python benchmarks/telemetry_overhead.py --rounds 60 --steps 4 --diagnose --algorithm native --nproc 4
    python benchmarks/telemetry_overhead.py --rounds 60 --steps 4 --foreign powersgd
    torchrun --nproc_per_node=2 benchmarks/telemetry_overhead.py --rounds 60 --steps 4

A block starts after a barrier; its time is the slowest rank's. With ``--breakdown`` it also
prints each thread's CPU ms per step in each arm, on rank 0: where an arm's cost goes (the
training thread, the communication workers, the exchange, the writer, gloo's own threads).

**On a network** (``--lab``, needs root): every rank on a host of an emulated lab
(``ddp_ring_hooks.lab``, a prefix of its own) over ``--link`` links (default 400 Mbit/s, as
``advisor_accuracy.py --lab``), one gloo rank per host (target with ``--diagnose``: <= 1.005)::

    python benchmarks/telemetry_overhead.py --lab --rounds 20 --steps 4 --diagnose --algorithm ring --nproc 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import ddp_ring_hooks
from ddp_ring_hooks.launch import run_on_ranks, under_torchrun
from ddp_ring_hooks.runtime import context_of
from ddp_ring_hooks.runtime.lanes import EXCHANGE
from mlp_steps import build_mlp_ddp, time_steps

TARGET = 1.02
SPREAD_TARGET = 1.03
LINKS_TARGET = 1.01
DIAGNOSE_TARGET = 1.01
#: With --lab and --diagnose: a step on a network is the link's, so diagnosis must cost less of it.
LAB_DIAGNOSE_TARGET = 1.005


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2,
                        help="local gloo ranks to spawn when not under torchrun (default: 2)")
    parser.add_argument("--rounds", type=int, default=60, help="pairs of blocks (one off, one on) (default: 60)")
    parser.add_argument("--steps", type=int, default=4, help="DDP steps per block (default: 4)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per model first (default: 3)")
    parser.add_argument("--width", type=int, default=1024, help="hidden width of the MLP (default: 1024)")
    parser.add_argument("--layers", type=int, default=6, help="hidden layers of the MLP (default: 6)")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step (default: 64)")
    parser.add_argument("--bucket-cap-mb", type=float, default=4.0, help="DDP bucket size in MiB (default: 4)")
    parser.add_argument("--spread-every", type=int, default=0,
                        help="the telemetry arm also gathers every rank's arrival every N-th step (default: 0, off)")
    parser.add_argument("--links", action="store_true",
                        help="compare per-link timing (links=True) against telemetry with the same --spread-every")
    parser.add_argument("--diagnose", action="store_true",
                        help="compare diagnose=True against nothing asked (no --spread-every, no --links)")
    parser.add_argument("--algorithm", default="ring", help="the hook's algorithm in both arms (default: ring)")
    parser.add_argument("--breakdown", action="store_true",
                        help="also print each thread's CPU ms per step in each arm (where the cost goes)")
    parser.add_argument("--foreign", choices=("powersgd",), default=None,
                        help="compare PyTorch's hook alone (off) with it inside ours, timed (on) (default: our ring)")
    lab = parser.add_argument_group("on an emulated network (needs root; see docs/lab.md)")
    lab.add_argument("--lab", action="store_true",
                     help="run every rank on a host of an emulated lab, over shaped links, instead of on loopback")
    lab.add_argument("--link", default="400Mbit", metavar="RATE", help="with --lab: every host's link (default: %(default)s)")
    lab.add_argument("--timeout", type=float, default=1800.0, metavar="SECONDS",
                     help="with --lab: give up after this long (default: %(default)s)")
    lab.add_argument("--worker", metavar="PATH", help=argparse.SUPPRESS)  # one rank on a lab host; rank 0 writes PATH
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what the lab's hosts run again
    if args.lab and args.foreign:
        parser.error("--lab measures our hook's telemetry on a network: without --foreign")
    if args.lab and not args.worker:
        from ddp_ring_hooks.lab import parse_rate

        try:
            parse_rate(args.link)  # a bad rate fails here, before any lab is made
        except ValueError as error:
            parser.error(f"--link: {error}")
    if args.diagnose and (args.links or args.spread_every):
        parser.error("--diagnose chooses its own cadence and times links: leave out --spread-every and --links")
    if args.foreign and (args.links or args.diagnose):
        parser.error("--foreign compares a hook of PyTorch's alone and timed: without --links or --diagnose")
    if args.links and args.spread_every < 1:
        parser.error("--links times links on the gathered steps: give --spread-every N too")
    return args


def measure(args: argparse.Namespace) -> dict:
    """Run on every rank: alternate blocks of the two arms; rank 0 shows progress."""
    rank = dist.get_rank()
    ratios, cpu_ratios, off_ms, on_ms, off_cpu, on_cpu = [], [], [], [], [], []
    threads_ms: dict[bool, list[dict[str, float]]] = {False: [], True: []}  # --breakdown, per block
    rounds = range(args.rounds)
    if rank == 0:
        from tqdm import tqdm

        rounds = tqdm(rounds, desc="rounds (off/on pairs)")
    with tempfile.TemporaryDirectory() as log_dir:
        arms = {}
        for telemetry in (False, True):
            # PowerSGD in one bucket (1 TiB: above any model's size), see the module docstring
            bucket_cap_mb = 1 << 20 if args.foreign else args.bucket_cap_mb
            model = build_mlp_ddp(layers=args.layers, width=args.width, bucket_cap_mb=bucket_cap_mb)
            state = attach(args, model, log_dir, on=telemetry)
            arms[telemetry] = (model, torch.optim.SGD(model.parameters(), lr=1e-3), state)
        inputs = torch.randn(args.batch, args.width)
        for telemetry, (model, optimizer, state) in arms.items():
            time_steps(model, optimizer, inputs, args.warmup, before_stop=block_end(args, state))
        for round_index in rounds:
            order = (False, True) if round_index % 2 == 0 else (True, False)
            wall, cpu = {}, {}
            for telemetry in order:
                model, optimizer, state = arms[telemetry]
                before = thread_cpu_ms() if args.breakdown else None
                wall[telemetry], cpu[telemetry] = time_steps(model, optimizer, inputs, args.steps,
                                                             before_stop=block_end(args, state))
                if before is not None:
                    threads_ms[telemetry].append(per_step(before, thread_cpu_ms(), args.steps))
            off_ms.append(wall[False])
            on_ms.append(wall[True])
            ratios.append(wall[True] / wall[False])
            cpu_ratios.append(cpu[True] / cpu[False])
            off_cpu.append(cpu[False])
            on_cpu.append(cpu[True])
        summary = arms[True][2].summary()
        for _, _, state in arms.values():
            if state is not None:
                state.close()
    return {
        "world_size": dist.get_world_size(), "summary": summary, "ratios": ratios, "cpu_ratios": cpu_ratios,
        "off_ms": off_ms, "on_ms": on_ms, "off_cpu": off_cpu, "on_cpu": on_cpu, "threads_ms": threads_ms,
    }


#: The rest of the process's CPU time: threads Python did not start (gloo's own, PyTorch's).
OTHER_THREADS = "(threads outside Python: gloo's, PyTorch's)"


def thread_cpu_ms() -> dict[str, float]:
    """CPU ms so far of every Python thread of this process, summed by thread name (the two
    arms' watchdogs share a name), and of the rest of the process (:data:`OTHER_THREADS`)."""
    import threading
    import time

    total = time.process_time() * 1e3
    spent: dict[str, float] = {}
    for thread in threading.enumerate():
        try:
            ms = time.clock_gettime(time.pthread_getcpuclockid(thread.ident)) * 1e3
        except (OSError, TypeError):  # the thread ended in between
            continue
        spent[thread.name] = spent.get(thread.name, 0.0) + ms
    spent[OTHER_THREADS] = total - sum(spent.values())
    return spent


def per_step(before: dict[str, float], after: dict[str, float], steps: int) -> dict[str, float]:
    """Each thread's CPU ms per step between two :func:`thread_cpu_ms` readings (a thread that
    started in between counts from zero; one that ended counts nothing)."""
    return {name: (ms - before.get(name, 0.0)) / steps for name, ms in after.items()
            if name != OTHER_THREADS or name in before}


def attach(args: argparse.Namespace, model, log_dir: str, *, on: bool):
    """The arm's hook on ``model``; our hook's state (``None``: PyTorch's hook alone)."""
    if args.foreign:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        hook_state = powersgd.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2)
        if not on:
            model.register_comm_hook(hook_state, powersgd.powerSGD_hook)
            return None
        options = {"log_dir": log_dir, "log_every": 1, "spread_every": args.spread_every}  # no algorithm: the hook's
        return ddp_ring_hooks.register(model, hook=powersgd.powerSGD_hook, hook_state=hook_state, **options)
    return ddp_ring_hooks.register(model, **arm_options(args, log_dir, on=on))


def arm_options(args: argparse.Namespace, log_dir: str, *, on: bool) -> dict:
    """The registration options of the "off" and "on" arms."""
    if args.diagnose:
        return {"algorithm": args.algorithm, **({"diagnose": True} if on else {})}
    telemetry = {"log_dir": log_dir, "log_every": 1, "spread_every": args.spread_every}
    if args.links:  # both arms log and gather; only "on" times links
        return {"algorithm": args.algorithm, **telemetry, "links": on}
    return {"algorithm": args.algorithm, **(telemetry if on else {})}


def block_end(args: argparse.Namespace, state):
    """What a block waits for before its clock stops: its telemetry written; with ``--links``
    also the exchanges after its steps (both arms exchange: each pays for its own)."""
    if state is None:  # PyTorch's hook alone: nothing of ours to wait for
        return lambda: None
    if not (args.links or args.diagnose):
        return state.telemetry.flush

    def flush_and_exchange() -> None:
        context_of(state.group).worker(EXCHANGE).submit(lambda: None).wait()
        state.telemetry.flush()

    return flush_and_exchange


def report(result: dict, args: argparse.Namespace) -> None:
    median = statistics.median
    print(
        f"world size {result['world_size']}, {args.layers}x{args.width} MLP, batch {args.batch}, "
        f"{args.rounds} rounds x {args.steps} steps per block, "
        + (f"algorithm {args.algorithm}, " if not args.foreign else "")
        + ("off: nothing asked; on: diagnose=True" if args.diagnose else f"spread_every={args.spread_every}")
        + (f" (off: {args.foreign} alone; on: {args.foreign} inside ours, timed)" if args.foreign else "")
        + (" (off: telemetry and the gather; on: also links=True)" if args.links else "")
    )
    print(result["summary"])
    print(f"step time off: median {median(result['off_ms']):.2f} ms; on: median {median(result['on_ms']):.2f} ms")
    print(f"ratios on/off: {' '.join(f'{r:.3f}' for r in result['ratios'])}")
    print(
        f"CPU time per step (all threads) off: median {median(result['off_cpu']):.2f} ms; "
        f"on: median {median(result['on_cpu']):.2f} ms; median ratio {median(result['cpu_ratios']):.3f}"
    )
    quartiles = statistics.quantiles(result["ratios"], n=4) if len(result["ratios"]) > 1 else result["ratios"] * 3
    print(f"ratio spread over rounds: min {min(result['ratios']):.3f}, quartiles {quartiles[0]:.3f} "
          f"{quartiles[1]:.3f} {quartiles[2]:.3f}, max {max(result['ratios']):.3f}")
    if args.breakdown:
        report_breakdown(result["threads_ms"])
    ratio = median(result["ratios"])
    target = (LAB_DIAGNOSE_TARGET if args.lab else DIAGNOSE_TARGET) if args.diagnose else LINKS_TARGET if args.links else SPREAD_TARGET if args.spread_every else TARGET
    print(f"median step-time ratio on/off: {ratio:.3f} ({'meets' if ratio <= target else 'misses'} the <= {target} target)")


def report_breakdown(threads_ms: dict[bool, list[dict[str, float]]]) -> None:
    """--breakdown: each thread's CPU ms per step on rank 0, in each arm (the mean over blocks:
    costs add up, and a small one is not lost under the median's noise), and the difference
    (what the "on" arm adds, and on which thread)."""
    names = sorted({name for blocks in threads_ms.values() for block in blocks for name in block})

    def mean_of(arm: bool, name: str) -> float:
        return statistics.fmean(block.get(name, 0.0) for block in threads_ms[arm]) if threads_ms[arm] else 0.0

    print("CPU ms per step by thread, rank 0 (mean over blocks): off, on, on - off")
    for name in [*names, "all"]:
        if name == "all":
            off, on = (sum(mean_of(arm, n) for n in names) for arm in (False, True))
        else:
            off, on = mean_of(False, name), mean_of(True, name)
        print(f"  {name:45s} {off:8.2f} {on:8.2f} {on - off:+8.2f}")


def measure_on_lab(args: argparse.Namespace) -> dict:
    """Both arms on an emulated lab of ``--nproc`` hosts on ``--link`` links: this script once
    per host (``--worker``), joined into one job; rank 0 writes the result, read back here."""
    from ddp_ring_hooks.lab import EmulatedCluster

    with tempfile.TemporaryDirectory(prefix="telemetry_overhead_") as scratch, \
            EmulatedCluster(hosts=args.nproc, link=args.link) as lab:
        out = Path(scratch) / "result.json"
        lab.run([sys.executable, str(Path(__file__).resolve()), *args.argv, "--worker", str(out)], timeout=args.timeout)
        result = json.loads(out.read_text())
    result["threads_ms"] = {arm == "true": blocks for arm, blocks in result["threads_ms"].items()}  # JSON's keys
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:  # one rank of the lab's job (the lab set torchrun's variables)
        result = run_on_ranks(measure, args, nproc=1, backend="gloo")
        if os.environ["RANK"] == "0":
            Path(args.worker).write_text(json.dumps(result))
        return 0
    if args.lab:
        result = measure_on_lab(args)
        print(f"on an emulated lab of {args.nproc} hosts on {args.link} links, one rank each")
    else:
        result = run_on_ranks(measure, args, nproc=args.nproc, backend="gloo")
    if not under_torchrun() or int(os.environ["RANK"]) == 0:  # rank 0 prints the report
        report(result, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
