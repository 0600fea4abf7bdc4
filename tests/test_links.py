"""Which link is slow: the naming rule, the probe, ``ddp-ring-hooks links``.

- Pure (milliseconds): the circle method meets every pair once in disjoint pairs; the rule on
  synthetic matrices (equal links, a slow network, a slow link, one direction, two tiers with
  and without a slow link, a slow uplink among 3 nodes and among 2, a ring's few links, noisy
  samples); the matrix file round-trips and refuses what it cannot read; no torch.
- Local gloo ranks on loopback (seconds): the command measures a complete, positive matrix
  and writes the JSON and the picture; every rank gets the same matrix.
- On the emulated lab (real namespaces, shaped links; skipped without root): a host whose
  link is 4x slower is named as that rank's network; a slow host link inside a node of a
  two-tier lab is named as the link pair, no network; equal links (under `lab torchrun`)
  name nothing.

Run: ``python -m pytest -q tests/test_links.py``.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_ring_hooks.cli.__main__ import main as cli_main
from ddp_ring_hooks.launch import spawn_ranks
from ddp_ring_hooks.links import (
    BETWEEN, INSIDE, MIN_TRAINING_SAMPLES, LinkMatrix, LinkSample, exchange_rounds, format_table, judge_links, judge_samples,
    load_link_matrix, partner_in, write_link_matrix,
)
from tests.conftest import imports_torch

REPO = Path(__file__).resolve().parents[1]
MB = 1e6


def matrix(p: int, rate, *, noise: float = 0.1, seed: int = 0) -> dict:
    """``rate(src, dst)`` in MB/s for every directed link, each off by up to ``noise`` (seeded)."""
    generator = random.Random(seed)
    return {(s, d): rate(s, d) * MB * (1 + generator.uniform(-noise, noise)) for s in range(p) for d in range(p) if s != d}


def two_tier(nodes, *, inside: float = 300.0, between: float = 12.0):
    return lambda s, d: inside if nodes[s] == nodes[d] else between


def named(verdict) -> tuple:
    """(slow ranks with their tier, slow nodes, slow link groups) of a verdict."""
    return ([(s.rank, s.tier) for s in verdict.slow_ranks], [s.node for s in verdict.slow_nodes],
            [s.links for s in verdict.slow_links])


# -- the pairing -----------------------------------------------------------------------------


@pytest.mark.fast
@pytest.mark.parametrize("p", range(0, 14))
def test_rounds_meet_every_pair_once_in_disjoint_pairs(p):
    rounds = exchange_rounds(p)
    assert len(rounds) == (0 if p < 2 else p - 1 if p % 2 == 0 else p)
    met = [pair for pairs in rounds for pair in pairs]
    assert sorted(met) == [(a, b) for a in range(p) for b in range(a + 1, p)]  # each pair once
    for pairs in rounds:
        ranks = [rank for pair in pairs for rank in pair]
        assert len(ranks) == len(set(ranks)) and len(pairs) == p // 2  # disjoint; one bye for an odd p
        for rank in range(p):
            partner = partner_in(pairs, rank)
            assert partner is None or partner_in(pairs, partner) == rank


# -- the rule on synthetic matrices ------------------------------------------------------------


@pytest.mark.fast
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("p", (3, 4, 8))
def test_equal_links_name_nothing(p, seed):
    verdict = judge_links(matrix(p, lambda s, d: 48.0, noise=0.15, seed=seed), world_size=p)
    assert named(verdict) == ([], [], []) and verdict.slow_nic_rank == -1
    assert verdict.median_Bps == pytest.approx(48 * MB, rel=0.15)
    assert verdict.summary_line().startswith("links: no slow link: median ")


@pytest.mark.fast
@pytest.mark.parametrize("p, slow, factor", [(4, 2, 4), (3, 0, 4), (8, 5, 4), (4, 1, 2)])
def test_a_slow_network_is_named_as_that_rank(p, slow, factor):
    verdict = judge_links(matrix(p, lambda s, d: 48.0 / factor if slow in (s, d) else 48.0), world_size=p)
    assert named(verdict) == ([(slow, "all")], [], []) and verdict.slow_nic_rank == slow
    [found] = verdict.slow_ranks
    assert found.in_Bps == pytest.approx(48 * MB / factor, rel=0.1) and found.others_Bps == pytest.approx(48 * MB, rel=0.1)
    assert verdict.named_links() == {link for link in verdict.bandwidths if slow in link}  # the cross
    assert verdict.summary_line(per="steps").startswith(f"links: rank {slow}'s network is slow: ")
    assert verdict.summary_line(per="steps").endswith(" MB/s (1 step)")


@pytest.mark.fast
def test_the_summary_line_reads_as_documented():
    bandwidths = {(s, d): (12.0 if 2 in (s, d) else 48.0) * MB for s in range(4) for d in range(4) if s != d}
    samples = [LinkSample(s, d, int(b), 1.0) for _ in range(12) for (s, d), b in bandwidths.items()]
    assert judge_samples(samples, world_size=4).summary_line(per="steps") == (
        "links: rank 2's network is slow: 12.0 MB/s in, 12.0 MB/s out, others 48.0 MB/s (12 steps)")


@pytest.mark.fast
def test_one_slow_link_pair_is_named_as_the_pair_and_one_direction_alone():
    verdict = judge_links(matrix(4, lambda s, d: 12.0 if {s, d} == {0, 1} else 48.0), world_size=4)
    assert named(verdict) == ([], [], [((0, 1), (1, 0))])
    assert verdict.summary_line().startswith("links: 0→1 and 1→0 are slow: ")
    verdict = judge_links(matrix(4, lambda s, d: 12.0 if (s, d) == (3, 1) else 48.0), world_size=4)
    assert named(verdict) == ([], [], [((3, 1),)]) and verdict.slowest == (3, 1)
    # At 3 ranks a pair has no link that misses both its ends: compared with the other pairs.
    assert named(judge_links(matrix(3, lambda s, d: 12.0 if {s, d} == {0, 1} else 48.0), world_size=3)) == (
        [], [], [((0, 1), (1, 0))])


@pytest.mark.fast
def test_a_rank_that_only_sends_slowly_is_its_links_out_not_its_network():
    verdict = judge_links(matrix(4, lambda s, d: 12.0 if s == 3 else 48.0), world_size=4)
    assert named(verdict) == ([], [], [((3, 0),), ((3, 1),), ((3, 2),)]) and verdict.slow_nic_rank == -1


@pytest.mark.fast
@pytest.mark.parametrize("nodes", [(0, 0, 1, 1), (0, 0, 0, 0, 1, 1, 1, 1), (0, 1, 0, 1), (0, 0, 1, 1, 2, 2)])
def test_a_two_tier_network_names_nothing(nodes):
    p = len(nodes)
    verdict = judge_links(matrix(p, two_tier(nodes)), world_size=p, nodes=nodes)
    assert named(verdict) == ([], [], [])
    assert set(verdict.tier_medians) == {INSIDE, BETWEEN}
    assert verdict.summary_line().startswith("links: no slow link: inside nodes ")
    # Without the nodes the links between nodes are the majority, and the median with them.
    assert named(judge_links(matrix(p, two_tier(nodes)), world_size=p)) == ([], [], [])


@pytest.mark.fast
def test_a_two_tier_network_names_one_slow_link_between_nodes_as_the_pair():
    nodes = (0, 0, 1, 1)
    rate = two_tier(nodes)
    verdict = judge_links(matrix(4, lambda s, d: 3.0 if {s, d} == {0, 2} else rate(s, d)), world_size=4, nodes=nodes)
    assert named(verdict) == ([], [], [((0, 2), (2, 0))]) and verdict.slow_links[0].tier == BETWEEN
    assert "other links between nodes 1" in verdict.summary_line()


@pytest.mark.fast
def test_a_slow_host_link_inside_a_node_is_the_pair_when_the_uplink_hides_it_between_nodes():
    # The lab's case: host 0's own link at 200 Mbit/s, uplinks at 100: between nodes host 0
    # is as fast as its uplink allows; inside its node, 0→1 and 1→0 are slow.
    nodes = (0, 0, 1, 1)
    rate = two_tier(nodes, inside=500.0, between=6.0)
    verdict = judge_links(matrix(4, lambda s, d: 25.0 if {s, d} == {0, 1} else rate(s, d)), world_size=4, nodes=nodes)
    assert named(verdict) == ([], [], [((0, 1), (1, 0))]) and verdict.slow_links[0].tier == INSIDE


@pytest.mark.fast
def test_a_slow_network_on_two_tiers_is_named_between_nodes():
    nodes = (0, 0, 0, 1, 1, 1)
    rate = two_tier(nodes)
    verdict = judge_links(matrix(6, lambda s, d: 3.0 if 4 in (s, d) and nodes[s] != nodes[d] else rate(s, d)),
                          world_size=6, nodes=nodes)
    assert named(verdict) == ([(4, BETWEEN)], [], []) and verdict.slow_nic_rank == 4
    assert "rank 4's network is slow" in verdict.summary_line()


@pytest.mark.fast
def test_a_slow_uplink_among_three_nodes_is_named_as_the_node():
    nodes = (0, 0, 1, 1, 2, 2)
    rate = two_tier(nodes)
    slow_uplink = lambda s, d: 4.0 if nodes[s] != nodes[d] and 2 in (nodes[s], nodes[d]) else rate(s, d)  # noqa: E731
    verdict = judge_links(matrix(6, slow_uplink), world_size=6, nodes=nodes)
    assert named(verdict) == ([], [2], []) and verdict.slow_nodes[0].ranks == (4, 5) and verdict.slow_nic_rank == -1
    assert verdict.summary_line().startswith("links: node 2's uplink is slow (ranks 4, 5): ")


@pytest.mark.fast
def test_a_slow_uplink_between_two_nodes_cannot_be_told_from_the_design():
    nodes = (0, 0, 1, 1)
    verdict = judge_links(matrix(4, two_tier(nodes, between=3.0)), world_size=4, nodes=nodes)
    assert named(verdict) == ([], [], [])


@pytest.mark.fast
def test_two_ranks_have_nothing_to_compare_with():
    verdict = judge_links(matrix(2, lambda s, d: 48.0), world_size=2)
    assert verdict.judged == 0 and verdict.summary_line().startswith("links: nothing to compare with at 2 ranks: 0→1 ")


@pytest.mark.fast
def test_a_ring_sees_a_slow_network_on_its_few_links():
    ring = {(r, (r + 1) % 4): (12.0 if 2 in (r, (r + 1) % 4) else 48.0) * MB for r in range(4)}
    assert named(judge_links(ring, world_size=4)) == ([(2, "all")], [], [])


@pytest.mark.fast
def test_a_link_is_slow_only_when_most_of_its_recent_samples_are():
    def samples(slow_share: list[bool]) -> list[LinkSample]:
        steps = []
        for slow_now in slow_share:
            steps += [LinkSample(s, d, int((12 if slow_now and (s, d) == (0, 1) else 48) * MB), 1.0)
                      for s in range(4) for d in range(4) if s != d]
        return steps

    assert named(judge_samples(samples([True, False, True, True, False]), world_size=4)) == ([], [], [])  # 3 of 5
    assert named(judge_samples(samples([True, True, False, True, True]), world_size=4)) == ([], [], [((0, 1),)])  # 4 of 5
    # Only the last `window` samples count: a link that recovered is cleared.
    recovered = samples([True] * 12 + [False] * 4)
    assert named(judge_samples(recovered, world_size=4, window=4)) == ([], [], [])
    assert named(judge_samples(recovered, world_size=4, window=None)) == ([], [], [((0, 1),)])


@pytest.mark.fast
def test_during_training_a_link_is_named_only_once_it_has_enough_samples():
    # One cold first step (seen on the lab: 1→2 at 33 MB/s against 50-57 at step 1 of 200) named
    # a link on equal links; a link is named once MIN_TRAINING_SAMPLES steps agree.
    def steps(count: int, slow: tuple[int, int] | None = (1, 2)) -> list[LinkSample]:
        return [LinkSample(s, d, int((12 if (s, d) == slow else 48) * MB), 1.0)
                for _ in range(count) for s in range(4) for d in range(4) if s != d]

    assert MIN_TRAINING_SAMPLES == 5
    for count in range(1, MIN_TRAINING_SAMPLES):
        verdict = judge_samples(steps(count), world_size=4, min_samples=MIN_TRAINING_SAMPLES)
        assert named(verdict) == ([], [], []) and verdict.samples == count
        assert named(judge_samples(steps(count), world_size=4)) == ([], [], [((1, 2),)])  # a matrix's rule: named
    assert named(judge_samples(steps(MIN_TRAINING_SAMPLES), world_size=4, min_samples=MIN_TRAINING_SAMPLES)) == (
        [], [], [((1, 2),)])
    # A slow network (every link of rank 2) waits for its samples too.
    network = [LinkSample(s, d, int((12 if 2 in (s, d) else 48) * MB), 1.0) for s in range(4) for d in range(4) if s != d]
    assert named(judge_samples(network, world_size=4, min_samples=MIN_TRAINING_SAMPLES)) == ([], [], [])
    assert named(judge_samples(network * MIN_TRAINING_SAMPLES, world_size=4, min_samples=MIN_TRAINING_SAMPLES))[0] == [(2, "all")]
    with pytest.raises(ValueError, match="min_samples=0"):
        judge_samples(steps(1), world_size=4, min_samples=0)


@pytest.mark.fast
@pytest.mark.parametrize("bandwidths, options, message", [
    ({(0, 1): 1.0}, {"threshold": 1.5}, "between 0 and 1"),
    ({(0, 3): 1.0}, {}, "not a link between two of the 2 ranks"),
    ({(1, 1): 1.0}, {}, "not a link"),
    ({(0, 1): 0.0}, {}, "must be a positive number"),
    ({(0, 1): 1.0}, {"nodes": (0,)}, "node of each of the 2 ranks"),
])
def test_bad_input_is_refused_with_the_reason(bandwidths, options, message):
    with pytest.raises(ValueError, match=message):
        judge_links(bandwidths, world_size=2, **options)


# -- the matrix file -----------------------------------------------------------------------


def measured(p: int = 3, nodes=(0, 0, 1)) -> LinkMatrix:
    samples = tuple(LinkSample(s, d, 1 << 20, 0.02 * (1 + s) + 0.001 * r) for r in range(3)
                    for s in range(p) for d in range(p) if s != d)
    return LinkMatrix(world_size=p, samples=samples, message_bytes=1 << 20, repeats=3, nodes=nodes,
                      nodes_from="GROUP_RANK", hosts=("a", "b", "c"))


@pytest.mark.fast
def test_the_matrix_file_round_trips_and_says_what_it_holds(tmp_path):
    original = measured()
    path = tmp_path / "links.json"
    write_link_matrix(original, path)
    assert load_link_matrix(path).as_dict() == original.as_dict()
    data = json.loads(path.read_text())
    assert (data["format"], data["version"]) == ("ddp-ring-hooks links", 1)
    assert (data["nodes"], data["nodes_from"]) == ([0, 0, 1], "GROUP_RANK")
    assert data["bandwidth_Bps"][0][0] is None and data["bandwidth_Bps"][2][0] == pytest.approx((1 << 20) / 0.061)
    assert data["verdict"]["summary"].startswith("links: ") and original.missing() == []
    table = format_table(original, original.judge())
    assert table.splitlines()[0].split() == ["from\\to", "0", "[n0]", "1", "[n0]", "2", "[n1]"]


@pytest.mark.fast
def test_a_file_that_is_not_a_link_matrix_of_this_version_is_refused(tmp_path):
    path = tmp_path / "links.json"
    path.write_text(json.dumps([{"algorithm": "ring"}]))
    with pytest.raises(ValueError, match="is not a link matrix"):
        load_link_matrix(path)
    path.write_text(json.dumps({"format": "ddp-ring-hooks links", "version": 99}))
    with pytest.raises(ValueError, match="version 99; this version reads version 1"):
        load_link_matrix(path)
    with pytest.raises(ValueError, match="cannot read link matrix"):
        load_link_matrix(tmp_path / "missing.json")


def test_the_rule_never_imports_torch():
    assert not imports_torch("ddp_ring_hooks.links")


# -- the probe on local ranks -----------------------------------------------------------------


def _probe_on_rank(rank: int, world_size: int) -> LinkMatrix:
    from ddp_ring_hooks.runtime.link_probe import measure_links

    return measure_links(message_bytes=4096, repeats=2)


@pytest.mark.timeout(120)
def test_every_rank_gets_the_same_complete_matrix():
    first, second = spawn_ranks(_probe_on_rank, 2, timeout=100)
    assert first == second and first.missing() == [] and len(first.samples) == 2 * 2
    assert first.nodes is None and first.nodes_from is None  # no torchrun variables: the nodes are unknown


@pytest.mark.timeout(180)
def test_the_command_on_local_ranks_measures_every_link_and_writes_its_files(tmp_path):
    command = [sys.executable, "-m", "ddp_ring_hooks", "links", "--nproc", "3", "--size", "64K", "--repeats", "2",
               "--timeout", "120", "--json", str(tmp_path / "links.json"), "--plot", str(tmp_path / "links.png")]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=170,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    matrix = load_link_matrix(tmp_path / "links.json")
    assert matrix.world_size == 3 and matrix.missing() == [] and matrix.message_bytes == 64 << 10
    assert all(len(values) == 2 for values in _per_link(matrix).values())  # 3 rounds, one bye each, 2 repeats
    assert all(b > 0 for b in matrix.bandwidths.values())
    assert (tmp_path / "links.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matrix.nodes == (0, 0, 0) and matrix.nodes_from == "GROUP_RANK"  # spawned like torchrun on one machine
    lines = done.stdout.splitlines()
    assert "3 ranks, gloo, 64K per transfer, 3 rounds x 2 repeats" in lines[0]
    assert lines[2].split() == ["from\\to", "0", "1", "2"] and lines[6].startswith("links: ")


def _per_link(matrix: LinkMatrix) -> dict:
    per_link: dict = {}
    for sample in matrix.samples:
        per_link.setdefault((sample.src, sample.dst), []).append(sample.seconds)
    return per_link


@pytest.mark.fast
def test_the_command_refuses_bad_arguments_before_starting_ranks(capsys):
    assert cli_main(["links", "--nproc", "1"]) == 2
    assert "--nproc must be at least 2" in capsys.readouterr().err
    assert cli_main(["links", "--threshold", "1.5"]) == 2
    assert "between 0 and 1" in capsys.readouterr().err
    assert cli_main(["links", "--size", "4 kilobytes"]) == 2
    assert "cannot read size" in capsys.readouterr().err


# -- on the emulated lab ----------------------------------------------------------------------


def run_links_on_lab(lab, tmp_path, *options: str) -> tuple[dict, str]:
    """``ddp-ring-hooks links`` on every host of ``lab`` (one rank per host, ``lab run``):
    the JSON it wrote and host 0's output."""
    path = tmp_path / "links.json"
    [first, *_] = lab.run([sys.executable, "-m", "ddp_ring_hooks", "links", "--timeout", "100", "--json", str(path),
                           *options], env={"PYTHONPATH": str(REPO)}, timeout=150)
    return json.loads(path.read_text()), first.stdout


@pytest.mark.timeout(180)
def test_a_host_with_a_slow_link_is_named_as_that_ranks_network(lab_machine, tmp_path):
    from ddp_ring_hooks.lab import EmulatedCluster

    with EmulatedCluster(hosts=4, link="400Mbit", slow={2: "100Mbit"}) as lab:
        data, output = run_links_on_lab(lab, tmp_path, "--size", "1M", "--repeats", "3")
    verdict = data["verdict"]
    assert verdict["slow_nic_rank"] == 2 and verdict["slow_links"] == [] and verdict["slow_nodes"] == []
    [slow] = verdict["slow_ranks"]
    # 100 Mbit/s = 12.5 MB/s, 400 Mbit/s = 50 MB/s (a 1 MiB message can read a little faster: the shaper's burst).
    assert slow["in_Bps"] == pytest.approx(12.5e6, rel=0.3) and slow["out_Bps"] == pytest.approx(12.5e6, rel=0.3)
    assert slow["others_Bps"] == pytest.approx(50e6, rel=0.3)
    assert data["nodes"] == [0, 1, 2, 3] and data["nodes_from"] == "GROUP_RANK"
    table = output.split("\n# wrote")[0].split("* = named below\n")[1]
    assert "links: rank 2's network is slow: " in output and table.count("*") == 6  # its row and column


@pytest.mark.timeout(180)
def test_a_slow_link_inside_a_node_is_named_as_the_pair_not_a_network(lab_machine, tmp_path):
    from ddp_ring_hooks.lab import EmulatedCluster

    # Host 0's own link at 200 Mbit/s: inside node 0, 0⇄1 runs at 200 against the other node's
    # unshaped 2⇄3; between nodes every pair gets its share of a 100 Mbit/s uplink, host 0 too.
    with EmulatedCluster(hosts=4, nodes=2, uplink="100Mbit", slow={0: "200Mbit"}) as lab:
        data, output = run_links_on_lab(lab, tmp_path, "--size", "2M", "--repeats", "5")
    verdict = data["verdict"]
    assert data["nodes"] == [0, 0, 1, 1]
    assert verdict["slow_ranks"] == [] and verdict["slow_nodes"] == [] and verdict["slow_nic_rank"] == -1
    assert [(group["links"], group["tier"]) for group in verdict["slow_links"]] == [([[0, 1], [1, 0]], "inside nodes")]
    assert verdict["tier_medians_Bps"]["inside nodes"] > 4 * verdict["tier_medians_Bps"]["between nodes"]
    assert "links: 0→1 and 1→0 are slow: " in output


@pytest.mark.timeout(240)
def test_equal_links_under_lab_torchrun_name_nothing(lab_machine, tmp_path):
    path = tmp_path / "links.json"
    command = [sys.executable, "-m", "ddp_ring_hooks", "lab", "torchrun", "--hosts", "3", "--link", "400Mbit",
               "--timeout", "200", "-m", "ddp_ring_hooks", "links", "--size", "1M", "--repeats", "3", "--json", str(path)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=230,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(path.read_text())
    verdict = data["verdict"]
    assert (verdict["slow_ranks"], verdict["slow_nodes"], verdict["slow_links"]) == ([], [], [])
    assert data["nodes"] == [0, 1, 2]  # under torchrun every agent (host) is a node
    assert verdict["median_Bps"] == pytest.approx(50e6, rel=0.3)
    assert "links: no slow link: median " in done.stdout
