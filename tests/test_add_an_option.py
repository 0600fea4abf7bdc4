"""Add an option in 2 steps (``docs/architecture.md``), and find it everywhere.

A dummy algorithm, ``widget_ring`` (the ring's schedule under another name), with one dummy
option, ``widgets``, is registered for one test at a time: the registry is swapped for a copy
while the test runs, so nothing outlives it. Step 1 declares the :class:`Option` in the record,
step 2 takes it as a keyword of the builder and the cost (the cost counts one message per
widget, so a test can see the value arrive). Nothing else is written for it, and it is in
``explain``, ``animate``, ``model`` and ``bench --help``, in ``model``'s table (the row labelled
and priced with it), in the option check of ``HookState`` and ``resolve_options`` (a bad value
refused with the option's own message), in ``auto``'s options and in the advisor's settings.
Last, no module outside ``schedules/`` spells an option's name: they all read the records.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re

import pytest

from ddp_ring_hooks import HookState
from ddp_ring_hooks.cli.__main__ import build_parser, main
from ddp_ring_hooks.cost_model import Calibration, predict
from ddp_ring_hooks.schedules import (
    Algorithm, CostTerms, Option, algorithm_names, build_ring_schedule, checked_schedule, options_by_name, registry,
    resolve_options,
)
from ddp_ring_hooks.viz.text import format_seconds

pytestmark = pytest.mark.fast  # no test here starts a process

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "ddp_ring_hooks"


def _two_or_three(value: object) -> str | None:
    return None if value in (2, 3) else "must be 2 or 3"


def build_widget_ring_schedule(world_size: int, *, widgets: int):  # step 2: the builder takes it
    return dataclasses.replace(build_ring_schedule(world_size), algorithm="widget_ring")


def widget_ring_cost(world_size: int, *, widgets: int) -> CostTerms:  # step 2: so does the cost
    return CostTerms(messages=widgets, bytes=1.0)


WIDGET_RING = Algorithm(
    "widget_ring", "a ring that counts widgets (a test's dummy)",
    build=build_widget_ring_schedule, cost=widget_ring_cost, layout="ring",
    options=(Option("widgets", 2, "widgets per message", check=_two_or_three, label="{} widgets", metavar="W"),),  # step 1
)


@pytest.fixture
def widget_ring(monkeypatch):
    """``widget_ring`` registered (with the registry's own function) in a copy of the registry,
    which the test's end puts back."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    registry.register_algorithm(WIDGET_RING)
    yield WIDGET_RING
    checked_schedule.cache_clear()  # no schedule of a dummy outlives the test


def _help(command: str) -> str:
    subcommands = build_parser()._subparsers._group_actions[0].choices
    return " ".join(subcommands[command].format_help().split())  # undo the wrapping


@pytest.mark.parametrize("command", ["explain", "animate", "model", "bench"])
def test_the_option_is_a_flag_of_every_command_that_takes_options(widget_ring, command):
    text = _help(command)
    assert "--widgets W widget_ring only: widgets per message (default: 2)" in text, text


def test_models_table_labels_the_row_and_prices_it_with_the_option(widget_ring, capsys):
    def rows(*flags: str) -> dict[str, list[str]]:
        assert main(["model", "--world-sizes", "4,8", "--algorithms", "ring,widget_ring", *flags]) == 0
        table = capsys.readouterr().out.split("\n\n")[0].splitlines()[2:]
        return {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line.strip()) for line in table)}

    def cells(widgets: int) -> list[str]:
        return [format_seconds(predict("widget_ring", 2**30, p, alpha=5e-6, beta=1e-11, widgets=widgets)) for p in (4, 8)]

    assert rows("--widgets", "3")["widget_ring (3 widgets)"] == cells(3)
    assert rows()["widget_ring"] == cells(2)  # not given: the default, and no label
    assert cells(3) != cells(2)
    assert main(["model", "--widgets", "5"]) == 2
    assert "widget_ring: widgets=5 must be 2 or 3" in capsys.readouterr().err


def test_explain_runs_it_and_refuses_a_bad_value_with_the_options_check(widget_ring, capsys):
    assert main(["explain", "--algorithm", "widget_ring", "--widgets", "3", "--alpha", "1", "--beta", "0"]) == 0
    assert "3 s by the closed-form formula" in capsys.readouterr().out  # α counted once per widget
    assert main(["explain", "--algorithm", "widget_ring", "--widgets", "5"]) == 2
    assert "widget_ring: widgets=5 must be 2 or 3 (on the command line: --widgets W)" in capsys.readouterr().err
    assert main(["explain", "--algorithm", "ring", "--widgets", "3"]) == 2
    assert "ring does not take --widgets" in capsys.readouterr().err


def test_hook_state_and_resolve_options_check_it_with_its_own_message(widget_ring):
    with pytest.raises(ValueError, match="widget_ring: widgets=5 must be 2 or 3"):
        HookState(algorithm="widget_ring", widgets=5)
    with pytest.raises(ValueError, match="widget_ring: widgets=5 must be 2 or 3"):
        resolve_options("widget_ring", {"widgets": 5})
    assert HookState(algorithm="widget_ring", widgets=3).algorithm_options == {"widgets": 3}
    assert HookState(algorithm="widget_ring").algorithm_options == {"widgets": 2}
    with pytest.raises(TypeError, match="unknown option 'widget'.*did you mean 'widgets'"):
        HookState(algorithm="widget_ring", widget=3)


def test_auto_hands_it_to_the_candidate_and_the_advisor_prices_with_it(widget_ring):
    from ddp_ring_hooks.advisor import Setting, advise, profile_run
    from ddp_ring_hooks.advisor.step_model import setting_options
    from ddp_ring_hooks.runtime.selection import AutoSelector, auto_option_names

    from .test_advisor import timeline

    assert "widgets" in auto_option_names()
    selector = AutoSelector(Calibration(alpha=50e-6, beta=1e-9), 4, widgets=3)
    assert "widget_ring" in selector.candidates and selector.options["widget_ring"] == {"widgets": 3}
    with pytest.raises(ValueError, match="widget_ring: widgets=5 must be 2 or 3"):
        AutoSelector(Calibration(alpha=50e-6, beta=1e-9), 4, widgets=5)
    records = timeline(ready=[2.0, 20.0])
    assert "widget_ring" in {row["value"] for row in advise(records)["what_if"] if row["knob"] == "algorithm"}
    profile = profile_run(records)
    setting = Setting(bucket_cap_mb=None, accumulate=1, algorithm="widget_ring", world_size=2,
                      algorithm_options=(("widgets", 3),))
    assert setting_options(profile, setting) == {"widgets": 3}


def test_the_dummy_is_gone_after_its_test():
    assert "widget_ring" not in algorithm_names() and "widgets" not in options_by_name()


#: Modules outside ``schedules/`` that may read one option by name, and why. The "nodes" drawing
#: is hierarchical's own layout (its record says ``layout="nodes"``), drawn from the node size
#: its schedule carries.
READS_AN_OPTION = {"viz/layout.py": {"local_size"}}


def test_no_module_outside_the_schedules_spells_an_option_name():
    """Names, defaults and help come from the records: an option's name as a string, a keyword,
    an attribute or a variable outside ``schedules/`` (docstrings aside) would be a consumer
    keeping its own list, which a new option would not reach."""
    names = set(options_by_name())
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where.startswith("schedules/"):
            continue
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and id(node) not in docstrings:
                word = node.value
            else:
                word = getattr(node, "id", None) or getattr(node, "attr", None) or (
                    node.arg if isinstance(node, (ast.arg, ast.keyword)) else None)
            if word in names and word not in READS_AN_OPTION.get(where, set()):
                found.append(f"{where}:{node.lineno}: {word}")
    assert not found, "read the option from the registry's records instead:\n" + "\n".join(found)
