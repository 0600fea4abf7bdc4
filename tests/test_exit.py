"""A training script that ends by an exception exits with its own error, not an abort.

A script that fails (a peer's abort, a ``RankStalledError``, a bug) never calls
``HookState.close``, so the package's daemon threads are still running when the interpreter
exits; one that comes back from a C++ call (a gloo wait, a store request) while the
interpreter finalizes aborts the whole process, "terminate called without an active
exception" (SIGABRT) in place of the script's error, now and then (seen once in a fresh-clone
CI run, on the rank a stall's survivor had continued). ``runtime/daemons.py`` stops them all
at exit; this checks that none is alive when the interpreter begins to finalize: a
deterministic check of what makes the abort possible. And gloo's own thread, which runs a
failed collective's chain of Future callbacks after DDP has woken the main thread, is given
the time to finish it.

The two ranks are plain processes with the ``env://`` variables a launcher sets (as under
Slurm's ``srun``), not torchrun's: its agent ends the other ranks with SIGTERM as soon as one
has failed, and a process ended by a signal runs no ``atexit`` at all.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts.train_with_hook import env_rank_variables, free_port, loopback_environment

SCRIPT = Path(__file__).resolve().parent / "scripts" / "exit_without_close.py"


def _run_two_ranks(script: Path, *args: str) -> tuple[list[subprocess.Popen], list[str]]:
    """``script`` as ranks 0 and 1 of a gloo group (plain processes, ``env://``), to the end;
    the processes (every one ended) and their stderr."""
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, str(script), *args], stderr=subprocess.PIPE, text=True,
                              env={**loopback_environment(), **env_rank_variables(rank, port)})
             for rank in range(2)]
    try:
        return ranks, [rank.communicate(timeout=100)[1] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()


@pytest.mark.timeout(120)
def test_a_script_that_fails_without_closing_leaves_no_thread_of_ours_at_exit(tmp_path):
    ranks, errors = _run_two_ranks(SCRIPT, f"--out={tmp_path}")
    for rank, (process, stderr) in enumerate(zip(ranks, errors)):
        assert process.returncode == 1, (rank, process.returncode, stderr[-3000:])  # its error, not SIGABRT (-6)
        assert "the script fails after 3 steps" in stderr, stderr[-3000:]
        alive = json.loads((tmp_path / f"threads_rank{rank}.json").read_text())
        assert alive == [], f"rank {rank}: the package's threads still running at exit: {alive}"
    assert any((tmp_path / "runs").rglob("events.out.tfevents.*"))  # the telemetry was written at exit


AFTER_A_FAILED_BUCKET = Path(__file__).resolve().parent / "scripts" / "exit_after_a_failed_bucket.py"


@pytest.mark.timeout(120)
def test_a_script_that_ends_on_a_failed_bucket_exits_with_its_error_while_gloos_thread_finishes_the_chain():
    """Rank 0 leaves; rank 1's bucket fails on gloo's thread, whose chain of callbacks goes on
    0.25 s after DDP woke the main thread with the error (the user's hook's own work, standing
    for the package's microseconds); the main thread ends at once. Its exit gives gloo's thread
    the time (``daemons.CALLBACK_TAIL_S``, 0.5 s after the last failed callback of ours); without
    it, the process aborted in every run ("terminate called without an active exception")."""
    ranks, errors = _run_two_ranks(AFTER_A_FAILED_BUCKET, "--tail=0.25")
    assert ranks[0].returncode == 0, errors[0][-3000:]  # it left, on purpose
    assert ranks[1].returncode == 1, (ranks[1].returncode, errors[1][-3000:])  # its error, not SIGABRT (-6)
    assert "Connection closed by peer" in errors[1] and "terminate called" not in errors[1], errors[1][-3000:]
