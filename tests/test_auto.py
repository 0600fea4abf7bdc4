"""``algorithm="auto"``: the choice is the model's argmin, and every rank makes the same one.

Pure tests drive :class:`AutoSelector` with known calibrations; one spawn of 3 real gloo
ranks runs the registration probe, checks that every rank got the same calibration and
choices, logs one line per bucket size, and trains DDP to the same parameters as plain DDP
(``rtol=1e-5, atol=1e-6``, float32, as in ``test_ddp_hook``).
"""

from __future__ import annotations

import logging
import pickle

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_ring_hooks
from ddp_ring_hooks.cost_model import Calibration, Links, TwoTier
from ddp_ring_hooks.runtime.selection import AutoSelector, default_candidates
from tests._dist import run_ranks
from tests.conftest import Net

LINKS = Calibration(alpha=50e-6, beta=1e-9)
SIZES = [0, 4, 1000, 4096, 65_536, 1 << 20, 25 << 20, 1 << 30]
CANDIDATES = ("ring", "tree")


@pytest.mark.fast
@pytest.mark.parametrize("world_size", [2, 3, 4, 6, 8, 64])
def test_choice_is_the_least_predicted_time(world_size):
    selector = AutoSelector(LINKS, world_size)
    for nbytes in SIZES:
        algorithm, options = selector.choose(nbytes)
        predicted = selector.predictions(nbytes)
        assert predicted[algorithm] == pytest.approx(min(predicted.values()), rel=1e-9)
        assert options == selector.options.get(algorithm, {})


@pytest.mark.fast
def test_small_buckets_avoid_the_ring_and_large_ones_on_odd_worlds_use_it():
    selector = AutoSelector(LINKS, 6)  # not a power of two: halving-doubling pays its fold
    assert selector.choose(256)[0] != "ring"
    assert selector.choose(1 << 30)[0] == "ring"


@pytest.mark.fast
def test_ties_go_to_the_first_algorithm_listed():
    # On 2 ranks ring and halving-doubling have the same formula.
    assert AutoSelector(LINKS, 2).choose(1 << 20)[0] == "ring"


@pytest.mark.fast
def test_per_algorithm_calibration_is_used():
    calibrations = {a: LINKS for a in default_candidates(4)}
    calibrations["naive"] = Calibration(alpha=1e-6, beta=1e-12)  # a machine where naive is cheap
    assert AutoSelector(calibrations, 4).choose(1 << 20)[0] == "naive"
    del calibrations["tree"]
    with pytest.raises(ValueError, match="no calibration for tree"):
        AutoSelector(calibrations, 4)


@pytest.mark.fast
def test_hierarchical_is_a_candidate_only_across_several_multi_rank_nodes(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert "hierarchical" not in default_candidates(8)
    assert "hierarchical" not in default_candidates(8, local_size=8)
    assert "hierarchical" in default_candidates(8, local_size=4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    selector = AutoSelector(LINKS, 8)
    assert selector.options["hierarchical"]["local_size"] == 2


@pytest.mark.fast
def test_bad_candidates_are_named():
    with pytest.raises(ValueError, match=r"auto: candidates=\('ring', 'butterfly'\) must be some of ring, "):
        AutoSelector(LINKS, 4, candidates=("ring", "butterfly"))


@pytest.mark.fast
def test_candidate_options_are_the_registrys_and_each_reaches_the_candidates_that_take_it(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    selector = AutoSelector(LINKS, 8, segments=3, local_size=4, ring_order=[0, 2, 4, 6, 1, 3, 5, 7], wire_dtype="bf16")
    order = {"ring_order": (0, 2, 4, 6, 1, 3, 5, 7), "node_of": None}  # to both rings, as a tuple
    wire = {"wire_dtype": "bf16"}  # every algorithm's option: every candidate, native included, on one wire
    assert selector.options["tree"] == selector.options["double_binary_tree"] == {"segments": 3, **wire}
    assert selector.options["hierarchical"] == {"local_size": 4, "segments": 3, **order, **wire}
    assert selector.options["ring"] == {**order, **wire}
    assert selector.options["halving_doubling"] == selector.options["native"] == wire
    # auto never picks compression itself: without the option every candidate sends as it is
    assert {o["wire_dtype"] for o in AutoSelector(LINKS, 8).options.values()} == {"fp32"}
    with pytest.raises(ValueError, match="ring: ring_order=\\(0, 0\\) names a rank twice"):
        AutoSelector(LINKS, 8, ring_order=(0, 0))
    with pytest.raises(ValueError, match="tree: segments=0 must be an integer >= 1"):
        AutoSelector(LINKS, 8, segments=0)  # the option's own check, as for HookState(algorithm="tree")
    with pytest.raises(TypeError, match="unknown option 'segmnts' \\(did you mean 'segments'\\?\\); it takes calibration"):
        AutoSelector(LINKS, 8, segmnts=3)
    # Candidates the caller chose: an option none of them takes would be silently dropped.
    with pytest.raises(TypeError, match="segments is an option of none of the candidates ring, native"):
        AutoSelector(LINKS, 8, candidates=("ring", "native"), segments=3)
    # Default candidates: a node size that makes no hierarchy leaves hierarchical out, no error.
    assert "hierarchical" not in AutoSelector(LINKS, 8, local_size=8).candidates


LAB = TwoTier(Links(200e-6, 1 / 50e6, local=Links(50e-6, 1 / 1e9)), ranks_per_node=2)  # 400 Mbit/s uplinks


@pytest.mark.fast
def test_on_a_two_tier_network_auto_picks_hierarchical_where_it_is_faster_and_only_there():
    selector = AutoSelector(None, 4, network=LAB, local_size=2)
    for nbytes in (4096, 1 << 20, 4 << 20, 16 << 20):
        predicted = selector.predictions(nbytes)
        chosen, options = selector.choose(nbytes)
        assert predicted[chosen] == min(predicted.values())
        assert (chosen == "hierarchical") == (predicted["hierarchical"] < min(t for a, t in predicted.items() if a != "hierarchical"))
    assert selector.choose(16 << 20) == (
        "hierarchical", {"local_size": 2, "segments": None, "ring_order": "rank", "node_of": None, "wire_dtype": "fp32"})
    # One tier (every rank its own node, the same links): no hierarchy pays, none is picked.
    flat = TwoTier(Links(200e-6, 1 / 50e6), ranks_per_node=1)
    assert all(AutoSelector(None, 4, network=flat, local_size=2).choose(n)[0] != "hierarchical" for n in SIZES)
    # Ranks alternating between the nodes: the ring's candidate is priced in the order it would run.
    misplaced = TwoTier(LAB.links, placement=(0, 1, 0, 1))
    crossing = AutoSelector(None, 4, network=misplaced, candidates=("ring", "tree"))
    fixed = AutoSelector(None, 4, network=misplaced, candidates=("ring", "tree"), ring_order="hosts", node_of=(0, 1, 0, 1))
    assert crossing.predictions(16 << 20)["ring"] == pytest.approx(2 * fixed.predictions(16 << 20)["ring"], rel=0.01)
    with pytest.raises(ValueError, match="this network places 4 ranks, not 6"):
        AutoSelector(None, 6, network=misplaced)
    with pytest.raises(ValueError, match="auto: network='lab' must be a ddp_ring_hooks.cost_model.TwoTier"):
        AutoSelector(None, 4, network="lab")


@pytest.mark.fast
def test_hook_state_takes_autos_options_by_their_records():
    from ddp_ring_hooks.runtime.selection import AUTO_OPTIONS, auto_option_names
    from ddp_ring_hooks.schedules import options_by_name

    assert auto_option_names() == (*(o.name for o in AUTO_OPTIONS), *options_by_name())
    with pytest.raises(TypeError, match="unknown option 'candidate' \\(did you mean 'candidates'\\?\\)"):
        ddp_ring_hooks.HookState(algorithm="auto", candidate=("ring",))


@pytest.mark.fast
def test_choices_are_logged_once_per_bucket_size(caplog):
    selector = AutoSelector(LINKS, 4)
    with caplog.at_level(logging.INFO, logger="ddp_ring_hooks.auto"):
        for nbytes in (4096, 4096, 1 << 20, 4096):
            selector.choose(nbytes)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "4096-byte bucket on 4 ranks" in lines[0]


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def probe_choose_and_train(rank: int, world_size: int) -> dict:
    logger = logging.getLogger("ddp_ring_hooks.auto")
    logger.setLevel(logging.INFO)
    handler = _Collect()
    logger.addHandler(handler)
    report = {}

    def train(hook: bool):
        torch.manual_seed(0)
        model = DDP(Net(), bucket_cap_mb=0.02)
        # Two candidates keep the registration probe short on a busy test machine.
        state = ddp_ring_hooks.register(model, algorithm="auto", candidates=CANDIDATES) if hook else None
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        generator = torch.Generator().manual_seed(rank)
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randn(8, 32, generator=generator)).square().mean().backward()
            optimizer.step()
        return state, [p.detach().clone() for p in model.parameters()]

    state, report["auto"] = train(hook=True)
    _, report["plain"] = train(hook=False)
    report["state_calibration"] = state.plan.selector.calibration
    report["choices"] = [state.plan.selector.choose(n) for n in SIZES]
    report["unpickled_choices"] = [pickle.loads(pickle.dumps(state)).plan.selector.choose(n) for n in SIZES]
    report["log"] = handler.lines
    state.close()
    return report


def test_probe_agrees_on_every_rank_and_auto_trains_like_plain_ddp():
    reports = run_ranks(probe_choose_and_train, 3, timeout=240)
    first = reports[0]
    assert set(first["state_calibration"]) == set(CANDIDATES)
    assert all(c.alpha >= 0 and c.beta >= 0 for c in first["state_calibration"].values())
    assert first["state_calibration"]["ring"].alpha > 0  # a real probe measured something
    for other in reports[1:]:
        assert other["state_calibration"] == first["state_calibration"]
        assert other["choices"] == first["choices"]
        assert all(torch.equal(a, b) for a, b in zip(other["auto"], first["auto"]))
    assert first["unpickled_choices"] == first["choices"]
    for ours, plain in zip(first["auto"], first["plain"]):
        torch.testing.assert_close(ours, plain, rtol=1e-5, atol=1e-6)
    decided = [line for line in first["log"] if "-byte bucket on 3 ranks ->" in line]
    sizes = [line.split("-byte")[0].split()[-1] for line in decided]
    assert decided and len(sizes) == len(set(sizes))  # one line per distinct bucket size


def probe_with_nodes_of_different_sizes(rank: int, world_size: int) -> dict:
    """Ranks 0-1 say their node runs 2 ranks, ranks 2-3 say 4 (as torchrun would set
    LOCAL_WORLD_SIZE on nodes of different sizes): hierarchical is then a candidate on some
    ranks only, and a probe that runs different schedules on different ranks deadlocks."""
    import os

    from ddp_ring_hooks.runtime.selection import agreed_option_sets

    report = {"agreed_when_equal": agreed_option_sets(None, {"local_size": 2})["hierarchical"]}
    os.environ["LOCAL_WORLD_SIZE"] = "2" if rank < 2 else "4"
    report["agreed"] = agreed_option_sets(None, {})
    try:
        AutoSelector.probed(candidates=("ring", "hierarchical"))
    except ValueError as error:
        report["hierarchical_asked_for"] = str(error)
    state = ddp_ring_hooks.HookState(algorithm="auto")
    report["candidates"] = state.plan.selector.candidates
    report["sum"] = state.reduce_bucket(torch.full((1000,), float(rank)), is_last=True).wait()[:3].tolist()
    state.close()
    return report


def test_nodes_of_different_sizes_leave_hierarchical_out_on_every_rank():
    reports = run_ranks(probe_with_nodes_of_different_sizes, 4, timeout=240)
    for report in reports:
        assert report["agreed_when_equal"] == {
            "local_size": 2, "segments": None, "ring_order": "rank", "node_of": None, "wire_dtype": "fp32"}
        assert report["agreed"]["hierarchical"] is None and report["agreed"]["tree"] == {"segments": 1, "wire_dtype": "fp32"}
        assert "hierarchical is a candidate but the ranks do not agree on its options" in report["hierarchical_asked_for"]
        assert "LOCAL_WORLD_SIZE, which differs between nodes" in report["hierarchical_asked_for"]
        assert "local_size=G" in report["hierarchical_asked_for"]
        assert report["candidates"] == reports[0]["candidates"]
        assert "hierarchical" not in report["candidates"] and "ring" in report["candidates"]
        assert report["sum"] == [1.5] * 3  # the mean of 0, 1, 2, 3
