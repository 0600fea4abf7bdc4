"""The suite's two workers (``-n 2``, ``tests/conftest.py``): which tests may run beside which.

Pure: the grouping rule, and the cores' lock between two holders in threads of this process
(``flock`` locks of two open files conflict as two processes' do).
"""

from __future__ import annotations

import threading

import pytest

from tests.conftest import CLOCK, _CoresLock, suite_group

pytestmark = pytest.mark.fast


def test_labs_and_clock_modules_share_one_group_and_the_rest_run_apart():
    assert suite_group("test_lab", {"lab_machine", "tmp_path"}) == CLOCK  # any module with a lab
    assert suite_group("test_stall_busy", {"tmp_path"}) == CLOCK  # a timeout read on the clock
    assert suite_group("test_sweep", {"main_job_run"}) == suite_group("test_tensorboard_browser", {"main_job_run"})
    assert suite_group("test_frameworks", {"tmp_path"}) == "test_frameworks"


def test_a_solo_test_holds_the_cores_alone_and_the_others_share_them(tmp_path):
    holder, other = _CoresLock(tmp_path), _CoresLock(tmp_path)

    def shares_while_held(solo: bool) -> tuple[bool, bool]:
        """Whether ``other`` gets a shared hold while ``holder`` holds (solo or not), and once it lets go."""
        shared_in = threading.Event()

        def share():
            with other.held(solo=False):
                shared_in.set()

        waiting = threading.Thread(target=share, daemon=True)
        with holder.held(solo=solo):
            waiting.start()
            during = shared_in.wait(0.5 if solo else 5)
        after = shared_in.wait(5)
        waiting.join(5)
        return during, after

    assert shares_while_held(solo=False) == (True, True)  # shared beside shared
    assert shares_while_held(solo=True) == (False, True)  # kept out while the solo test runs, then let in
