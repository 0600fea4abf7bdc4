"""A rank frozen for good cannot keep a torchrun job alive: the job ends, and no process is left.

A stopped process ignores SIGTERM until it is continued, so when the survivors fail at
``stall_timeout`` and exit, torchrun's agent (torch 2.13) sends the worker group SIGTERM,
waits 30 s for the stopped one, then SIGKILLs it: the job outlives the failure by half a
minute, and a launcher killed meanwhile leaves the stopped worker behind as an orphan. The
survivors' watchdog sees, through ``/proc``, that the rank it names is stopped on this host
and sends it SIGCONT after aborting the group: it runs into the aborted group, fails and
exits with the others.

Here: ``torchrun`` with 2 ranks and no restarts, rank 1 SIGSTOPs itself at step 2. The job
must exit (non-zero) within ``stall_timeout`` + 15 s of the freeze (the issue asks + 30 s; the
agent's own SIGKILL would come at about ``stall_timeout`` + 31 s), and none of its workers may be left.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

#: Short: the job's end is measured from the freeze, and nothing here waits for a slow step.
STALL_AFTER, STALL_TIMEOUT = 1.0, 3.0
ENDS_WITHIN = STALL_TIMEOUT + 15.0  # after the freeze (the agent's own SIGKILL: about + 31 s)


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            state = file.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.timeout(200)
def test_a_job_with_a_rank_frozen_for_good_ends_soon_after_the_stall_timeout_and_leaves_no_process(tmp_path):
    from tests.scripts.train_with_hook import free_port, loopback_environment, torchrun_command

    frozen_rank = 1
    command = torchrun_command(
        out=tmp_path, port=free_port(), max_restarts=0,
        extra=("--steps=6", f"--stall-rank={frozen_rank}", "--stall-step=2", f"--stall-after={STALL_AFTER:g}",
               f"--stall-timeout={STALL_TIMEOUT:g}"),
    )
    job = subprocess.Popen(command, env=loopback_environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    try:
        _, stderr = job.communicate(timeout=150)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
            job.wait()
    ended = time.time()
    pids = {rank: int((tmp_path / f"pid_rank{rank}_attempt0").read_text()) for rank in range(2)}
    try:
        frozen_pid, frozen_at = (tmp_path / "frozen").read_text().split()
        assert int(frozen_pid) == pids[frozen_rank]
        assert job.returncode != 0, stderr[-4000:]  # the job failed, as it should: a rank froze
        assert f"rank {frozen_rank} is stalled" in stderr and "RankStalledError" in stderr, stderr[-4000:]
        took = ended - float(frozen_at)
        print(f"frozen for good under torchrun: the job ended {took:.1f} s after the freeze "
              f"(stall_timeout={STALL_TIMEOUT:g} s)")  # docs/reliability.md
        assert took < ENDS_WITHIN, (took, stderr[-4000:])
        assert [pid for pid in pids.values() if _alive(pid)] == [], "a worker outlived its job"
        assert f"sent SIGCONT to rank {frozen_rank} (pid {pids[frozen_rank]})" in stderr, stderr[-4000:]
    finally:
        for pid in pids.values():  # whatever the verdict, leave nothing stopped behind
            if _alive(pid):
                os.kill(pid, 9)
