"""The α-β-γ formulas agree with the schedules they describe; the fit recovers α and β.

Each closed form in ``cost_model.formulas`` is checked against the schedule the runtime
executes: its number of steps, the bytes each rank sends, and a step-by-step simulation
(each step costs its slowest link). Pure tests, no processes.
"""

from __future__ import annotations

import math
import random

import pytest

from ddp_ring_hooks.cli.__main__ import main
from ddp_ring_hooks.cli.model import format_seconds, parse_bandwidth, parse_size, parse_time
from ddp_ring_hooks.cost_model import (
    Calibration, Links, bytes_sent_per_rank, count_steps, fit, fit_per_algorithm, fit_records, predict, simulate,
)
from ddp_ring_hooks.schedules import (
    ALGORITHMS, algorithm_examples, build_schedule, get_algorithm, resolve_options, schedule_nodes,
)
from tests.conftest import algorithm_cases

pytestmark = pytest.mark.fast  # no test here starts a process

N = 3.0e6  # bytes per rank


def shapes(world_size: int):
    """``(algorithm, options)`` for every algorithm, several tree depths and node shapes."""
    yield from algorithm_cases(world_size, flat_hierarchies=True)
    yield "tree", {"segments": 7}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 31, 32, 48, 64])
def test_closed_forms_equal_the_step_by_step_cost_of_the_schedules(world_size):
    rng = random.Random(world_size)
    for algorithm, options in shapes(world_size):
        alpha, beta, gamma = rng.uniform(1e-6, 1e-4), rng.uniform(1e-11, 1e-9), rng.uniform(0, 1e-10)
        links = Links(alpha, beta, gamma)
        if algorithm == "hierarchical":
            # The closed form holds where the links between nodes are the slow part of every
            # step they are in (what a hierarchy is for): their bytes cost 8N times more.
            nodes = world_size // options["local_size"]
            links = Links(alpha, beta, beta / (8 * nodes) * rng.random(),
                          local=Links(rng.uniform(1e-7, 1e-6), beta / (8 * nodes) * rng.random()))
        # The size the prediction is for: options chosen by size (hierarchical's segments) alike.
        schedule = build_schedule(algorithm, world_size, nbytes=int(N), **options)
        # The double binary tree is priced per NIC (a rank's links share it), the others per link.
        per_nic = {"placement": tuple(range(world_size)), "shared_uplinks": True}
        where = per_nic if algorithm == "double_binary_tree" else {"placement": schedule_nodes(schedule)}
        simulated = simulate(schedule, N, links, **where)
        assert predict(algorithm, N, world_size, links, **options) == pytest.approx(simulated, rel=1e-12), (
            algorithm, options,
        )


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 7, 8, 12])
def test_a_closed_form_of_the_busiest_ranks_bytes_is_the_count_on_the_schedule(world_size):
    """The advisor prices large world sizes with ``busiest_sends`` instead of building the
    schedule: it must say what the schedule says, for every example option."""
    for name, options in algorithm_examples(world_size, scheduled_only=True):
        closed_form = get_algorithm(name).busiest_sends
        if closed_form is None or not get_algorithm(name).applies(world_size, resolve_options(name, options)):
            continue
        counted = max(bytes_sent_per_rank(build_schedule(name, world_size, **options), 1.0))
        assert closed_form(world_size, **options) == pytest.approx(counted), (name, options)


@pytest.mark.parametrize("world_size", [2, 3, 5, 6, 8, 16, 20])
def test_steps_and_bytes_per_rank_match_the_textbook_counts(world_size):
    p, lg = world_size, math.ceil(math.log2(world_size))
    pof2 = 1 << (p.bit_length() - 1)
    naive = build_schedule("naive", p)
    assert count_steps(naive) == 2 * (p - 1)
    assert bytes_sent_per_rank(naive, N) == pytest.approx([(p - 1) * N] + [N] * (p - 1))

    ring_bytes = 2 * (p - 1) / p * N
    assert bytes_sent_per_rank(build_schedule("ring", p), N) == pytest.approx([ring_bytes] * p)

    tree = build_schedule("tree", p)
    assert count_steps(tree) == 2 * lg
    assert bytes_sent_per_rank(tree, N)[0] == pytest.approx(lg * N)  # the root feeds lg p subtrees
    assert [bytes_sent_per_rank(tree, N)[r] for r in range(1, p, 2)] == pytest.approx([N] * (p // 2))  # leaves
    assert sum(bytes_sent_per_rank(tree, N)) == pytest.approx(2 * (p - 1) * N)  # one message up, one down per rank

    hd = build_schedule("halving_doubling", p)
    fold = 0 if pof2 == p else 1
    assert count_steps(hd) == 2 * int(math.log2(pof2)) + 2 * fold
    survivor_bytes = 2 * (pof2 - 1) / pof2 * N + fold * N  # the partner of a folded rank also unfolds
    assert max(bytes_sent_per_rank(hd, N)) == pytest.approx(survivor_bytes)

    for g in (d for d in range(1, p + 1) if p % d == 0):
        hierarchical = build_schedule("hierarchical", p, local_size=g)
        assert bytes_sent_per_rank(hierarchical, N) == pytest.approx([ring_bytes] * p)


def test_ring_barely_grows_with_p_and_trees_win_small_buffers_at_scale():
    links = {"alpha": 5e-6, "beta": 1 / 100e9}
    ring = [predict("ring", 1e9, p, **links) for p in (4, 64)]
    assert ring[1] / ring[0] < 1.4
    assert predict("tree", 4096, 64, **links) < predict("ring", 4096, 64, **links) / 5
    assert predict("tree", 1e9, 64, **links) > 5 * predict("ring", 1e9, 64, **links)


def test_predict_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown algorithm 'butterfly'"):
        predict("butterfly", 1, 4, alpha=1, beta=1)
    with pytest.raises(ValueError, match="does not divide"):
        predict("hierarchical", 1, 6, alpha=1, beta=1, local_size=4)
    with pytest.raises(ValueError, match="non-negative"):
        predict("ring", -1, 4, alpha=1, beta=1)


def test_fit_recovers_alpha_beta_from_exact_and_noisy_messages():
    alpha, beta = 25e-6, 1 / 3e9
    sizes = [2**k for k in range(4, 26, 3)]
    exact = fit([(n, alpha + n * beta) for n in sizes])
    assert exact.alpha == pytest.approx(alpha, rel=1e-9) and exact.beta == pytest.approx(beta, rel=1e-9)
    rng = random.Random(0)
    noisy = fit([(n, (alpha + n * beta) * rng.uniform(0.97, 1.03)) for n in sizes for _ in range(5)])
    assert noisy.alpha == pytest.approx(alpha, rel=0.05) and noisy.beta == pytest.approx(beta, rel=0.05)


@pytest.mark.parametrize("algorithm, options", [("ring", {}), ("tree", {"segments": 2}), ("halving_doubling", {})])
def test_fit_per_algorithm_inverts_predict(algorithm, options):
    truth = Calibration(alpha=80e-6, beta=2e-10)
    samples = [(n, truth.predict(algorithm, n, 6, **options)) for n in (1e3, 1e5, 1e7)]
    fitted = fit(samples, algorithm=algorithm, world_size=6, **options)
    assert fitted.alpha == pytest.approx(truth.alpha, rel=1e-9) and fitted.beta == pytest.approx(truth.beta, rel=1e-9)


def test_fit_records_shares_alpha_beta_across_algorithms_and_skips_native():
    truth = Calibration(alpha=40e-6, beta=5e-10)
    records = [
        {"algorithm": a, "world_size": p, "nbytes": n, "time_us": truth.predict(a, n, p) * 1e6}
        for a in ("ring", "naive", "tree", "halving_doubling") for p in (3, 4) for n in (1e3, 1e6, 1e8)
    ]
    records.append({"algorithm": "native", "world_size": 4, "nbytes": 1e6, "time_us": 1e9})
    fitted = fit_records(records)
    assert (fitted.alpha, fitted.beta) == pytest.approx((truth.alpha, truth.beta), rel=1e-6)


def test_fit_per_algorithm_gives_each_algorithm_its_own_constants():
    truths = {"ring": Calibration(3e-5, 1e-9), "tree": Calibration(1e-5, 4e-9)}
    records = [
        {"algorithm": a, "world_size": 5, "nbytes": n, "time_us": truth.predict(a, n, 5, **({"segments": 2} if a == "tree" else {})) * 1e6}
        for a, truth in truths.items() for n in (1e3, 1e5, 1e7)
    ]
    fitted = fit_per_algorithm(records, tree={"segments": 2})
    for algorithm, truth in truths.items():
        assert (fitted[algorithm].alpha, fitted[algorithm].beta) == pytest.approx((truth.alpha, truth.beta), rel=1e-9)
    with pytest.raises(ValueError, match="one world size at a time"):
        fit_per_algorithm(records + [{**records[0], "world_size": 6}])


def test_gamma_folds_into_beta_because_every_formula_reduces_half_the_bytes_it_sends():
    """So ``fit`` does not fit gamma: beta + gamma/2 predicts exactly the same times."""
    for algorithm in ("ring", "naive", "tree", "halving_doubling"):
        for p in (3, 4, 7):
            with_gamma = predict(algorithm, N, p, alpha=1e-5, beta=1e-10, gamma=4e-11)
            folded = predict(algorithm, N, p, alpha=1e-5, beta=1e-10 + 2e-11)
            assert with_gamma == pytest.approx(folded, rel=1e-12)


def test_fit_drops_parameters_that_would_be_negative_and_names_bad_input():
    # Times that fall with size would need a negative beta: beta is fixed at 0 instead.
    fitted = fit([(10, 2e-3), (1e6, 1e-3)])
    assert fitted.beta == 0.0 and fitted.alpha > 0
    with pytest.raises(ValueError, match="2 or more different sizes"):
        fit([(100, 1e-3), (100, 2e-3)])
    with pytest.raises(ValueError, match="positive"):
        fit([(100, 0.0), (200, 1e-3)])


def test_units_parse_like_people_write_them():
    assert parse_size("1GB") == 2**30 and parse_size("4MiB") == 4 * 2**20 and parse_size("512") == 512
    assert parse_bandwidth("100GB/s") == 100e9 and parse_bandwidth("25Gb/s") == 25e9 / 8
    assert parse_bandwidth("10Gbit/s") == parse_bandwidth("10Gbps") == 1.25e9
    assert parse_time("5us") == pytest.approx(5e-6) and parse_time("2ms") == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="cannot read size"):
        parse_size("3 bananas")


def test_model_cli_prints_the_predicted_table(capsys):
    assert main(["model", "--size", "1GB", "--world-sizes", "4,8,64", "--bandwidth", "100GB/s", "--latency", "5us"]) == 0
    out = capsys.readouterr().out
    table = out.split("\n\n")[0].splitlines()[2:]  # title, header, then one row per algorithm
    rows = {line.split()[0]: line.split() for line in table}
    assert set(rows) == set(ALGORITHMS) - {"hierarchical"}
    for algorithm, cells in rows.items():
        expected = [format_seconds(predict(algorithm, 2**30, p, alpha=5e-6, beta=1e-11)) for p in (4, 8, 64)]
        assert " ".join(cells[1:]) == " ".join(expected)
    assert "ring barely grows with p" in out and "it beats the ring below" in out
    # The text under the table names the ring's bytes (21.1 ms at p=64) and ends on the table's
    # own cells (21.8 ms): it once gave only the first, which read as a mismatch.
    prose = " ".join(out.split("\n\n")[1].split())
    ring = rows["ring"]
    assert f"The table adds the two: {ring[1]} {ring[2]} at p=4, {ring[5]} {ring[6]} at p=64." in prose


def test_model_cli_hierarchical_row_and_bad_units(capsys):
    assert main(["model", "--world-sizes", "8,12", "--local-size", "4", "--local-bandwidth", "300GB/s"]) == 0
    assert "hierarchical (4/node)" in capsys.readouterr().out
    assert main(["model", "--bandwidth", "fast"]) == 2
    assert "cannot read bandwidth 'fast'" in capsys.readouterr().err
    assert main(["model", "--bandwidth", "0GB/s"]) == 2  # was a ZeroDivisionError traceback
    assert "bandwidth must be positive" in capsys.readouterr().err
    assert main(["model", "--size", "0", "--latency", "0us"]) == 0  # nothing to send: no 0/0


def test_model_cli_tree_crossover_follows_segments(capsys):
    assert main(["model", "--world-sizes", "8", "--segments", "4", "--bandwidth", "100GB/s", "--latency", "5us"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # undo the text wrapping
    steps = int(predict("tree", 0, 8, alpha=1.0, beta=0.0, segments=4))
    assert f"tree (4 segments) at p=8: {steps} latency steps instead of 14" in out, out
    crossover = parse_size(out.split("it beats the ring below ")[1].split(" per rank")[0].replace(" ", ""))
    tree, ring = (predict(a, crossover, 8, alpha=5e-6, beta=1e-11, **o) for a, o in (("tree", {"segments": 4}), ("ring", {})))
    assert tree == pytest.approx(ring, rel=0.01)  # the printed size is where the two times meet


def test_every_command_reads_sizes_with_one_parser_and_says_so_once():
    from ddp_ring_hooks import bench, units
    from ddp_ring_hooks.cli import model
    from ddp_ring_hooks.cli.__main__ import build_parser

    assert model.parse_size is bench.parse_size is units.parse_size
    # model once rejected 64K and read 64KB as 64,000 bytes, while bench read 64K as 65,536.
    assert parse_size("64K") == parse_size("64KB") == parse_size("64KiB") == parse_size("65536") == 65536
    commands = build_parser()._subparsers._group_actions[0].choices
    for name in ("model", "bench"):
        text = " ".join(commands[name].format_help().split())
        assert text.count(units.SIZE_HELP) == 1, (name, text)


def test_help_shows_no_docstring_markup():
    from ddp_ring_hooks.cli.__main__ import build_parser

    for name, command in build_parser()._subparsers._group_actions[0].choices.items():
        text = command.format_help()
        assert "``" not in text and ":mod:" not in text and ":func:" not in text, (name, text)


def test_model_commentary_is_true_for_the_size_asked(capsys):
    # At 64 KB the ring's latency term dominates: the table shows it growing about 20x with p.
    assert main(["model", "--size", "64KB", "--world-sizes", "4,8,64"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "barely grows" not in out
    growth = predict("ring", 2**16, 64, alpha=5e-6, beta=1e-11) / predict("ring", 2**16, 4, alpha=5e-6, beta=1e-11)
    assert f"ring grows {growth:.3g}x from p=4 to p=64 at this size" in out, out
    assert main(["model", "--size", "1GB", "--world-sizes", "4,8,64"]) == 0
    assert "ring barely grows with p" in capsys.readouterr().out


def test_model_cli_prices_every_row_on_two_tiers_with_placement(capsys):
    from ddp_ring_hooks.cost_model import Links, TwoTier

    lab = ["--bandwidth", "400Mb/s", "--latency", "200us", "--local-bandwidth", "1GB/s", "--local-latency", "50us"]
    assert main(["model", "--size", "16M", "--world-sizes", "4,6", "--placement", "2", "--local-size", "2", *lab]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:9] if line.strip()}
    network = TwoTier(Links(200e-6, 8 / 400e6, local=Links(50e-6, 1e-9)), ranks_per_node=2)
    for algorithm, options in (("ring", {}), ("tree", {}), ("hierarchical", {"local_size": 2})):
        cells = [format_seconds(network.predict(algorithm, 16 << 20, p, **options)) for p in (4, 6)]
        assert " ".join(rows[algorithm][-4:]) == " ".join(cells), (algorithm, rows[algorithm])
    assert "per node's uplink, shared by its ranks (nodes of 2 ranks)" in out and "two tiers:" in out
    # The misplaced ring: twice the bytes through the busiest uplink; ring_order hosts undoes it.
    assert main(["model", "--size", "16M", "--world-sizes", "4", "--placement", "0,1,0,1", "--algorithms", "ring", *lab]) == 0
    crossing = capsys.readouterr().out.splitlines()[2].split()[-2:]
    assert main(["model", "--size", "16M", "--world-sizes", "4", "--placement", "0,1,0,1", "--algorithms", "ring",
                 "--ring-order", "hosts", "--node-of", "0,1,0,1", *lab]) == 0
    fixed = capsys.readouterr().out.splitlines()[2].split()[-2:]
    assert crossing == ["1.01", "s"] and fixed == ["505", "ms"]
