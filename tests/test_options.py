"""Options are checked where they are built: a typo fails at construction, naming the valid ones.

No process group is needed to build a ``HookState`` for a fixed algorithm, so these run
without ranks; the same checks through ``register`` on real ranks are in test_bad_input.py.
"""

from __future__ import annotations

import pytest

from ddp_ring_hooks import HookState
from ddp_ring_hooks.schedules import (
    ALGORITHMS, algorithm_names, build_schedule, formula_for, get_algorithm, resolve_options,
)

pytestmark = pytest.mark.fast  # no test here starts a process


def test_a_typo_in_a_state_option_fails_at_construction_naming_the_right_one():
    with pytest.raises(TypeError) as caught:
        HookState(algorithm="ring", log_dirr="runs/x")
    message = str(caught.value)
    assert "unknown option 'log_dirr'" in message and "did you mean 'log_dir'" in message
    assert "the ring algorithm takes ring_order, node_of" in message


def test_a_typo_in_an_algorithm_option_names_that_algorithms_options():
    with pytest.raises(TypeError, match="unknown option 'segment'.*did you mean 'segments'.*the tree algorithm takes segments"):
        HookState(algorithm="tree", segment=4)


def test_algorithm_options_come_as_a_mapping_or_as_keywords_not_both():
    # Every algorithm also takes the wire dtype; its default, fp32, sends buckets as they are.
    assert HookState(algorithm="tree", algorithm_options={"segments": 4}).algorithm_options == {"segments": 4, "wire_dtype": "fp32"}
    assert HookState(algorithm="tree", segments=4).algorithm_options == {"segments": 4, "wire_dtype": "fp32"}
    with pytest.raises(TypeError, match="'segments' given twice"):
        HookState(algorithm="tree", algorithm_options={"segments": 4}, segments=2)


def test_bad_values_fail_at_construction():
    with pytest.raises(ValueError, match="segments=0 must be an integer >= 1"):
        HookState(algorithm="tree", segments=0)
    with pytest.raises(ValueError, match=r"local_size=None is missing.*LOCAL_WORLD_SIZE"):
        HookState(algorithm="hierarchical")


def test_defaults_are_filled_in_and_the_environment_is_read_once(monkeypatch):
    assert HookState(algorithm="tree").algorithm_options == {"segments": 1, "wire_dtype": "fp32"}
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    state = HookState(algorithm="hierarchical")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # later changes do not reach the state
    # segments stays "by size" (None) until a bucket's size chooses it.
    assert state.algorithm_options == {
        "local_size": 2, "segments": None, "ring_order": "rank", "node_of": None, "wire_dtype": "fp32",
    }


def test_one_message_for_an_unknown_name_everywhere():
    messages = set()
    for refuse in (lambda: get_algorithm("rign"), lambda: build_schedule("rign", 4), lambda: HookState(algorithm="rign")):
        with pytest.raises(ValueError) as caught:
            refuse()
        messages.add(str(caught.value))
    assert len(messages) == 1 and "did you mean 'ring'" in messages.pop()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_schedules_carry_the_options_they_were_built_with(algorithm, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    schedule = build_schedule(algorithm, 4)
    assert dict(schedule.options) == resolve_options(algorithm, {}, nbytes=0)  # options by size: the smallest buffer's


def test_lightning_strategy_checks_its_algorithm_options_when_built():
    pytest.importorskip("lightning")
    from ddp_ring_hooks.integrations.lightning import RingDDPStrategy

    with pytest.raises(TypeError, match="unknown option 'segmets'.*did you mean 'segments'"):
        RingDDPStrategy("tree", algorithm_options={"segmets": 2})


def test_native_is_one_registry_entry_without_a_schedule():
    native = get_algorithm("native")
    assert native.build is None and native.cost is None and formula_for("native") == "ring"
    assert "native" not in ALGORITHMS and "native" in algorithm_names()
    with pytest.raises(TypeError, match="unknown option 'segments'.*the native algorithm takes wire_dtype$"):
        HookState(algorithm="native", segments=2)
    with pytest.raises(ValueError, match="native algorithm has no schedule"):
        build_schedule("native", 4)


def test_telemetry_options_are_checked_when_the_lightning_strategy_is_built():
    pytest.importorskip("lightning")
    from ddp_ring_hooks.integrations.lightning import RingDDPStrategy

    with pytest.raises(ValueError, match="trace_steps needs log_dir"):
        RingDDPStrategy("ring", trace_steps=3)


def test_hook_state_lists_every_telemetry_option_in_its_errors():
    from ddp_ring_hooks.telemetry import TELEMETRY_OPTIONS

    with pytest.raises(TypeError) as caught:
        HookState(algorithm="ring", log_evry=2)
    assert all(name in str(caught.value) for name in TELEMETRY_OPTIONS)
