"""The ``bench`` command and the executor's pipelined slices, on real gloo ranks.

- ``ddp-ring-hooks bench`` at 2 ranks, 2 sizes, through a subprocess like a user runs it:
  the JSON has the documented keys, no wrong values, busbw = algbw · 2(p-1)/p and
  algbw = nbytes / time; the plot is a PNG.
- The executor cuts big CPU chunks into pieces, one per slice, and pipelines the slices. Forcing
  tiny pieces (up to 20 slices on small tensors), every algorithm must give results *bit-identical*
  to the one-slice run and across ranks, and the observer must see the same phases and steps
  in the same order. Tolerance against ``dist.all_reduce``: the exact float64 sum within
  ``(p - 1) · eps · Σ|x_r|`` (rounding bound for ``p`` addends, 2x margin).
- Size parsing, the sweep, the link limit 2(p-1)/p · n / B and bad input (no processes).

Run: ``python -m pytest -q tests/test_bench.py``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from ddp_ring_hooks import ALGORITHMS
from ddp_ring_hooks.bench import (
    BenchRecord, busbw_ratios, format_size, format_table, load_records, parse_size, run_sweep, size_sweep,
)
from ddp_ring_hooks.cli.__main__ import main as cli_main
from ddp_ring_hooks.runtime import ExecutionObserver, run_schedule
from ddp_ring_hooks.schedules import checked_schedule
from ddp_ring_hooks.telemetry import all_reduce_bus_factor as bus_factor
from tests._dist import run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- the command ------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_bench_command_writes_checked_records_and_a_plot(tmp_path):
    json_path, plot_path = tmp_path / "bench.json", tmp_path / "bench.png"
    command = [
        sys.executable, "-m", "ddp_ring_hooks", "bench", "--nproc", "2", "-b", "4K", "-e", "64K", "-f", "16",
        "-w", "1", "-n", "2", "--algorithms", "ring,auto,native", "--json", str(json_path), "--plot", str(plot_path),
        "--no-progress", "--timeout", "120", "--link", "400Mbit",
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "busbw(GB/s)" in done.stdout and "Out of bounds values: 0 OK" in done.stdout
    assert "# link 400Mbit: limit = 2(p-1)/p * size / link" in done.stdout and "x limit" in done.stdout
    fitted = [line for line in done.stdout.splitlines() if line.startswith("#   ring ")]
    assert len(fitted) == 1 and "median |predicted - measured| / measured" in fitted[0]

    records = json.loads(json_path.read_text())
    assert [r.as_dict() for r in load_records(str(json_path))] == records  # the reader matches the writer
    assert {(r["algorithm"], r["nbytes"]) for r in records} == {
        (name, size) for name in ("ring", "auto", "native") for size in (4096, 65536)
    }
    for r in records:
        assert {"algorithm", "world_size", "nbytes", "time_us", "algbw_GBps", "busbw_GBps", "wrong"} <= r.keys()
        assert r["world_size"] == 2 and r["wrong"] == 0 and r["time_us"] > 0
        assert r["algbw_GBps"] == pytest.approx(r["nbytes"] / (r["time_us"] * 1e-6) / 1e9, rel=1e-9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (2 - 1) / 2, rel=1e-12)
        assert r["link_GBps"] == 0.05 and r["link_limit_us"] == pytest.approx(2 * (2 - 1) / 2 * r["nbytes"] / 0.05e9 * 1e6)
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(120)
def test_bench_on_one_size_skips_the_fit_and_still_writes_its_files(tmp_path):
    # One size cannot separate latency from bandwidth: the fit once raised a traceback after
    # the table, and --json and --plot were never written. (On bf16, which the records then say:
    # the same launch checks --wire-dtype, its rounding bound and its bytes on the wire.)
    json_path, plot_path = tmp_path / "one.json", tmp_path / "one.png"
    command = [
        sys.executable, "-m", "ddp_ring_hooks", "bench", "--nproc", "2", "-b", "64K", "-e", "64K", "-w", "1",
        "-n", "2", "--algorithms", "ring,native", "--json", str(json_path), "--plot", str(plot_path),
        "--no-progress", "--timeout", "60", "--wire-dtype", "bf16",
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert "# alpha-beta fit skipped: it needs 2 or more message sizes and this sweep has one (64K)" in done.stdout
    records = json.loads(json_path.read_text())
    assert {(r["algorithm"], r["nbytes"]) for r in records} == {("ring", 65536), ("native", 65536)}
    assert {(r["wire"], r["wire_bytes"], r["wrong"]) for r in records} == {("bfloat16", 32768, 0)}
    assert "# bf16 on the wire: each partial sum rounded to bf16 once per hop" in done.stdout
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.fast
def test_bench_rejects_bad_arguments_before_starting_ranks(capsys):
    assert cli_main(["bench", "-b", "64M", "-e", "4K"]) == 2
    assert "swap -b and -e" in capsys.readouterr().err
    assert cli_main(["bench", "--algorithms", "ring,rign"]) == 2
    assert "'rign'" in capsys.readouterr().err
    assert cli_main(["bench", "-b", "4 kilobytes"]) == 2
    assert "4K" in capsys.readouterr().err
    # The algorithms' options: each one's own check, and none dropped unseen.
    assert cli_main(["bench", "--algorithms", "tree", "--segments", "0"]) == 2
    assert "tree: segments=0 must be an integer >= 1" in capsys.readouterr().err
    assert cli_main(["bench", "--algorithms", "ring,native", "--segments", "2"]) == 2
    assert "--segments is an option of none of ring, native" in capsys.readouterr().err
    assert cli_main(["bench", "--link", "400Mbps"]) == 2
    assert "write bits per second like 100Mbit" in capsys.readouterr().err


@pytest.mark.fast
def test_bench_hands_each_algorithm_its_options_and_auto_all_of_them():
    from ddp_ring_hooks.cli.bench import options_per_algorithm

    given = {"segments": 3, "local_size": 2}
    assert options_per_algorithm(given, ["ring", "tree", "hierarchical", "auto"]) == {
        "ring": {}, "tree": {"segments": 3}, "hierarchical": {"local_size": 2, "segments": 3}, "auto": given,
    }


# -- pipelined slices in the executor --------------------------------------------------------


class EventLog(ExecutionObserver):
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_phase(self, phase):
        self.events.append(("phase", phase))

    def on_step(self, index, step, chunk_bytes):
        self.events.append(("step", index, tuple(chunk_bytes)))

    def on_finish(self):
        self.events.append(("finish",))


def slices_against_one_slice(rank: int, world_size: int) -> dict:
    """Every algorithm, on the world and on a 2-rank subgroup, with tiny pieces and one slice."""
    pair = dist.new_group([0, 1])
    report = {}
    for group, size in ((None, world_size), (pair, 2)):
        if group is pair and rank > 1:
            continue
        for algorithm in ALGORITHMS:
            options = {"local_size": size} if algorithm == "hierarchical" else {}
            schedule = checked_schedule(algorithm, size, **options)
            for dtype in (torch.float32, torch.bfloat16):
                for numel in (0, 1, size + 1, 1009):
                    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank * 7919 + numel)).to(dtype)
                    one_slice, many_slices = x.clone(), x.clone()
                    one_log, many_log = EventLog(), EventLog()
                    run_schedule(schedule, one_slice, group=group, observer=one_log)  # default: one slice here
                    # 200 bytes per piece: 2 to 20 slices (uneven, some empty), 2 in flight.
                    run_schedule(schedule, many_slices, group=group, observer=many_log, slice_bytes=200)
                    exact = x.double()
                    magnitude = x.double().abs()
                    dist.all_reduce(exact, group=group)
                    dist.all_reduce(magnitude, group=group)
                    bound = (size - 1) * torch.finfo(dtype).eps * magnitude
                    report[(size, algorithm, str(dtype), numel)] = (
                        torch.equal(one_slice, many_slices),
                        one_log.events == many_log.events,
                        bool(((many_slices.double() - exact).abs() <= bound).all()),
                        many_slices.view(torch.int16 if dtype == torch.bfloat16 else torch.int32).tolist(),
                    )
    try:
        run_schedule(checked_schedule("ring", world_size), torch.ones(8), slice_bytes=0)
    except ValueError as error:
        report["bad slice size"] = str(error)
    # The library entry point, as the auto calibration calls it, in the other dtypes.
    report["sweep"] = [
        record.as_dict()
        for dtype in (torch.float64, torch.float16, torch.bfloat16)
        for record in run_sweep([96, 1000], algorithms=["ring", "native"], dtype=dtype, warmup=0, iters=1)
    ]
    return report


@pytest.mark.timeout(240)
def test_slices_are_bit_identical_to_one_slice_and_across_ranks():
    reports = run_ranks(slices_against_one_slice, 3, timeout=220)
    assert "slice_bytes must be positive" in reports[0].pop("bad slice size")
    sweeps = [report.pop("sweep") for report in reports]
    assert all(sweep == sweeps[0] for sweep in sweeps), "ranks disagree on the records"
    assert {(r["algorithm"], r["dtype"], r["nbytes"]) for r in sweeps[0]} == {
        (name, dtype, nbytes) for name in ("ring", "native") for dtype in ("float64", "float16", "bfloat16")
        for nbytes in (96, 1000)
    }
    assert all(r["wrong"] == 0 and r["world_size"] == 3 for r in sweeps[0])
    assert len(reports[0]) == 2 * len(ALGORITHMS) * 2 * 4
    for case, (same_as_one_slice, same_events, within_bound, _) in reports[0].items():
        assert same_as_one_slice, f"slices changed the result: {case}"
        assert same_events, f"slices changed what the observer saw: {case}"
        assert within_bound, f"result off the exact sum: {case}"
    for case, (*_, bits) in reports[0].items():
        members = (0, 1) if case[0] == 2 else (0, 1, 2)
        assert all(reports[r][case][3] == bits for r in members), f"ranks differ: {case}"


# -- sizes and the table -----------------------------------------------------------------


@pytest.mark.fast
def test_sizes_read_and_sweep_like_nccl_tests():
    assert parse_size("4K") == 4 * 1024 and parse_size("64M") == 64 * 1024**2 and parse_size("1GiB") == 1024**3
    assert parse_size("4096") == 4096 and parse_size("8kb") == 8192
    sweep = size_sweep(begin=parse_size("4K"), end=parse_size("64M"), factor=2)
    assert sweep[0] == 4096 and sweep[-1] == 64 * 1024**2
    assert all(b == 2 * a for a, b in zip(sweep, sweep[1:]))
    assert size_sweep(begin=1000, end=5000, factor=3) == [1000, 3000]  # 9000 is past the end
    assert [format_size(n) for n in (4096, 3 * 1024**2, 1000)] == ["4K", "3M", "1000"]
    with pytest.raises(ValueError, match="factor"):
        size_sweep(begin=4, end=8, factor=1)
    with pytest.raises(ValueError, match="4096, 64K"):
        parse_size("4Q")


@pytest.mark.fast
@pytest.mark.parametrize("segments", [1, 4])
def test_model_errors_fit_each_algorithm_to_its_own_records(segments):
    from ddp_ring_hooks.bench import model_errors
    from ddp_ring_hooks.cost_model import predict

    alpha, beta = 300e-6, 1e-9
    options = {"tree": {"segments": segments}}  # what the sweep ran the tree with
    records = [
        BenchRecord(algorithm=a, world_size=4, nbytes=n, count=n // 4, dtype="float32", wrong=0,
                    time_us=predict(a, n, 4, alpha=alpha, beta=beta, **options.get(a, {})) * 1e6 * noise,
                    algbw_GBps=0.0, busbw_GBps=0.0)
        for a in ("ring", "tree") for n, noise in ((4096, 1.0), (1 << 20, 1.1), (1 << 24, 0.95), (1 << 26, 1.0))
    ] + [BenchRecord(algorithm="native", world_size=4, nbytes=4096, count=1024, dtype="float32", wrong=0,
                     time_us=1.0, algbw_GBps=0.0, busbw_GBps=0.0)]
    errors = model_errors(records, options)
    assert set(errors) == {"ring", "tree"}  # native has no formula to fit
    for calibration, median_error in errors.values():
        assert median_error < 0.06
        assert calibration.alpha == pytest.approx(alpha, rel=0.3) and calibration.beta == pytest.approx(beta, rel=0.1)


@pytest.mark.fast
def test_the_link_limit_is_what_each_rank_must_move_through_its_link():
    from ddp_ring_hooks.bench import with_link_limit

    def record(p, nbytes, time_us):
        return BenchRecord("ring", p, nbytes, nbytes // 4, "float32", time_us, 0.0, 0.0, 0)

    # 400 Mbit/s = 50e6 B/s; 16 MiB at p=4: 1.5 * 16 MiB / 50e6 B/s = 0.503 s.
    slow, one_rank = with_link_limit([record(4, 1 << 24, 600_000.0), record(1, 1 << 24, 10.0)], link_bits_per_s=400_000_000)
    assert slow.link_GBps == 0.05 and slow.link_limit_us == pytest.approx(1.5 * (1 << 24) / 50e6 * 1e6)
    assert one_rank.link_limit_us == 0.0  # nothing to move
    table = format_table([slow, one_rank])
    assert "limit(us)" in table and f"{600_000.0 / slow.link_limit_us:.2f}" in table
    assert "limit(us)" not in format_table([record(4, 1 << 24, 600_000.0)])  # link unknown: no column
    # on a narrower wire the limit is on the bytes that cross the link: half of them with bf16
    wire = dataclasses.replace(record(4, 1 << 24, 300_000.0), wire_bytes=1 << 23, wire="bfloat16")
    (limited,) = with_link_limit([wire], link_bits_per_s=400_000_000)
    assert limited.link_limit_us == pytest.approx(slow.link_limit_us / 2)


@pytest.mark.fast
def test_a_fit_reads_beta_against_the_links_own_when_the_link_is_known():
    from ddp_ring_hooks.bench import format_fit
    from ddp_ring_hooks.cost_model import Calibration

    # 400 Mbit/s: 1/B = 20 ns per byte; a beta of 20.8 ns/B is 1.04/B.
    line = format_fit("ring", Calibration(alpha=50e-6, beta=20.8e-9), 0.031, link_GBps=0.05)
    assert "alpha     50.0 us" in line and "beta  20.800 ns/B = 1.04/B" in line and "3.1%" in line
    assert " = " not in format_fit("ring", Calibration(alpha=50e-6, beta=20.8e-9), 0.031)  # link unknown


@pytest.mark.fast
def test_table_and_ratios_follow_the_definitions():
    def record(algorithm, nbytes, time_us, p=4):
        algbw = nbytes / (time_us * 1e-6) / 1e9
        return BenchRecord(algorithm, p, nbytes, nbytes // 4, "float32", time_us, algbw, algbw * bus_factor(p), 0)

    records = [record("ring", 1 << 20, 800.0), record("native", 1 << 20, 1000.0)]
    assert bus_factor(4) == 1.5 and bus_factor(1) == 0
    ratios = busbw_ratios(records)
    assert ratios == {("ring", 1 << 20): pytest.approx(1000.0 / 800.0)}
    table = format_table(records)
    assert "busbw / native busbw" in table and f"{1000.0 / 800.0:.2f}" in table
    assert math.isclose(records[0].busbw_GBps / records[0].algbw_GBps, 2 * 3 / 4)
