"""What a user sees in TensorBoard, checked in a real browser.

The main job's runs (a short run of it, shared with tests/test_sweep.py), a real `tensorboard`
process on a free port, and Debian's Chromium, headless, driven by Playwright (never a browser
Playwright downloads): the Scalars tab must show the ``comm/`` charts, the HParams tab list k
(``accumulate_grad_batches``) as a column with one row per run. Skipped, with the reason, where
Chromium or Playwright is missing (`.ci/run` installs both).

The screenshots go to the test's own directory; the docs' pictures come from a full run of the
main job, the same checks on it::

    DOCS_SCREENSHOTS_FROM=runs/accumulation_sweep/version_0 python -m pytest tests/test_tensorboard_browser.py
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from .conftest import checkout_environment

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# As this machine's notes say: no sandbox as root, and no background connections (the network is closed).
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]
DOCS_RUN = os.environ.get("DOCS_SCREENSHOTS_FROM")

if not os.path.exists(CHROMIUM):
    pytest.skip("no Chromium at /usr/bin/chromium (Debian: apt-get install -y chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="needs the playwright package (the [test] extra)")


def trial_ids(run: Path) -> set[str]:
    """The runs of a main-job run that carry hparams (one per k and round): ``accumulate_1/round_0``, ..."""
    return {path.parent.relative_to(run).as_posix() for path in run.rglob("hparams.yaml")}


@pytest.fixture(scope="module")
def main_job(request) -> Path:
    if DOCS_RUN:
        return (ROOT / DOCS_RUN).resolve()
    return request.getfixturevalue("main_job_run")["run"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _get(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


@pytest.fixture(scope="module")
def tensorboard(main_job, tmp_path_factory):
    """``tensorboard --logdir <the run>``, serving, with every run loaded; killed at the end."""
    port = _free_port()
    log = (tmp_path_factory.mktemp("tensorboard") / "tensorboard.log").open("w")
    # From the checkout, with a relative --logdir where it is one: the page shows the path as given.
    logdir = os.path.relpath(main_job, ROOT) if main_job.is_relative_to(ROOT) else str(main_job)
    server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", logdir, "--host", "127.0.0.1",
                               "--port", str(port), "--load_fast=false"], cwd=ROOT, env=checkout_environment(),
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, f"tensorboard exited: {Path(log.name).read_text()[-2000:]}"
            try:
                if set(_get(f"{url}/data/runs")) >= trial_ids(main_job):
                    break
            except OSError:
                pass  # not listening yet
            assert time.monotonic() < deadline, "tensorboard did not load the runs in 120 s"
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        log.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """A fresh headless Chromium profile, one page."""
    with sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM, headless=True,
            args=CHROMIUM_FLAGS, viewport={"width": 1400, "height": 900})
        try:
            yield context.new_page()
        finally:
            context.close()


def _screenshot(page, tmp_path: Path, name: str) -> None:
    page.screenshot(path=str(tmp_path / name))
    if DOCS_RUN:
        shutil.copy(tmp_path / name, ROOT / "docs" / name)


def test_the_scalars_tab_shows_the_comm_charts(tensorboard, browser, tmp_path):
    browser.goto(f"{tensorboard}/#scalars", timeout=120_000)
    browser.get_by_text("tag: comm/bucket_0/time_ms").wait_for(timeout=120_000)  # the comm/ category, open
    browser.locator("tf-tag-filterer paper-input input").fill("comm/step/")  # as a user narrows it down
    for tag in ("comm/step/total_ms", "comm/step/exposed_ms"):
        browser.get_by_text(tag, exact=True).wait_for(timeout=60_000)
    browser.wait_for_timeout(1500)  # the charts draw their lines after the cards appear
    _screenshot(browser, tmp_path, "tensorboard_browser_scalars.png")


def test_the_hparams_tab_lists_k_as_a_column_with_one_row_per_run(tensorboard, browser, main_job, tmp_path):
    runs = trial_ids(main_job)
    browser.goto(f"{tensorboard}/#hparams", timeout=120_000)
    browser.get_by_text("Trial ID").first.wait_for(timeout=120_000)
    cells = browser.locator("vaadin-grid-cell-content")
    deadline = time.monotonic() + 60
    while True:  # the rows arrive after the header
        texts = [text.strip() for text in cells.all_inner_texts()]
        rows = [text for text in texts if re.fullmatch(r"accumulate_\d+/round_\d+|accumulate_\d+", text)]
        if len(rows) >= len(runs) or time.monotonic() > deadline:
            break
        browser.wait_for_timeout(500)
    header = texts[: texts.index(rows[0])] if rows else texts
    assert "accumulate_grad_batches" in header and "round" in header, header
    assert "micro_batch" not in header  # the same in every run: TensorBoard hides it, the experiment says so
    assert sorted(rows) == sorted(runs)
    _screenshot(browser, tmp_path, "tensorboard_browser_hparams.png")
