"""``ring_order`` and ``node_of``: the order the rings visit the ranks, checked, drawn and agreed on.

Pure tests build the schedules and their layouts; one spawn of 3 gloo ranks runs them through
``all_reduce``, ``HookState`` under DDP, and ranks that disagree on the order (every rank must
fail the layout check with a message naming the option, and the group must stay usable).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.distributed as dist

import ddp_ring_hooks
from ddp_ring_hooks import HookState
from ddp_ring_hooks.links import best_ring
from ddp_ring_hooks.schedules import (
    NEEDS_LINKS, NEEDS_NODES, RingCrossings, build_schedule, checked_schedule, group_needs, resolve_options,
    ring_crossings, schedule_nodes, settled,
)
from ddp_ring_hooks.viz.layout import choose_layout
from tests._dist import run_ranks
from tests.conftest import Net, digest, rank_input, sgd_steps, within_summation_bound


def successors(schedule) -> dict[int, int]:
    return {t.src: t.dst for t in schedule.steps[0].transfers}


@pytest.mark.fast
def test_a_permutation_is_the_order_the_ring_visits_the_ranks():
    schedule = build_schedule("ring", 4, ring_order=[0, 2, 1, 3])
    assert successors(schedule) == {0: 2, 2: 1, 1: 3, 3: 0}
    assert dict(schedule.options)["ring_order"] == (0, 2, 1, 3)  # kept as a tuple
    assert schedule.digest() != build_schedule("ring", 4).digest()
    # The rank order written out is the default schedule itself.
    assert build_schedule("ring", 4, ring_order=(0, 1, 2, 3)).steps == build_schedule("ring", 4).steps


@pytest.mark.fast
def test_hosts_groups_the_ranks_by_node_in_node_order():
    schedule = build_schedule("ring", 6, ring_order="hosts", node_of=(1, 0, 1, 0, 2, 2))
    assert dict(schedule.options)["ring_order"] == (1, 3, 0, 2, 4, 5)
    assert successors(schedule) == {1: 3, 3: 0, 0: 2, 2: 4, 4: 5, 5: 1}


@pytest.mark.fast
def test_hosts_without_node_of_is_the_rank_order_under_torchrun_and_refused_elsewhere(monkeypatch):
    monkeypatch.setenv("GROUP_RANK", "1")
    assert build_schedule("ring", 4, ring_order="hosts").steps == build_schedule("ring", 4).steps
    monkeypatch.delenv("GROUP_RANK")
    with pytest.raises(ValueError, match=r"needs to know which node each rank runs on: pass node_of=.*torchrun"):
        build_schedule("ring", 4, ring_order="hosts")


@pytest.mark.fast
@pytest.mark.parametrize("options, message", [
    ({"ring_order": "fastest"}, "ring_order='fastest' is not one of 'rank', 'hosts', 'measured' or a list of ranks"),
    ({"ring_order": "measured"}, r"'measured' is chosen on the process group, by a probe of its links.*best_ring\(\)"),
    ({"ring_order": [0, 1, 1, 2]}, "names a rank twice"),
    ({"ring_order": [0, 1, 2]}, r"is not an order of the group's 4 ranks: list each of 0..3 once"),
    ({"ring_order": [0, 1, 2, 4]}, "is not an order of the group's 4 ranks"),
    ({"ring_order": 3}, "must be 'rank', 'hosts', 'measured', or a list of the group's ranks"),
    ({"node_of": (0, 0, 1, 1)}, "node_of is read only by ring_order='hosts'"),
    ({"ring_order": "hosts", "node_of": (0, 1)}, "node_of names the nodes of 2 ranks but the group has 4"),
    ({"ring_order": "hosts", "node_of": "ab"}, "must be one node number"),
])
def test_bad_orders_are_refused_with_the_fix(options, message):
    with pytest.raises(ValueError, match=message):
        build_schedule("ring", 4, **options)


@pytest.mark.fast
def test_bad_values_fail_when_the_state_is_built():
    with pytest.raises(ValueError, match="ring_order='fastest' is not one of"):
        HookState(algorithm="ring", ring_order="fastest")
    assert HookState(algorithm="ring", ring_order=[1, 0]).algorithm_options["ring_order"] == (1, 0)


@pytest.mark.fast
def test_the_lightning_strategy_takes_and_checks_the_order():
    pytest.importorskip("lightning")
    from ddp_ring_hooks.integrations.lightning import RingDDPStrategy

    RingDDPStrategy("ring", algorithm_options={"ring_order": [0, 2, 1, 3]})
    with pytest.raises(ValueError, match="names a rank twice"):
        RingDDPStrategy("ring", algorithm_options={"ring_order": [0, 0]})


@pytest.mark.fast
def test_hierarchical_with_hosts_makes_node_of_its_nodes():
    node_of = (0, 1, 2, 0, 1, 2)  # ranks placed across three nodes of two
    schedule = build_schedule("hierarchical", 6, local_size=2, ring_order="hosts", node_of=node_of)
    assert schedule_nodes(schedule) == node_of
    for step in schedule.steps:
        inside = {node_of[t.src] == node_of[t.dst] for t in step.transfers}
        assert inside == ({False} if step.phase == "inter-node all-reduce" else {True}), step.phase
    with pytest.raises(ValueError, match="node_of puts node 0: 3, node 1: 3 ranks, but local_size=2"):
        build_schedule("hierarchical", 6, local_size=2, ring_order="hosts", node_of=(0, 0, 0, 1, 1, 1))


@pytest.mark.fast
def test_the_drawings_follow_the_order():
    ring = choose_layout(build_schedule("ring", 4, ring_order=(0, 2, 1, 3)))
    assert ring.links == ((0, 2), (2, 1), (1, 3), (3, 0))
    top = max(range(4), key=lambda r: ring.positions[r][1])
    assert top == 0 and ring.positions[2][0] > 0  # 0 on top, its successor 2 clockwise, to the right
    nodes = choose_layout(build_schedule("hierarchical", 6, local_size=2, ring_order="hosts", node_of=(0, 1, 2, 0, 1, 2)))
    assert nodes.groups == ((0, 3), (1, 4), (2, 5))


@pytest.mark.fast
def test_options_resolve_to_hashable_values_for_the_schedule_cache():
    assert resolve_options("ring", {"ring_order": [2, 1, 0]})["ring_order"] == (2, 1, 0)
    assert checked_schedule("ring", 3, ring_order=[2, 1, 0]) is checked_schedule("ring", 3, ring_order=(2, 1, 0))


def bandwidths(placement, *, inside=1e9, between=5e7, noise=0.05, seed=0):
    """A probe's matrix: fast inside a node, slow between, each link off by up to ``noise``."""
    rng = random.Random(seed)
    p = len(placement)
    return [[None if s == d else (inside if placement[s] == placement[d] else between) * (1 + rng.uniform(-noise, noise))
             for d in range(p)] for s in range(p)]


@pytest.mark.fast
@pytest.mark.parametrize("placement", [
    (0, 1, 0, 1), (0, 1, 0, 1, 0, 1), (0, 1, 2) * 3,  # exhaustive (p <= 9)
    tuple(r % 3 for r in range(12)), tuple(r % 4 for r in range(16)), (0, 1) * 10,  # greedy + 2-opt
])
def test_the_measured_order_crosses_between_nodes_once_per_node(placement):
    order = best_ring(bandwidths(placement))
    assert sorted(order) == list(range(len(placement)))
    nodes = len(set(placement))
    assert ring_crossings(order, placement) == RingCrossings(total=nodes, busiest=1), order
    # Rotated to start after a slow hop: consecutive places are whole nodes (what hierarchical reads).
    size = len(placement) // nodes
    assert all(len({placement[r] for r in order[i:i + size]}) == 1 for i in range(0, len(order), size)), order


@pytest.mark.fast
def test_the_measured_order_avoids_a_slow_link_and_takes_what_it_must_of_a_slow_nic():
    flat = [[None if s == d else 5e7 for d in range(5)] for s in range(5)]
    flat[1][2] = flat[2][1] = 1e7  # one slow cable
    order = best_ring(flat)
    assert {(order[i], order[(i + 1) % 5]) for i in range(5)}.isdisjoint({(1, 2), (2, 1)})
    slow_nic = [[None if s == d else (1e7 if 3 in (s, d) else 5e7) for d in range(4)] for s in range(4)]
    assert sorted(best_ring(slow_nic)) == [0, 1, 2, 3]  # every ring has two of rank 3's links: any will do
    with pytest.raises(ValueError, match=r"no bandwidth measured for 2 link\(s\), e.g. 0->1"):
        best_ring([[None, None, 1.0], [None, None, 1.0], [1.0, 1.0, None]])


@pytest.mark.fast
def test_the_group_settles_hosts_and_measured_and_nothing_else():
    assert group_needs({"ring_order": "measured"}) == NEEDS_LINKS
    assert group_needs({"ring_order": "hosts", "node_of": None}) == NEEDS_NODES
    assert group_needs({"ring_order": "hosts", "node_of": (0, 1)}) is None
    assert group_needs({"ring_order": (1, 0)}) is None and group_needs({"segments": 2}) is None
    assert settled({"ring_order": "measured", "node_of": None}, measured=(0, 2, 1, 3)) == {
        "ring_order": (0, 2, 1, 3), "node_of": None}
    assert settled({"ring_order": "hosts"}, nodes=(0, 1, 0, 1)) == {"ring_order": "hosts", "node_of": (0, 1, 0, 1)}
    assert settled({"ring_order": "hosts"}, nodes=None) == {"ring_order": "hosts"}  # unknown: building names the fix


WORLD = 3
ORDER = [2, 0, 1]


def on_three_ranks(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    from ddp_ring_hooks.hooks.layout_check import BucketLayoutMismatchError

    report: dict[str, object] = {}
    for name, options in (
        ("list", {"algorithm": "ring", "ring_order": ORDER}),
        ("hosts", {"algorithm": "ring", "ring_order": "hosts", "node_of": (1, 0, 1)}),
    ):
        for numel in (0, 2, 1001):
            inputs = [rank_input(r, numel, torch.float32) for r in range(world_size)]
            ours = inputs[rank].clone()
            ddp_ring_hooks.all_reduce(ours, **options)
            report[(name, numel)] = (within_summation_bound(ours, inputs, torch.float32, world_size), digest(ours))

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(Net(), bucket_cap_mb=0.02)
    ddp_ring_hooks.register(model, algorithm="ring", ring_order=ORDER)
    plain = torch.nn.parallel.DistributedDataParallel(Net(), bucket_cap_mb=0.02)
    plain.load_state_dict(model.state_dict())
    report["ddp"] = list(zip(sgd_steps(model, rank), sgd_steps(plain, rank)))

    def disagree(**options) -> str:
        try:
            HookState(**options).reduce_bucket(torch.ones(10), is_last=True).wait()
        except BucketLayoutMismatchError as error:
            recovered = HookState().reduce_bucket(torch.full((4,), float(rank)), is_last=True).wait()
            return f"{error}\n[recovered: {recovered.tolist()}]"
        return "no error"

    # Each rank its own explicit order; then one rank with its own view of the nodes.
    report["different orders"] = disagree(algorithm="ring", ring_order=[(r + rank) % world_size for r in range(world_size)])
    report["different node_of"] = disagree(algorithm="ring", ring_order="hosts", node_of=(0, 0, 1) if rank else (0, 1, 0))
    # Under torchrun (GROUP_RANK set) "hosts" is the rank order: ranks that say "rank" agree.
    os.environ["GROUP_RANK"] = "0"
    report["hosts under torchrun"] = disagree(algorithm="ring", ring_order="hosts" if rank else "rank")
    return report


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return run_ranks(on_three_ranks, WORLD, timeout=180)


def test_all_reduce_in_any_order_sums_and_is_bit_identical(reports):
    cases = [case for case in reports[0] if isinstance(case, tuple)]
    assert len(cases) == 6
    for case in cases:
        error = reports[0][case][0]
        assert error <= 1.0, case
        assert len({report[case][1] for report in reports}) == 1, f"{case}: ranks differ bit-wise"


def test_ddp_with_a_ring_order_matches_plain_ddp(reports):
    for report in reports:
        for ours, plain in report["ddp"]:
            torch.testing.assert_close(ours, plain, rtol=1e-5, atol=1e-6)
    for other in reports[1:]:
        assert all(torch.equal(a, b) for (a, _), (b, _) in zip(other["ddp"], reports[0]["ddp"]))


@pytest.mark.parametrize("case", ["different orders", "different node_of"])
def test_ranks_with_different_orders_all_fail_the_layout_check_naming_the_option(reports, case):
    for rank, report in enumerate(reports):
        message = report[case]
        assert "schedule differs: rank 0: 0x" in message and "ring's options: ring_order, node_of" in message, message
        assert f"[recovered: {[sum(range(WORLD)) / WORLD] * 4}]" in message, (rank, message)  # the group still averages


def test_hosts_under_torchrun_agrees_with_the_rank_order(reports):
    assert all(report["hosts under torchrun"] == "no error" for report in reports)


def test_bench_takes_the_order_as_a_flag_and_checks_it_before_starting_ranks(capfd):  # the ranks print: fd level
    from ddp_ring_hooks.cli.__main__ import main

    assert main(["bench", "--nproc", "2", "--algorithms", "tree", "--ring-order", "hosts"]) == 2
    assert "--ring-order is an option of none of tree" in capfd.readouterr().err
    assert main(["bench", "--nproc", "2", "--algorithms", "ring", "--ring-order", "fastest"]) == 2
    assert "ring: ring_order='fastest' is not one of 'rank', 'hosts', 'measured'" in capfd.readouterr().err
    quick = ["-b", "1K", "-e", "1K", "-n", "1", "-w", "0", "--no-progress"]
    assert main(["bench", "--nproc", "2", "--algorithms", "ring,tree", "--ring-order", "1,0", "--segments", "2", *quick]) == 0
    rows = [line.split() for line in capfd.readouterr().out.splitlines() if line.strip() and not line.startswith("#")]
    assert [(row[2], row[-1]) for row in rows] == [("ring", "0"), ("tree", "0")]  # ran, and no wrong values


@pytest.mark.fast
def test_explain_and_animate_take_the_order_as_flags_and_show_it(tmp_path, capsys):
    from ddp_ring_hooks.cli.__main__ import main

    said = "ring order 0, 2, 1, 3: the rings visit the ranks in this order, not 0, 1, 2, 3"
    assert main(["explain", "--algorithm", "ring", "--world-size", "4", "--ring-order", "0,2,1,3"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1] == said and "sends    0 +> 2 c3   1 +> 3 c1   2 +> 1 c0   3 +> 0 c2" in out
    assert main(["explain", "--algorithm", "ring", "--ring-order", "hosts", "--node-of", "0,1,0,1"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == said
    assert main(["explain", "--algorithm", "ring"]) == 0
    assert "ring order" not in capsys.readouterr().out  # the rank order: no line
    assert main(["explain", "--algorithm", "ring", "--ring-order", "0,1,2"]) == 2
    assert "(on the command line: --ring-order rank|hosts|measured|R0,R1,...)" in capsys.readouterr().err
    assert main(["explain", "--algorithm", "ring", "--node-of", "0,x"]) == 2
    assert "node_of='0,x' must be one node number" in capsys.readouterr().err
    pytest.importorskip("matplotlib")
    gif = tmp_path / "ring_order.gif"
    assert main(["animate", "--algorithm", "ring", "--world-size", "4", "--ring-order", "0,2,1,3", "--output", str(gif),
                 "--no-progress"]) == 0
    assert gif.stat().st_size > 0 and "wrote" in capsys.readouterr().out
