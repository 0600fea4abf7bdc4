"""The in-memory run, the explanation, the layouts and the animation, for every algorithm.

Expected values are computed here from the inputs (column sums of random integers, the
schedule's own step count), never copied from an earlier run of the code under test.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys

import pytest

from ddp_ring_hooks.cli.__main__ import main
from ddp_ring_hooks.schedules import ALGORITHMS, Op, Schedule, Step, Transfer, checked_schedule
from ddp_ring_hooks.viz import explain, simulate
from ddp_ring_hooks.viz.layout import choose_layout
from tests.conftest import algorithm_cases

WORLD_SIZES = range(2, 9)
ALPHA, BETA = 5e-6, 1e-9


def options_for(algorithm: str, world_size: int) -> dict:
    """The registry's first example options for ``algorithm`` at ``world_size`` (several nodes
    when possible; one node of every rank when ``world_size`` is prime)."""
    examples = [options for name, options in algorithm_cases(world_size, flat_hierarchies=True) if name == algorithm]
    return examples[0]


def schedule_for(algorithm: str, world_size: int) -> Schedule:
    return checked_schedule(algorithm, world_size, **options_for(algorithm, world_size))


CASES = [(algorithm, p) for algorithm in ALGORITHMS for p in WORLD_SIZES]


@pytest.mark.fast
@pytest.mark.parametrize(("algorithm", "world_size"), CASES)
def test_in_memory_run_equals_the_sum(algorithm, world_size):
    schedule = schedule_for(algorithm, world_size)
    rng = random.Random(f"{algorithm}-{world_size}")
    values = [[rng.randint(-1000, 1000) for _ in range(schedule.num_chunks)] for _ in range(world_size)]
    simulation = simulate(schedule, values=values)
    everyone = frozenset(range(world_size))
    for rank, chunks in enumerate(simulation.final):
        for chunk, state in enumerate(chunks):
            assert state.value == sum(row[chunk] for row in values), (rank, chunk)
            assert state.contributors == everyone, (rank, chunk)
    assert len(simulation.frames) == len(schedule.steps) + 2


@pytest.mark.fast
@pytest.mark.parametrize(("algorithm", "world_size"), CASES)
def test_explain_shows_every_step_and_the_full_sum_everywhere(algorithm, world_size):
    schedule = schedule_for(algorithm, world_size)
    text = explain(simulate(schedule), alpha=ALPHA, beta=BETA)
    steps = len(schedule.steps)
    headers = re.findall(r"^step (\d+)/(\d+) - ", text, flags=re.MULTILINE)
    assert [int(k) for k, _ in headers] == list(range(1, steps + 1))
    assert {int(n) for _, n in headers} == {steps}
    assert re.search(rf"^  steps\s+{steps}$", text, flags=re.MULTILINE)

    total = world_size * (world_size + 1) // 2  # rank r holds r + 1
    everyone = "{" + ",".join(map(str, range(world_size))) + "}*"
    done = text.split("\ndone: ", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    assert len(done) == world_size
    for rank, line in enumerate(done):
        cells = re.findall(r"c(\d+)=(\S+) (\S+)", line)
        assert line.split()[:2] == ["rank", str(rank)]
        assert [int(c) for c, _, _ in cells] == list(range(schedule.num_chunks))
        assert all(value == str(total) and ranks == everyone for _, value, ranks in cells), line
    assert f"every rank holds {total} in every element" in text


@pytest.mark.fast
def test_ring_reduce_scatter_leaves_one_complete_chunk_per_rank():
    """The article's claim ("one device has the total, the others 0") is what we correct."""
    p = 4
    simulation = simulate(checked_schedule("ring", p))
    (_, _, stop), _ = checked_schedule("ring", p).phases
    after = simulation.frames[stop].state  # frames[0] is the start, frames[k] is after step k-1
    assert simulation.complete_chunks(after) == tuple((r,) for r in range(p))
    assert all(chunk.value > 0 for row in after for chunk in row)
    text = explain(simulation, alpha=ALPHA, beta=BETA)
    assert "each rank holds ONE fully reduced chunk" in text
    assert "rank 0: c0; rank 1: c1; rank 2: c2; rank 3: c3" in text


@pytest.mark.fast
def test_uneven_and_empty_chunks_follow_tensor_split():
    simulation = simulate(checked_schedule("ring", 4), elements=2)
    assert simulation.chunk_elements == (1, 1, 0, 0)
    text = explain(simulation, alpha=ALPHA, beta=BETA)
    assert "c2 empty" in text and "every rank holds 10 in every element" in text


@pytest.mark.fast
def test_bad_values_are_rejected_with_the_fix():
    with pytest.raises(ValueError, match="one per rank"):
        simulate(checked_schedule("ring", 3), values=[1, 2])
    with pytest.raises(ValueError, match="one per chunk"):
        simulate(checked_schedule("ring", 3), values=[[1], [2], [3]])


@pytest.mark.fast
@pytest.mark.parametrize(
    ("algorithm", "kind"),
    [("ring", "ring"), ("naive", "star"), ("tree", "tree"), ("double_binary_tree", "trees"), ("halving_doubling", "ring"),
     ("hierarchical", "nodes")],
)
def test_each_algorithm_gets_its_layout(algorithm, kind):
    if algorithm not in ALGORITHMS:
        pytest.skip(f"{algorithm} is not registered")
    for p in WORLD_SIZES:
        options = options_for(algorithm, p)
        layout = choose_layout(schedule_for(algorithm, p))
        expected = "ring" if kind == "nodes" and options["local_size"] == p else kind
        assert layout.kind == expected, p
        assert len(set(layout.positions)) == p  # no two ranks drawn on top of each other


@pytest.mark.fast
def test_hierarchical_layout_reads_the_node_size_the_schedule_was_built_with(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # what torchrun sets; the builder reads it too
    schedule = checked_schedule("hierarchical", 6)
    layout = choose_layout(schedule)  # the node size the schedule carries, read from the environment once
    assert dict(schedule.options)["local_size"] == 2
    assert layout.kind == "nodes" and layout == choose_layout(checked_schedule("hierarchical", 6, local_size=2))


@pytest.mark.fast
def test_tree_layout_puts_parents_above_their_children():
    schedule = checked_schedule("tree", 7)
    layout = choose_layout(schedule)
    assert len(layout.links) == 6
    for parent, child in layout.links:
        assert layout.positions[parent][1] > layout.positions[child][1]
        # The links are the schedule's own: the child's reduce goes to the parent.
        assert any(t.src == child and t.dst == parent and t.op is Op.REDUCE for s in schedule.steps for t in s.transfers)


@pytest.mark.fast
def test_unknown_algorithms_fall_back_to_a_ring():
    schedule = Schedule("mystery", 2, 1, (Step("swap", (Transfer(0, 1, 0, Op.REDUCE),)), Step("back", (Transfer(1, 0, 0, Op.COPY),))))
    assert choose_layout(schedule).kind == "ring"


def gif_frames(path) -> list[bytes]:
    from PIL import Image, ImageSequence

    with Image.open(path) as image:
        return [frame.convert("RGB").tobytes() for frame in ImageSequence.Iterator(image)]


def test_animate_cli_writes_one_gif_frame_per_step_plus_first_and_last(tmp_path):
    """Through the real command line in a fresh process with no display."""
    output = tmp_path / "ring.gif"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MPLBACKEND": ""}
    completed = subprocess.run(
        [sys.executable, "-m", "ddp_ring_hooks", "animate", "--algorithm", "ring", "--world-size", "4",
         "--output", str(output), "--no-progress"],
        capture_output=True, text=True, timeout=120, env={**env, "PYTHONPATH": ":".join(sys.path)},
    )
    assert completed.returncode == 0, completed.stderr
    frames = gif_frames(output)
    assert len(frames) == len(checked_schedule("ring", 4).steps) + 2
    assert len(set(frames)) == len(frames)


@pytest.mark.fast
def test_animate_html_embeds_every_frame_on_other_layouts(tmp_path):
    for algorithm, p in (("hierarchical", 4), ("tree", 5)):
        output = tmp_path / f"{algorithm}.html"
        args = ["animate", "--algorithm", algorithm, "--world-size", str(p), "--output", str(output), "--no-progress"]
        assert main(args + (["--local-size", "2"] if algorithm == "hierarchical" else [])) == 0
        embedded = output.read_text().count("data:image/png;base64")
        assert embedded == len(schedule_for(algorithm, p).steps) + 2


@pytest.mark.fast
def test_cli_rejects_bad_arguments_with_the_fix(capsys):
    assert main(["animate", "--output", "ring.png"]) == 2
    assert ".gif" in capsys.readouterr().err
    assert main(["animate", "--output", "ring.gif", "--dpi", "0"]) == 2
    assert "dpi" in capsys.readouterr().err
    assert main(["explain", "--algorithm", "ring", "--segments", "2"]) == 2
    assert "does not take --segments" in capsys.readouterr().err
    assert main(["explain", "--world-size", "0"]) == 2
    assert "--world-size" in capsys.readouterr().err


@pytest.mark.fast
def test_viz_reads_schedules_only():
    """The dependency rule: viz never imports hooks, runtime or torch (matplotlib only lazily)."""
    import ast
    from pathlib import Path

    import ddp_ring_hooks.viz

    for path in Path(ddp_ring_hooks.viz.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        top_level = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
        names = [alias.name for node in top_level for alias in node.names] + [
            node.module or "" for node in top_level if isinstance(node, ast.ImportFrom)
        ]
        assert not [n for n in names if n.split(".")[0] in {"hooks", "runtime", "torch", "matplotlib"}], path.name
