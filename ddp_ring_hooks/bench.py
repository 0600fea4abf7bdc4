"""Time all-reduce algorithms side by side, the way nccl-tests' ``all_reduce_perf`` does.

:func:`run_sweep` runs on every rank of a process group and returns the same
:class:`BenchRecord` list everywhere (the ``ddp-ring-hooks bench`` command prints it; the
``auto`` calibration can fit the α-β model to it). For each message size, each algorithm in
turn, so a burst of noise on a shared machine hits every algorithm alike::

    for size in sizes:                  # -b 4K -e 64M -f 2: 4K, 8K, ..., 64M
        for round in rounds:            # the reported time is the median over rounds
            for algorithm in algorithms:    # ring, tree, ..., auto, native (the group's all_reduce)
                check once  ->  warm up (-w)  ->  barrier, time -n calls, slowest rank

1. **Check.** Every rank fills the buffer with its own random input and runs the algorithm
   once. An element is *wrong* when it differs from the exact sum (``dist.all_reduce`` of
   the same input in float64) by more than ``(p - 1) · eps · Σ_r |x_r|``: the rounding bound
   for adding ``p`` numbers in any order in the buffer's dtype, with ``eps`` its machine
   epsilon (twice the unit roundoff, so the bound has a 2x margin). ``#wrong`` is summed
   over ranks. On a narrower wire (``--wire-dtype bf16``) each partial sum is rounded to the
   wire dtype once per hop and the result once more: the bound is then ``p · eps_wire · Σ_r
   |x_r|`` (and at least the buffer's own).
2. **Time.** After the warm-up calls, a barrier, then ``iters`` calls back to back on the
   same buffer (in place, like nccl-tests' in-place run; the values keep growing, which costs
   nothing: float additions take the same time for any normal, infinite or NaN value).
   The time of one call is the slowest rank's (max over ranks), in microseconds.
3. **Bandwidth**, as nccl-tests defines it (GB = 1e9 bytes)::

       algbw = nbytes / time
       busbw = algbw · 2(p - 1)/p     # what each rank's link carries in a ring all-reduce

   busbw does not depend on ``p`` for an ideal ring, so it compares runs of different sizes
   and with the hardware's link speed. On a narrower wire busbw counts the bytes that crossed
   the links (``wire_bytes``, half of ``nbytes`` for bf16 of fp32), algbw the buffer's own.
4. **Link limit**, when the link's rate ``B`` is known (``--link``, or the emulated lab's
   ``DDP_RING_HOOKS_LAB_LINK``): every rank must send and receive ``2(p-1)/p · n`` bytes
   through its own link, so no all-reduce is faster than ``2(p-1)/p · n / B``
   (:func:`with_link_limit`; ``n``: the bytes on the wire). ``time / limit`` = ``link / busbw``:
   1.0 is a full link.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from .cost_model import Calibration, fit_per_algorithm
from .progress import progress_bar
from .runtime import all_reduce
from .runtime.collectives import time_calls
from .runtime.names import AUTO, NATIVE, accepted_algorithms
from .runtime.wire import bucket_bytes, wire_dtype_for
from .schedules import ALGORITHMS
from .telemetry.records import all_reduce_bus_factor, bandwidths_GBps
from .units import ELEMENT_TYPES, format_size, parse_size  # noqa: F401 - re-exported: bench.parse_size

#: Element types by the names nccl-tests' ``-d`` takes (and torch's own names).
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, dtype) for name, dtype in ELEMENT_TYPES.items()}


@dataclass(frozen=True, slots=True)
class BenchRecord:
    """One measured (algorithm, world size, message size): one row of the table."""

    algorithm: str
    world_size: int
    nbytes: int
    count: int  # elements
    dtype: str
    time_us: float  # one call, slowest rank, median over rounds
    algbw_GBps: float
    busbw_GBps: float
    wrong: int  # elements out of tolerance, summed over ranks
    link_GBps: float | None = None  # the link's rate, when known (1e9 bytes/s)
    link_limit_us: float | None = None  # 2(p-1)/p · wire bytes / link: no all-reduce is faster
    wire_bytes: int | None = None  # the bytes the transfers carry (None: nbytes, as the buffer)
    wire: str = ""  # their dtype, when narrower than the buffer's (e.g. "bfloat16")
    fastest_us: float | None = None  # one call, slowest rank, the fastest round: what the network allows

    @property
    def bytes_on_wire(self) -> int:
        """The bytes the transfers carried (``nbytes`` when the record does not say)."""
        return self.nbytes if self.wire_bytes is None else self.wire_bytes

    def as_dict(self) -> dict:
        """The record as plain JSON-ready data."""
        return asdict(self)


def size_sweep(*, begin: int, end: int, factor: int = 2) -> list[int]:
    """``begin, begin·factor, ...`` up to ``end`` (included), like nccl-tests' ``-b -e -f``."""
    if begin < 1:
        raise ValueError(f"the smallest size must be at least 1 byte, got {begin}")
    if end < begin:
        raise ValueError(f"the largest size ({end} B) is smaller than the smallest ({begin} B); swap -b and -e")
    if factor < 2:
        raise ValueError(f"the size factor must be at least 2, got {factor}")
    sizes = [begin]
    while sizes[-1] * factor <= end:
        sizes.append(sizes[-1] * factor)
    return sizes


def run_sweep(
    sizes: Iterable[int],
    *,
    algorithms: Sequence[str] | None = None,
    dtype: torch.dtype = torch.float32,
    warmup: int = 5,
    iters: int = 20,
    rounds: int = 1,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
    options: Mapping[str, Mapping] | None = None,
    progress: bool = False,
) -> list[BenchRecord]:
    """Benchmark every algorithm at every size on ``group``; call it on every rank.

    Args:
        sizes: message sizes in bytes (rounded down to whole elements; sizes smaller than
            one element are measured as one element).
        algorithms: names from :data:`ddp_ring_hooks.ALGORITHMS`, ``"auto"`` (probes once, then
            picks per size like the hook) and ``"native"``; default: all.
        options: per algorithm, options for its schedule builder (``{"hierarchical": {"local_size": 2}}``).
        progress: show a tqdm bar (pass ``True`` on one rank only).

    Returns one record per (algorithm, size), sizes ascending, in the order of ``algorithms``
    within a size; every rank gets the same records.
    """
    algorithms = list(algorithms) if algorithms is not None else [*ALGORITHMS, AUTO, NATIVE]
    check_algorithms(algorithms)
    if warmup < 0 or iters < 1 or rounds < 1:
        raise ValueError(f"need warmup >= 0, iters >= 1 and rounds >= 1; got {warmup}, {iters}, {rounds}")
    options = options or {}
    sizes = list(sizes)
    world_size = dist.get_world_size(group)
    element_size = dtype.itemsize
    callers = _callers(algorithms, group, options)
    wires = {name: wire_dtype_for(dtype, options.get(name, {})) for name in algorithms}  # refused here if not narrower
    bar = progress_bar(len(sizes) * rounds * len(algorithms), "all-reduce sweep", unit="run", enabled=progress)
    records = []
    for nbytes in sizes:
        count = max(1, nbytes // element_size)
        inputs, exact, magnitude = _make_inputs(count, dtype, device, group)
        times: dict[str, list[float]] = {name: [] for name in algorithms}
        wrong: dict[str, int] = {}
        for _ in range(rounds):
            for name in algorithms:
                call = callers[name]
                buffer = inputs.clone()
                call(buffer)
                if name not in wrong:
                    wrong[name] = _count_wrong(buffer, exact, _tolerance(magnitude, dtype, wires[name], world_size), group)
                times[name].append(time_calls(lambda: call(buffer), buffer.device, warmup=warmup, iters=iters, group=group))
                bar.set_postfix_str(f"{format_size(count * element_size)} {name}")
                bar.update()
        for name in algorithms:
            seconds = statistics.median(times[name])
            size = bucket_bytes(inputs, wires[name])
            algbw, _ = bandwidths_GBps(size.nbytes, seconds * 1e3, world_size)
            _, busbw = bandwidths_GBps(size.wire_bytes, seconds * 1e3, world_size)  # what crossed the links
            records.append(
                BenchRecord(
                    algorithm=name, world_size=world_size, nbytes=size.nbytes, count=count,
                    dtype=str(dtype).removeprefix("torch."), time_us=seconds * 1e6,
                    algbw_GBps=algbw, busbw_GBps=busbw, wrong=wrong[name],
                    wire_bytes=size.wire_bytes if wires[name] is not None else None,
                    wire=size.wire if wires[name] is not None else "",
                    fastest_us=min(times[name]) * 1e6,
                )
            )
    bar.close()
    return records


def with_link_limit(records: Sequence[BenchRecord], *, link_bits_per_s: int) -> list[BenchRecord]:
    """``records`` with the link's rate and the time limit it sets, ``2(p-1)/p · n / B`` for the
    ``n`` bytes on the wire (half the buffer's with bf16 on the wire)."""
    link_Bps = link_bits_per_s / 8
    return [
        dataclasses.replace(r, link_GBps=link_Bps / 1e9,
                            link_limit_us=all_reduce_bus_factor(r.world_size) * r.bytes_on_wire / link_Bps * 1e6)
        for r in records
    ]


def check_algorithms(algorithms: Sequence[str]) -> None:
    """Raise ``ValueError`` naming the known algorithms if one of ``algorithms`` is unknown."""
    known = accepted_algorithms()
    unknown = [name for name in algorithms if name not in known]
    if unknown:
        raise ValueError(f"unknown algorithm(s) {', '.join(map(repr, unknown))}; choose from {', '.join(known)}")
    if not algorithms:
        raise ValueError("no algorithm to benchmark; name at least one")


def _callers(algorithms: Sequence[str], group, options: Mapping[str, Mapping]) -> dict:
    """One ``call(buffer)`` per algorithm, all through :func:`~ddp_ring_hooks.all_reduce`, so
    the benchmark runs what the hook runs: ``native`` is the hook's native executor, ``auto``
    probes on its first call (the correctness check, on every rank at once) and then chooses
    per size with the hook's own :class:`~ddp_ring_hooks.runtime.selection.AutoSelector`."""
    return {
        name: functools.partial(all_reduce, algorithm=name, group=group, **options.get(name, {}))
        for name in algorithms
    }


def model_errors(
    records: Sequence[BenchRecord], options: Mapping[str, Mapping] | None = None
) -> dict[str, tuple[Calibration, float]]:
    """Per algorithm with a formula: the α, β fitted to its records and the median relative
    error of the fitted model over them, ``|predicted - measured| / measured``. ``options``
    are the per-algorithm schedule options the records were measured with (as for
    :func:`run_sweep`), so that each formula prices the schedule that ran."""
    options = options or {}
    mine = [r.as_dict() for r in records if r.algorithm in ALGORITHMS]
    errors = {}
    for algorithm, calibration in fit_per_algorithm(mine, **options).items():
        predict = functools.partial(calibration.predict, algorithm, **options.get(algorithm, {}))
        relative = [
            abs(predict(r["nbytes"], r["world_size"]) - r["time_us"] * 1e-6) / (r["time_us"] * 1e-6)
            for r in mine
            if r["algorithm"] == algorithm
        ]
        errors[algorithm] = (calibration, statistics.median(relative))
    return errors


def format_fit(algorithm: str, calibration: Calibration, error: float, *, link_GBps: float | None = None) -> str:
    """One fitted algorithm as a line: α, β, and, when the link is known, β against ``1/B``
    (``beta = 1.04/B``: each byte costs 4% more than the link's own time for it)."""
    versus_link = f" = {calibration.beta * link_GBps * 1e9:4.2f}/B" if link_GBps else ""
    return (f"{algorithm:<17} alpha {calibration.alpha * 1e6:8.1f} us  beta {calibration.beta * 1e9:7.3f} ns/B"
            f"{versus_link}  median |predicted - measured| / measured {error:6.1%}")


def _make_inputs(count: int, dtype: torch.dtype, device, group):
    """This rank's input, the exact sum over ranks (float64) and ``Σ_r |x_r|`` per element."""
    generator = torch.Generator().manual_seed(1000 + dist.get_rank())  # different on each rank
    inputs = torch.randn(count, generator=generator).to(dtype).to(device)
    exact = inputs.to(torch.float64, copy=True)  # a copy even for float64: it is reduced in place
    magnitude = inputs.abs().to(torch.float64)
    dist.all_reduce(exact, group=group)
    dist.all_reduce(magnitude, group=group)
    return inputs, exact, magnitude


def _tolerance(magnitude: torch.Tensor, dtype: torch.dtype, wire: torch.dtype | None, world_size: int) -> torch.Tensor:
    """The rounding bound per element (see the module docstring): the buffer's dtype's, or on a
    narrower wire ``p`` roundings in the wire dtype."""
    tolerance = (world_size - 1) * torch.finfo(dtype).eps * magnitude
    if wire is not None:
        tolerance = torch.maximum(tolerance, world_size * torch.finfo(wire).eps * magnitude)
    return tolerance


def _count_wrong(result: torch.Tensor, exact: torch.Tensor, tolerance: torch.Tensor, group) -> int:
    wrong = ((result.to(torch.float64) - exact).abs() > tolerance).sum().to(torch.int64).reshape(1)
    dist.all_reduce(wrong, group=group)
    return int(wrong.item())


# -- output -------------------------------------------------------------------------------


def format_table(records: Sequence[BenchRecord], *, baseline: str = NATIVE) -> str:
    """The nccl-tests style table (with the link limit and ``time / limit`` when the records know
    the link), then average busbw and busbw relative to ``baseline``."""
    limited = any(r.link_limit_us is not None for r in records)
    lines = [
        f"# {'size':>10} {'count':>11} {'algorithm':>17} {'time(us)':>11} {'algbw(GB/s)':>12} "
        f"{'busbw(GB/s)':>12} {'#wrong':>7}" + (f" {'limit(us)':>11} {'x limit':>8}" if limited else "")
    ]
    for r in records:
        lines.append(
            f"  {r.nbytes:>10} {r.count:>11} {r.algorithm:>17} {r.time_us:>11.1f} {r.algbw_GBps:>12.3f} "
            f"{r.busbw_GBps:>12.3f} {r.wrong:>7}" + (_limit_cells(r) if limited else "")
        )
    algorithms = list(dict.fromkeys(r.algorithm for r in records))
    averages = ", ".join(
        f"{name} {statistics.mean(r.busbw_GBps for r in records if r.algorithm == name):.3f}" for name in algorithms
    )
    lines.append(f"# Avg bus bandwidth (GB/s): {averages}")
    wrong = sum(r.wrong for r in records)
    lines.append(f"# Out of bounds values: {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    ratios = busbw_ratios(records, baseline=baseline)
    if ratios:
        others = [name for name in algorithms if name != baseline]
        lines.append(f"#\n# busbw / {baseline} busbw (same run, same sizes)")
        lines.append(f"# {'size':>10} " + " ".join(f"{name:>17}" for name in others))
        for nbytes in sorted({key[1] for key in ratios}):
            cells = " ".join(f"{ratios.get((name, nbytes), math.nan):>17.2f}" for name in others)
            lines.append(f"  {format_size(nbytes):>10} {cells}")
    return "\n".join(lines) + "\n"


def _limit_cells(record: BenchRecord) -> str:
    if not record.link_limit_us:  # unknown, or one rank (nothing to move)
        return f" {'-':>11} {'-':>8}"
    return f" {record.link_limit_us:>11.1f} {record.time_us / record.link_limit_us:>8.2f}"


def busbw_ratios(records: Sequence[BenchRecord], *, baseline: str = NATIVE) -> dict[tuple[str, int], float]:
    """``(algorithm, nbytes) -> busbw / baseline's busbw`` for sizes where both were measured."""
    base = {(r.world_size, r.nbytes): r.busbw_GBps for r in records if r.algorithm == baseline}
    return {
        (r.algorithm, r.nbytes): r.busbw_GBps / base[(r.world_size, r.nbytes)]
        for r in records
        if r.algorithm != baseline and base.get((r.world_size, r.nbytes))
    }


def write_json(records: Sequence[BenchRecord], path: str) -> None:
    """A JSON list with one object per record (keys: the :class:`BenchRecord` fields)."""
    with open(path, "w", encoding="utf-8") as file:
        json.dump([r.as_dict() for r in records], file, indent=1)
        file.write("\n")


def plot_busbw(records: Sequence[BenchRecord], path: str, *, title: str = "") -> None:
    """Save busbw against message size, one line per algorithm (needs matplotlib)."""
    try:
        import matplotlib
    except ImportError as error:
        raise RuntimeError("--plot needs matplotlib: pip install 'ddp_ring_hooks[viz]'") from error
    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r.algorithm for r in records):
        rows = sorted((r.nbytes, r.busbw_GBps) for r in records if r.algorithm == name)
        axes.plot([n for n, _ in rows], [b for _, b in rows], marker="o", label=name,
                  linestyle="--" if name == NATIVE else "-")
    axes.set_xscale("log", base=2)
    sizes = sorted({r.nbytes for r in records})
    axes.set_xticks(sizes, [format_size(n) for n in sizes], rotation=45)
    axes.set_xlabel("message size (bytes)")
    axes.set_ylabel("busbw (GB/s)")
    axes.set_title(title or "all-reduce bus bandwidth")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def load_records(path: str) -> list[BenchRecord]:
    """Read records written by :func:`write_json` (e.g. to calibrate the cost model)."""
    with open(path, encoding="utf-8") as file:
        return [BenchRecord(**row) for row in json.load(file)]
