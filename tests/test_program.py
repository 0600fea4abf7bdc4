"""The compiled per-rank programs: sizes like tensor_split, messages that pair up, one division each.

Pure Python: the distributed tests (test_all_reduce, test_ddp_hook) check the numbers; these
check the bookkeeping the executor trusts without looking.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from ddp_ring_hooks.runtime.program import Complete, Post, chunk_sizes, compile_program
from ddp_ring_hooks.schedules import ALGORITHMS, Op, checked_schedule
from tests.conftest import algorithm_cases

pytestmark = pytest.mark.fast  # no test here starts a process


@pytest.mark.parametrize("parts", [1, 2, 3, 7])
@pytest.mark.parametrize("numel", [0, 1, 2, 6, 7, 100003])
def test_chunk_sizes_match_tensor_split(numel, parts):
    assert chunk_sizes(numel, parts) == [t.numel() for t in torch.empty(numel).tensor_split(parts)]


def _programs(algorithm, world_size, numel, slices, window, divide=True):
    options = next(o for name, o in algorithm_cases(world_size, flat_hierarchies=True) if name == algorithm)
    schedule = checked_schedule(algorithm, world_size, **options)
    return schedule, [
        compile_program(schedule, rank, numel=numel, element_size=4, slices=slices, window=window, divide=divide)
        for rank in range(world_size)
    ]


CASES = [
    (algorithm, world_size, numel, slices, window)
    for algorithm in ALGORITHMS
    for world_size in (2, 3, 4, 6)
    for numel, slices, window in ((1, 1, 1), (5, 1, 1), (1000, 1, 1), (1000, 3, 2), (997, 4, 2), (1000, 2, 1))
]


@pytest.mark.parametrize("algorithm, world_size, numel, slices, window", CASES)
def test_every_send_meets_a_receive_of_the_same_size_in_the_same_order(algorithm, world_size, numel, slices, window):
    """gloo pairs messages first-in first-out per pair of ranks: the n-th message rank a sends
    to rank b must be the n-th that b receives from a, with the same number of elements."""
    _, programs = _programs(algorithm, world_size, numel, slices, window)
    sent, received = defaultdict(list), defaultdict(list)
    for rank, program in enumerate(programs):
        for event in program.events:
            if isinstance(event, Post):
                for message in event.unit.sends:
                    sent[rank, message.peer].append(program.piece_sizes[message.piece])
                for message in event.unit.receives:
                    received[message.peer, rank].append(program.piece_sizes[message.piece])
    assert sent == received
    assert all(size > 0 for sizes in sent.values() for size in sizes)  # empty pieces send nothing


@pytest.mark.parametrize("algorithm, world_size, numel, slices, window", CASES)
def test_every_segment_is_divided_exactly_once_when_averaging(algorithm, world_size, numel, slices, window):
    for divide in (True, False):
        _, programs = _programs(algorithm, world_size, numel, slices, window, divide=divide)
        for program in programs:
            divisions = list(program.undivided)
            for event in program.events:
                if isinstance(event, Post):
                    divisions += event.unit.divide
                elif isinstance(event, Complete):
                    divisions += [landing.message.piece for landing in event.landings if landing.divide]
            expected = sorted(s for s, size in enumerate(program.piece_sizes) if size) if divide else []
            assert sorted(divisions) == expected


@pytest.mark.parametrize("algorithm, world_size, numel, slices, window", CASES)
def test_window_and_staging_never_overlap(algorithm, world_size, numel, slices, window):
    """At most ``window`` units in flight, completed first-in first-out; staged receives in
    flight at once never share scratch, and stay inside it."""
    _, programs = _programs(algorithm, world_size, numel, slices, window)
    for program in programs:
        in_flight = []
        for event in program.events:
            if isinstance(event, Post):
                in_flight.append(event.unit)
                assert len(in_flight) <= window
                spans = sorted(
                    (m.scratch, m.scratch + program.piece_sizes[m.piece])
                    for unit in in_flight for m in unit.receives if m.scratch is not None
                )
                assert all(end <= program.scratch_numel for _, end in spans)
                assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
            elif isinstance(event, Complete):
                assert event.unit is in_flight.pop(0)
                assert {l.op for l in event.landings} <= {Op.REDUCE, Op.COPY}
        assert not in_flight


def test_bad_window_is_refused():
    schedule = checked_schedule("ring", 2)
    with pytest.raises(ValueError, match="window must be between 1 and slices"):
        compile_program(schedule, 0, numel=10, element_size=4, slices=1, window=2, divide=False)
