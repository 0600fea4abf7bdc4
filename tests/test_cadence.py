"""The cadence of gathered steps and the one switch ``diagnose=True``, without ranks.

- ``spread_every=N`` gathers every N-th step; ``"auto"`` gathers the warm-up's steps, then as
  often as keeps the measured cost within BUDGET (0.35%: under the lab's 0.5% target) of a step, applying each decision ``LAG`` gathers
  later, the same answer for a step whoever asks; a decision that never comes stops gathering
  with a warning instead of hanging the hook thread; a broken exchange stops it at once.
- ``diagnose=True`` is the straggler gather and link timing at ``"auto"`` (a given cadence
  kept), refused when it is not a bool, and taken at every door (``register``'s checks, the
  Lightning and Fabric strategies, the transformers callback), refused there at construction.
- What a gathered step costs on threads besides the exchange is priced too: the writer's records
  and the hook thread's marked buckets are charged, and the next exchange's cost carries them.
- The probe under ``native`` is big enough to be judged and to get past the lab shaper's burst.
"""

from __future__ import annotations

import math
import threading
from types import SimpleNamespace

import pytest

from ddp_ring_hooks.telemetry import cadence as cadence_module
from ddp_ring_hooks.telemetry.cadence import BUDGET, LAG, MAX_GAP, WARMUP, Cadence, CadenceRecord, gap_for
from ddp_ring_hooks.telemetry.options import TelemetryOptions

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("cost_ms, step_ms, gap", [
    (0.35, 100.0, 1),  # the budget, 0.35% of a step: every step
    (3.5, 100.0, 10),  # 3.5%: every 10th costs 0.35%
    (3.51, 100.0, 11),  # just above: rounded up, never over budget
    (1e6, 100.0, MAX_GAP),  # a slow link is still named within 12 gathers of MAX_GAP
    (5.0, 0.0, 1),  # no step timed yet
    (math.nan, 100.0, 1),  # the cost of a rank whose marks never completed
])
def test_the_gap_keeps_the_cost_within_the_budget(cost_ms, step_ms, gap):
    assert gap_for(cost_ms, step_ms) == gap
    if 1 < gap < MAX_GAP:
        assert cost_ms / gap <= BUDGET * step_ms < cost_ms / (gap - 1)


def test_a_fixed_cadence_gathers_every_nth_step_and_zero_never():
    assert [s for s in range(1, 13) if Cadence(3).gathers(s)] == [3, 6, 9, 12]
    assert not any(Cadence(0).gathers(s) for s in range(1, 13))
    assert Cadence(3).row() == ()


def _run(cadence: Cadence, steps: int, *, cost_ms: float, step_ms: float, world_size: int = 3) -> list[int]:
    """The hook thread asking about each step in turn, and every gathered step's exchange
    deciding at once (as the exchange worker would, every rank with the same rows)."""
    gathered = []
    for step in range(1, steps + 1):
        if cadence.gathers(step):
            gathered.append(step)
            cadence.decide([[cost_ms * (1 + rank / 10), step_ms] for rank in range(world_size)])
    return gathered


def test_auto_gathers_the_warm_up_then_as_often_as_the_cost_allows():
    cadence = Cadence("auto")
    gathered = _run(cadence, 200, cost_ms=2.9, step_ms=100.0)  # the costliest rank's: 3.48 ms -> every 10th
    assert gathered[:WARMUP] == list(range(1, WARMUP + 1))
    gaps = [b - a for a, b in zip(gathered, gathered[1:])]
    assert set(gaps[WARMUP + LAG:]) == {10}, gaps
    # Past the warm-up the gathers cost at most the budget of the steps they are spread over.
    later = [s for s in gathered if s > WARMUP + 10 * LAG]
    assert len(later) * 3.48 <= BUDGET * 100.0 * (200 - WARMUP - 10 * LAG) + 3.48
    # Any thread asking later gets the hook thread's answer.
    assert [s for s in range(1, 201) if cadence.gathers(s)] == gathered
    line = cadence.summary_line()
    assert f"{len(gathered)} of 200 steps gathered, now every 10th step" in line, line
    assert "named within 120 steps" in line, line


def test_cheap_gathers_stay_on_every_step():
    assert _run(Cadence("auto"), 40, cost_ms=0.2, step_ms=100.0) == list(range(1, 41))


def test_a_decision_that_never_comes_stops_gathering_with_a_warning(monkeypatch):
    monkeypatch.setattr(cadence_module, "DECISION_WAIT_S", 0.05)
    cadence = Cadence("auto")
    assert all(cadence.gathers(s) for s in range(1, WARMUP + 1))  # no exchange decided anything
    with pytest.warns(UserWarning, match="gathers no more"):
        assert cadence.gathers(WARMUP + 1)
    assert not any(cadence.gathers(s) for s in range(WARMUP + 2, WARMUP + 200))


def test_a_broken_exchange_releases_a_waiting_hook_thread():
    cadence = Cadence("auto")
    for step in range(1, WARMUP + 1):
        cadence.gathers(step)
    answer = []
    waiting = threading.Thread(target=lambda: answer.append(cadence.gathers(WARMUP + 1)))
    waiting.start()
    cadence.stop()
    waiting.join(timeout=5)
    assert not waiting.is_alive() and answer == [True]
    assert not any(cadence.gathers(s) for s in range(WARMUP + 2, WARMUP + 100))


def test_charges_from_other_threads_ride_in_the_next_exchanges_cost():
    cadence = Cadence("auto")
    cadence.charge(0.25)
    cadence.charge(0.5)
    cadence.spent(1.0)
    assert cadence.row()[0] == pytest.approx(1.75)
    cadence.spent(1.0)  # charged once: the next exchange starts from nothing
    assert cadence.row()[0] == pytest.approx(1.0)
    fixed = Cadence(3)
    fixed.charge(5.0)  # a fixed cadence prices nothing
    assert fixed.row() == ()


def _charged(cadence: Cadence) -> float:
    cadence.spent(0.0)
    return cadence.row()[0]


def test_the_writer_and_the_hook_thread_charge_gathered_steps_to_the_cadence():
    import torch

    from ddp_ring_hooks.telemetry.observation import Observation
    from ddp_ring_hooks.telemetry.records import Text

    observation = Observation(diagnose=True)
    cadence = observation.recorder.cadence
    try:
        # The hook thread: a gathered (marked) step's hand-over is charged; an unmarked one is not.
        for index in range(3):
            observation.hand_over(torch.zeros(1 << 12), step=1, index=index, is_last=index == 2, algorithm="ring",
                                  group=None)
        assert _charged(cadence) > 0
        cadence.decide([[1e3, 1.0]])  # step 1's exchange: costly, so every MAX_GAP-th step later
        step = 1
        while step == 1 or cadence.gathers(step):  # the exchanges of the warm-up and the lag decide alike
            step += 1
            if cadence.gathers(step):
                cadence.decide([[1e3, 1.0]])
        unmarked = step
        assert _charged(cadence) == 0.0
        assert not observation.recorder.wants_marks(unmarked)
        observation.hand_over(torch.zeros(1 << 12), step=unmarked, index=0, is_last=True, algorithm="ring", group=None)
        assert _charged(cadence) == 0.0
        # The writer: a watcher's record (they record after gathers) is charged.
        for _ in range(50):
            observation.recorder.record(Text(1, "comm/test", "x" * 1000))
        observation.recorder.flush()
        assert _charged(cadence) > 0
    finally:
        observation.close()


def test_the_cadence_record_carries_its_tags():
    record = CadenceRecord.of(40, 5, 4.8, 100.0, rank=1)
    assert record.scalars() == {"comm/diagnosis/gather_every": 5, "comm/diagnosis/cost_ms": 4.8,
                              "comm/diagnosis/step_ms": 100.0}


def test_diagnose_is_the_gather_and_the_links_at_auto():
    assert (TelemetryOptions(diagnose=True).spread_every, TelemetryOptions(diagnose=True).links) == ("auto", True)
    assert TelemetryOptions(diagnose=True, spread_every=4).spread_every == 4  # a given cadence is kept
    assert (TelemetryOptions().spread_every, TelemetryOptions().links) == (0, False)
    assert TelemetryOptions(spread_every="auto").spread_every == "auto"
    with pytest.raises(ValueError, match="diagnose must be True or False"):
        TelemetryOptions(diagnose="yes")
    with pytest.raises(ValueError, match="or 'auto'"):
        TelemetryOptions(spread_every="often")


@pytest.mark.fast
def test_diagnose_records_buckets_at_its_cadence_unless_told_otherwise():
    assert TelemetryOptions().log_every == 1
    assert TelemetryOptions(diagnose=True).log_every == "auto"  # the gathered steps, not every step
    assert TelemetryOptions(diagnose=True, log_every=1).log_every == 1  # a given log_every is kept
    assert TelemetryOptions(spread_every=3, log_every="auto").log_every == "auto"
    with pytest.raises(ValueError, match="log_every='auto' records the steps that gather .* pass spread_every=N"):
        TelemetryOptions(log_every="auto")
    with pytest.raises(ValueError, match="log_every must be a positive integer"):
        TelemetryOptions(log_every=0)


def test_diagnose_is_taken_at_every_door_and_refused_there_when_wrong():
    from ddp_ring_hooks.hooks.options import check_register_options

    check_register_options(diagnose=True)
    with pytest.raises(ValueError, match="diagnose must be True or False"):
        check_register_options(diagnose=1)
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    from ddp_ring_hooks.integrations.fabric import RingDDPFabricStrategy
    from ddp_ring_hooks.integrations.lightning import RingDDPStrategy
    from ddp_ring_hooks.integrations.transformers import RingHookCallback

    trainer = SimpleNamespace(model_wrapped=None)  # what the callback reads of a Trainer, at on_train_begin
    doors = {
        "lightning": lambda **o: RingDDPStrategy(**o).register_options,
        "fabric": lambda **o: RingDDPFabricStrategy(**o).register_options,
        "transformers": lambda **o: RingHookCallback(trainer, **o).register_options,
    }
    for name, door in doors.items():
        assert door(diagnose=True)["diagnose"] is True, name
        with pytest.raises(ValueError, match="diagnose must be True or False"):
            door(diagnose="on")


def test_the_native_probe_is_judged_and_above_the_lab_shapers_burst():
    from ddp_ring_hooks.lab.iproute import _MIN_BURST_BYTES
    from ddp_ring_hooks.telemetry.link_timing import MIN_JUDGED_BYTES
    from ddp_ring_hooks.telemetry.native_probe import PROBE_BYTES

    assert PROBE_BYTES >= MIN_JUDGED_BYTES  # a probe's link is judged, not dropped as latency
    assert PROBE_BYTES - _MIN_BURST_BYTES >= 256 << 10  # "a few hundred KiB above the shaper's burst"
