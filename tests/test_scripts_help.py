"""Every script a user runs answers ``--help``: its imports still resolve after the package moves.

(A benchmark once imported a helper that a refactor had moved, and nothing ran it.) Libraries
that the scripts import but do not run (``mlp_steps.py``, ``char_lm.py``) are covered by the
scripts that import them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from .conftest import help_text

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(
    path for folder in ("benchmarks", "train_examples") for path in (ROOT / folder).glob("*.py")
    if "__main__" in path.read_text()
)


@pytest.mark.fast
def test_the_scripts_are_found():
    assert {"advisor_accuracy.py", "gpu_check.py", "accumulation_sweep.py", "train_char_lm.py"} <= {p.name for p in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_script_answers_help(script):
    assert "usage:" in help_text((sys.executable, str(script)))  # fails with the script's stderr
