"""``wire_dtype`` without processes: the compiled programs' casts, the cost model, and every door.

The distributed checks (bit-identical ranks, the bound, native against PyTorch) are in
``test_wire.py``; these check the bookkeeping the executor trusts, the prices, and that the one
``Option`` in the registry reaches every place an option reaches (``test_add_an_option.py``'s
way, for a real option).
"""

from __future__ import annotations

import random
import re

import pytest

from ddp_ring_hooks import HookState
from ddp_ring_hooks.cli.__main__ import build_parser, main
from ddp_ring_hooks.cost_model import Links, TwoTier, coefficients, predict, simulate
from ddp_ring_hooks.runtime.program import Complete, Post, compile_program
from ddp_ring_hooks.schedules import (
    ALGORITHMS, Op, algorithm_names, build_schedule, checked_schedule, get_algorithm, resolve_options, with_wire,
)
from ddp_ring_hooks.telemetry import BucketRecord, StepRecord, SummaryTable
from tests.conftest import algorithm_cases

N = 64 << 20

pytestmark = pytest.mark.fast


def _walk(program) -> dict:
    """Replay a wire program's bookkeeping from its events, independently of the compiler:
    per piece, whether its image is current, and how it ended."""
    imaged, final = set(), {}
    failures = []
    for event in program.events:
        if isinstance(event, Post):
            cast = {c.piece for c in event.unit.casts}
            for message in event.unit.sends:
                if message.piece not in imaged and message.piece not in cast:
                    failures.append(f"step {event.unit.step}: piece {message.piece} sent from a stale image")
            for c in event.unit.casts:
                imaged.add(c.piece)
                if c.round_back:
                    final[c.piece] = "rounded back"
        elif isinstance(event, Complete):
            for landing in event.landings:
                piece = landing.message.piece
                if landing.op is Op.COPY:
                    imaged.add(piece)
                    final[piece] = "copied"
                else:
                    imaged.discard(piece)
                    final.pop(piece, None)
    for c in program.unrounded:
        if c.piece in final:
            failures.append(f"piece {c.piece} rounded at the end but already {final[c.piece]}")
        final[c.piece] = "rounded at the end"
    live = {piece for piece, size in enumerate(program.piece_sizes) if size}
    if set(final) != live:
        failures.append(f"pieces left unrounded: {sorted(live - set(final))}")
    return {"failures": failures, "final": final}


@pytest.mark.parametrize("world_size", [2, 3, 4, 6])
@pytest.mark.parametrize("numel, slices, window", [(1, 1, 1), (7, 1, 1), (1000, 3, 2), (997, 4, 2)])
def test_every_wire_program_sends_current_images_and_ends_on_the_wire(world_size, numel, slices, window):
    """Each send reads an image cast since the piece last changed (or copied in); every piece
    ends holding a wire value (copied, rounded back when final, or rounded at the end), once;
    and the first rounding of each piece is marked first (the residual is written, not added)."""
    for algorithm, options in algorithm_cases(world_size, flat_hierarchies=True):
        schedule = checked_schedule(algorithm, world_size, wire_dtype="bf16", **options)
        for rank in range(world_size):
            program = compile_program(schedule, rank, numel=numel, element_size=2, slices=slices, window=window,
                                      divide=True, wire=True)
            walked = _walk(program)
            assert not walked["failures"], (algorithm, options, rank, walked["failures"])
            casts = [c for e in program.events if isinstance(e, Post) for c in e.unit.casts] + list(program.unrounded)
            firsts = [c.piece for c in casts if c.first]
            assert len(firsts) == len(set(firsts)) and set(firsts) == {c.piece for c in casts}
            assert set(program.unresidual) == set(walked["final"]) - set(firsts)


def test_without_a_narrower_wire_the_program_is_the_one_it_always_was():
    for algorithm in ALGORITHMS:
        options = {"local_size": 2} if algorithm == "hierarchical" else {}
        schedule = checked_schedule(algorithm, 4, **options)
        program = compile_program(schedule, 1, numel=1000, element_size=4, slices=3, window=2, divide=True)
        assert not program.wire and program.unrounded == () and program.unresidual == ()
        assert all(not e.unit.casts for e in program.events if isinstance(e, Post))
        # the same schedule with a narrower wire: the same steps, the same chunks
        narrow = checked_schedule(algorithm, 4, wire_dtype="fp16", **options)
        assert narrow.steps == schedule.steps and narrow.num_chunks == schedule.num_chunks


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 8, 12])
def test_a_narrower_wire_halves_the_bytes_and_adds_two_casts_in_formula_and_schedule_alike(world_size):
    rng = random.Random(world_size)
    for algorithm, options in algorithm_cases(world_size):
        alpha, beta, gamma = rng.uniform(1e-6, 1e-4), rng.uniform(1e-11, 1e-9), rng.uniform(0, 1e-10)
        for wire in ("bf16", "fp16"):
            on_wire = with_wire(options, wire)
            # bandwidth only: exactly half; latency only: the same; gamma: the casts, 2n of them
            assert predict(algorithm, N, world_size, alpha=0, beta=beta, **on_wire) == pytest.approx(
                predict(algorithm, N, world_size, alpha=0, beta=beta, **options) / 2, rel=1e-12)
            assert predict(algorithm, N, world_size, alpha=alpha, beta=0, **on_wire) == pytest.approx(
                predict(algorithm, N, world_size, alpha=alpha, beta=0, **options), rel=1e-12)
            extra = predict(algorithm, N, world_size, alpha=0, beta=0, gamma=gamma, **on_wire) - predict(
                algorithm, N, world_size, alpha=0, beta=0, gamma=gamma, **options)
            assert extra == pytest.approx(2 * N * gamma, rel=1e-9)
            # step by step, the schedule carrying its wire: the same rule
            schedules = {w: build_schedule(algorithm, world_size, **with_wire(options, w)) for w in ("fp32", wire)}
            assert simulate(schedules[wire], N, alpha=0, beta=beta) == pytest.approx(
                simulate(schedules["fp32"], N, alpha=0, beta=beta) / 2, rel=1e-12)
            assert simulate(schedules[wire], N, alpha=0, beta=0, gamma=gamma) - simulate(
                schedules["fp32"], N, alpha=0, beta=0, gamma=gamma) == pytest.approx(2 * N * gamma, rel=1e-9)
    assert coefficients("ring", 4, wire_dtype="bf16") == (6, 0.75, 0.75)  # (messages, bytes, reduced) per byte


def test_two_tiers_and_auto_price_the_wire_bytes_but_auto_never_picks_a_wire():
    from ddp_ring_hooks.runtime.selection import AutoSelector

    lab = TwoTier(Links(200e-6, 1 / 50e6, local=Links(50e-6, 1 / 1e9)), ranks_per_node=2)
    for algorithm in ("ring", "hierarchical", "tree"):
        options = {"local_size": 2} if algorithm == "hierarchical" else {}
        fp32 = lab.predict(algorithm, 16 << 20, 4, **options)
        bf16 = lab.predict(algorithm, 16 << 20, 4, wire_dtype="bf16", **options)
        assert 0.45 < bf16 / fp32 < 0.55, algorithm  # bandwidth-bound: half, less the latencies
    chosen = AutoSelector(None, 4, network=lab, local_size=2, wire_dtype="bf16").choose(16 << 20)
    assert chosen[0] == "hierarchical" and chosen[1]["wire_dtype"] == "bf16"


def _help(command: str) -> str:
    subcommands = build_parser()._subparsers._group_actions[0].choices
    return " ".join(subcommands[command].format_help().split())


@pytest.mark.parametrize("command", ["explain", "animate", "model", "bench"])
def test_wire_dtype_is_a_flag_of_every_command_that_takes_options(command):
    takers = [name for name in algorithm_names() if "wire_dtype" in get_algorithm(name).option_names]
    assert takers == list(algorithm_names())  # every algorithm, native included
    assert re.search(r"--wire-dtype fp32\|bf16\|fp16 ring, .*native only: what the transfers carry.*\(default: fp32\)",
                     _help(command)), _help(command)


def test_model_labels_and_prices_the_wire_and_explain_says_what_travels(capsys):
    assert main(["model", "--world-sizes", "4", "--algorithms", "ring,tree", "--size", "16M",
                 "--bandwidth", "50MB/s", "--wire-dtype", "bf16"]) == 0
    table = capsys.readouterr().out
    for algorithm in ("ring", "tree"):
        cell = re.search(rf"^{algorithm} \(bf16 on the wire\)\s+(\S+ \S+)$", table, re.M)
        assert cell, table
    assert main(["model", "--wire-dtype", "bf8"]) == 2
    assert "wire_dtype='bf8' is not a wire dtype" in capsys.readouterr().err
    assert main(["explain", "--algorithm", "halving_doubling", "--world-size", "4", "--wire-dtype", "fp16"]) == 0
    assert "fp16 on the wire: every chunk travels as fp16 (2 bytes per element, 0.50x the bytes" in capsys.readouterr().out


@pytest.mark.parametrize("algorithm", algorithm_names())
def test_hook_state_takes_the_wire_for_every_algorithm(algorithm, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    state = HookState(algorithm=algorithm, wire_dtype="fp16", error_feedback=True)
    assert state.algorithm_options["wire_dtype"] == "fp16" and state.plan.feedback is not None
    assert resolve_options(algorithm, {})["wire_dtype"] == "fp32"  # the default: as the bucket is


def test_auto_refuses_error_feedback_without_a_wire_before_it_probes():
    # (auto's candidates take the wire: test_auto.py; the refusal comes before any process group is asked)
    with pytest.raises(ValueError, match="error_feedback=True keeps what rounding.*the auto algorithm"):
        HookState(algorithm="auto", error_feedback=True)


def test_the_lightning_strategy_checks_the_wire_options_when_built():
    pytest.importorskip("lightning")
    from ddp_ring_hooks.integrations.lightning import RingDDPStrategy

    with pytest.raises(ValueError, match="ring: wire_dtype='bf8' is not a wire dtype"):
        RingDDPStrategy("ring", algorithm_options={"wire_dtype": "bf8"})
    with pytest.raises(ValueError, match="error_feedback=True keeps what rounding"):
        RingDDPStrategy("ring", error_feedback=True)
    strategy = RingDDPStrategy("native", algorithm_options={"wire_dtype": "bf16"}, error_feedback=True)
    assert strategy.register_options == {"algorithm": "native", "algorithm_options": {"wire_dtype": "bf16"},
                                         "error_feedback": True}


def _record(wire: str | None, nbytes: int = 4000) -> StepRecord:
    bucket = BucketRecord(
        step=1, index=0, nbytes=nbytes, numel=nbytes // 4, dtype="float32", algorithm="ring", world_size=2,
        queue_ms=0.0, time_ms=1.0, phases_ms={}, algbw_GBps=0.0, busbw_GBps=0.0,
        wire_bytes=None if wire is None else nbytes // 2, wire=wire or "",
    )
    return StepRecord(step=1, buckets=(bucket,), total_ms=1.0, exposed_ms=0.5, num_buckets=1)


def test_the_summary_says_what_travels_only_when_it_is_narrower():
    table = SummaryTable()
    table.write(_record("bfloat16"))
    assert "  bf16 on the wire: 0.50x the bytes (busbw counts the bytes on the wire)" in table.render().splitlines()
    plain = SummaryTable()
    plain.write(_record(None))
    assert "on the wire" not in plain.render()
    assert _record(None).buckets[0].bytes_on_wire == 4000 and _record("bfloat16").buckets[0].wire_ratio == 0.5
