"""``ddp-ring-hooks lab table``: the seed's naive-versus-ring table, measured on a real lab.

- Without root: both formulas give the measured table's numbers (16 MiB on 400 Mbit/s links); --help
  shows the command; bad input is refused with the fix before any lab is made.
- With root (skipped elsewhere, with the reason): one run of the command on a lab of 3 hosts
  (p = 2 and 3; 2 and 8 MiB, 4x apart so that one noisy point cannot swing the α-β fit;
  400 Mbit/s; five rounds, each point their median and their fastest), shared by the assertions:
  every all-reduce correct; naive grows with p as the corrected formula says, the ring far less;
  each cell's fastest round within the link's bounds, and a median well above it named under the
  table; β fitted per algorithm and p close to the link's 1/B; the JSON file holds what was
  printed; no namespace is left behind.

Run: ``python -m pytest -q tests/test_lab_table.py`` (as root for the lab test).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_ring_hooks.cli.__main__ import main as cli_main
from ddp_ring_hooks.cli._seed_table import WAITED, article_seconds, corrected_seconds
from ddp_ring_hooks.lab import registry
from ddp_ring_hooks.lab.iproute import existing_namespaces
from ddp_ring_hooks.units import format_size

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20
LINK = 400_000_000  # bit/s


@pytest.mark.fast
def test_the_formulas_give_the_seed_tables_numbers():
    # 16 MiB on 400 Mbit/s: n/B = 0.3355 s. Measured on the lab: naive 0.70 / 2.12 / 4.92 s.
    one_pass = 16 * MiB * 8 / LINK
    for p, naive, ring in ((2, 2, 1), (4, 6, 1.5), (8, 14, 1.75)):
        assert corrected_seconds("naive", 16 * MiB, p, link_bits_per_s=LINK) == pytest.approx(naive * one_pass)
        assert corrected_seconds("ring", 16 * MiB, p, link_bits_per_s=LINK) == pytest.approx(ring * one_pass)
    assert article_seconds("naive", 16 * MiB, 8, link_bits_per_s=LINK) == pytest.approx(8 * one_pass)
    assert article_seconds("ring", 16 * MiB, 8, link_bits_per_s=LINK) == pytest.approx(7 / 8 * one_pass)


@pytest.mark.fast
def test_help_shows_the_command(capsys):
    with pytest.raises(SystemExit) as done:
        cli_main(["lab", "table", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "ddp-ring-hooks lab table --world-sizes 2,4,8" in out and "--worker" not in out


@pytest.mark.fast
@pytest.mark.parametrize("arguments, message", [
    (["--world-sizes", "1,4"], "each at least 2"),
    (["--world-sizes", "2,2"], "different numbers of hosts"),
    (["--world-sizes", "two"], "numbers of hosts, e.g. 2,4,8"),
    (["--sizes", "2"], "at least one float"),
    (["--sizes", "4Q"], "4Q"),
    (["--link", "400Mbps"], "megabytes per second"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--json", "/no/such/dir/table.json"], "no such directory"),
])
def test_bad_input_is_refused_with_the_fix(arguments, message, capsys):
    assert cli_main(["lab", "table", *arguments]) == 2
    assert message in capsys.readouterr().err


# -- with root: a real lab ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def measured(lab_machine, tmp_path_factory):
    path = tmp_path_factory.mktemp("lab_table") / "table.json"
    # 5 rounds, the median shown: one pause of the shared cores can take 2 consecutive rounds of a
    # cell (naive at p = 3 read 2.0x the link's time in a fresh-ci run with 3 rounds; alone 3 of 3 passed)
    command = [sys.executable, "-m", "ddp_ring_hooks", "lab", "table", "--world-sizes", "2,3", "--sizes", "2M,8M",
               "--link", "400Mbit", "--rounds", "5", "--timeout", "100", "--json", str(path)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout, json.loads(path.read_text())


@pytest.mark.solo  # its setup measures the table (the module's fixture): the cores to itself
@pytest.mark.timeout(150)
def test_the_table_shows_naive_growing_with_p_and_the_ring_not(measured):
    out, table = measured
    rows = {(r["algorithm"], r["world_size"], r["nbytes"]): r for r in table["rows"]}
    assert sorted(rows) == sorted((a, p, n) for a in ("naive", "ring") for p in (2, 3) for n in (2 * MiB, 8 * MiB))
    assert all(r["wrong"] == 0 for r in rows.values())
    # What the network allows, each cell's fastest round: no all-reduce beats the link (tbf lets a
    # 5 ms burst through: 0.85), none takes half as long again. The median may wait on more: once in
    # a fresh-clone run and once in CI, naive at p = 3 read 2.0x in most rounds (a stall the size of
    # TCP's 200 ms minimum retransmission timeout); 60 rounds alone showed no timeout.
    for row in rows.values():
        assert 0.85 <= row["x_corrected_fastest"] <= 1.5, row
        assert row["fastest_s"] <= row["measured_s"], row
        waited = row["measured_s"] > WAITED * row["fastest_s"]
        assert waited == (f"{row['algorithm']} p={row['world_size']} {format_size(row['nbytes'])}: median" in out), row
    growth = {a: rows[(a, 3, 8 * MiB)]["measured_s"] / rows[(a, 2, 8 * MiB)]["measured_s"] for a in ("naive", "ring")}
    assert growth["naive"] >= 1.6 and growth["ring"] <= 1.6 and growth["naive"] > growth["ring"] * 1.3, growth
    assert "the seed's table, measured: all-reduce of 8M per rank on 400Mbit links" in out
    assert f"{rows[('naive', 3, 8 * MiB)]['measured_s']:.3f}s" in out  # what was printed is what was written


@pytest.mark.timeout(150)
def test_beta_is_fitted_close_to_the_links_own(measured):
    out, table = measured
    fits = {(f["algorithm"], f["world_size"]): f for f in table["fits"]}
    assert sorted(fits) == [("naive", 2), ("naive", 3), ("ring", 2), ("ring", 3)]
    for fit in fits.values():
        assert 0.85 <= fit["beta_x_link"] <= 1.25, fit
        assert f"= {fit['beta_x_link']:4.2f}/B" in out


@pytest.mark.timeout(150)
def test_the_table_leaves_no_namespace_behind(measured):
    out, _ = measured
    name = re.search(r"^# lab (drh\d+): 3 hosts", out, re.MULTILINE).group(1)
    assert registry.find(name) is None
    assert not [namespace for namespace in existing_namespaces() if namespace.startswith(f"{name}-")]


@pytest.mark.fast
def test_a_cell_whose_rounds_waited_is_named_under_the_table():
    from ddp_ring_hooks.bench import BenchRecord
    from ddp_ring_hooks.cli._seed_table import format_seed_table, table_rows

    def record(algorithm, time_ms, fastest_ms):  # 2 MiB at p = 3: naive 0.168 s, ring 0.056 s at 400 Mbit/s
        return BenchRecord(algorithm, 3, 2 * MiB, MiB // 2, "float32", time_ms * 1e3, 0.0, 0.0, 0,
                           fastest_us=fastest_ms * 1e3)

    rows = table_rows([record("naive", 339, 170), record("ring", 58, 57)], link_bits_per_s=LINK)
    assert rows[0]["x_corrected_fastest"] == pytest.approx(170 / 167.8, rel=1e-3)
    out = format_seed_table(rows, link_bits_per_s=LINK, rounds=5)
    assert "# naive p=3 2M: median 0.339s, fastest round 0.170s: some rounds waited" in out
    assert "ring p=3" not in out  # 58 against 57 ms: within WAITED
