"""Helpers shared by the test modules, and one enumeration of the algorithm registry for the grids.

Spawned ranks import what they run by module name, so everything here is module-level and
importable as ``tests.conftest``. Nothing here fakes the thing under test: the model is a
real ``nn.Module``, inputs are seeded random tensors, digests are SHA-256 of the bytes.

The ``fast`` marker (``python -m pytest -m fast``, the inner loop) is kept honest here: a test
marked ``fast`` that starts a process (ranks, torchrun, a subprocess, a lab, a browser) fails,
naming what it started (:func:`pytest_runtest_setup`, :func:`pytest_runtest_call`).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import hashlib
import json
import multiprocessing.process
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddp_ring_hooks import launch
from ddp_ring_hooks.schedules import algorithm_examples

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float64: 2.0**-53, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


# -- the ranks' fork server: what the suite's ranks import, imported once -------------------------

#: The suite's ranks build DistributedDataParallel models, whose constructor imports these on first
#: use (some 800 modules, torch._dynamo and sympy among them: about 2 s of CPU in every rank of every
#: launch). Added to this process's rank fork server (ddp_ring_hooks.launch, started with the first
#: rank, after this runs), they are imported once per session. The library's default list stays as it
#: is: a command that spawns ranks without DDP (``bench --nproc``) should not pay for them.
launch._FORK_SERVER_PRELOAD = (*launch._FORK_SERVER_PRELOAD, "ddp_ring_hooks.hooks",
                               "torch.distributed.tensor.parallel.ddp", "torch._dynamo")


# -- the fast marker: a fast test starts no process ---------------------------------------------

#: Every way a test starts a process: subprocess (and asyncio's subprocesses, Playwright's browser),
#: multiprocessing (spawned ranks), and the os calls underneath the rest.
_PROCESS_STARTS = (
    (subprocess.Popen, "_execute_child"), (multiprocessing.process.BaseProcess, "start"),
    (os, "fork"), (os, "posix_spawn"), (os, "posix_spawnp"), (os, "system"),
)


class StartedAProcess(AssertionError):
    """A test marked ``fast`` started a process."""


@contextlib.contextmanager
def _no_process_starts(nodeid: str):
    """While a fast test runs (its fixtures included), starting a process raises."""
    def refuse(name):
        def refused(*args, **kwargs):
            raise StartedAProcess(f"{nodeid} is marked fast but started a process ({name}); a fast test starts "
                                  "no process: drop its @pytest.mark.fast, or test the rule without ranks")
        return refused

    saved = [(owner, name, getattr(owner, name)) for owner, name in _PROCESS_STARTS if hasattr(owner, name)]
    for owner, name, _ in saved:
        setattr(owner, name, refuse(f"{getattr(owner, '__name__', owner)}.{name}"))
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _guarded(item):
    return _no_process_starts(item.nodeid) if item.get_closest_marker("fast") else contextlib.nullcontext()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with _guarded(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _guarded(item):
        yield
# Not at teardown: the last test of a module or session also finalizes the fixtures it shared
# with others (a lab removed with `ip`), whatever its own mark.


# -- two workers (``-n 2``): what may run beside what ---------------------------------------------
#
# Much of the suite waits: on shaped links, on a stall's timeout, on a rank that is late on
# purpose. With pytest-xdist (``python -m pytest -q -n 2``, the README's command) a second worker
# runs the rest beside those waits. Every test gets an ``xdist_group`` (``--dist loadgroup``, in
# pyproject.toml): a group runs whole on one worker, in order.
#
# - CLOCK: the modules whose checks read a clock or a shaped link (a rate, a detection's delay, a
#   fail-fast bound; every lab). One worker runs them one after another, first, so two of them
#   never share the cores or two labs the machine; the other worker runs everything else.
# - A module that uses a costly session fixture (SHARED_SESSION_FIXTURES) joins that fixture's
#   group: a session fixture is made once per worker.
# - Every other module is a group of its own (its module fixtures made once).

CLOCK = "clock"
#: The modules that read a clock without a lab (those with a lab are found by their fixture).
CLOCK_MODULES = frozenset({"test_faults", "test_group_context", "test_stall", "test_stall_busy", "test_stall_frozen",
                           "test_stragglers"})
#: Session fixtures made by starting ranks: the modules that use one run on one worker.
SHARED_SESSION_FIXTURES = ("main_job_run",)


def suite_group(module: str, fixtures: set[str]) -> str:
    """The xdist group of a module whose tests use ``fixtures`` (their union)."""
    if module in CLOCK_MODULES or "lab_machine" in fixtures:
        return CLOCK
    return next((name for name in SHARED_SESSION_FIXTURES if name in fixtures), module)


@pytest.hookimpl(wrapper=True)  # before every plain hook, xdist's among them, which reads the groups into the ids
def pytest_collection_modifyitems(config, items):
    """Mark every test with its module's :func:`suite_group`, and put the CLOCK group first (the
    worker that takes it is busy longest; ``--no-loadscope-reorder`` keeps this order). A wrapper:
    the groups must be on the tests before xdist's hook reads them into the test ids; if that
    does not take, the run stops and says so (:func:`pytest_xdist_node_collection_finished`)."""
    fixtures_of: dict[str, set[str]] = {}
    for item in items:
        fixtures_of.setdefault(item.module.__name__, set()).update(item.fixturenames)
    groups = {module: suite_group(module.rsplit(".", 1)[-1], fixtures) for module, fixtures in fixtures_of.items()}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[item.module.__name__]))
    items.sort(key=lambda item: groups[item.module.__name__] != CLOCK)  # stable: each module's order kept
    return (yield)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """Stop a run whose groups did not take: pytest-xdist 3.8 groups a test by renaming it
    ``nodeid@group``, and pytest 9.2 derives the nodeid, so the rename is lost and every test is
    scheduled alone, labs beside labs (a fresh machine's run: 756 s and two timing failures)."""
    if node.config.getoption("dist") == "loadgroup" and ids and not any("@" in nodeid for nodeid in ids):
        pytest.exit(f"pytest-xdist's --dist loadgroup did not group the tests under pytest {pytest.__version__}: "
                    "install the [test] extra's pytest (pip install -e '.[test]': pytest<9.2), or run without -n",
                    returncode=pytest.ExitCode.USAGE_ERROR)


class _CoresLock:
    """The machine's cores between the workers: a test marked ``solo`` (a rate read against the
    cores' speed, e.g. the advisor's probe on the lab, whose 16 KiB blocks slowed 10x beside a
    Lightning launch) holds them alone; any other test shares them. A readers-writer lock on
    two files of the run (``flock``): a turnstile that a solo test holds while it waits, so the
    other worker's next test waits behind it instead of starving it."""

    def __init__(self, directory: Path) -> None:
        self.turnstile = open(directory / "ddp_ring_hooks-cores.turnstile", "a")  # noqa: SIM115 (held all session)
        self.cores = open(directory / "ddp_ring_hooks-cores.lock", "a")  # noqa: SIM115

    @contextlib.contextmanager
    def held(self, solo: bool):
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self.cores, fcntl.LOCK_EX if solo else fcntl.LOCK_SH)
        finally:
            fcntl.flock(self.turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self.cores, fcntl.LOCK_UN)


@functools.cache
def _cores_lock(directory: Path) -> _CoresLock:
    return _CoresLock(directory)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outermost: the wait is not in the test's timeout
def pytest_runtest_protocol(item, nextitem):
    """Under xdist, every test holds the cores' lock (``solo``: alone) from its setup (a module's
    shared fixtures are made there) to its teardown; alone in a session, nothing to share."""
    if not hasattr(item.config, "workerinput"):
        yield
        return
    # The workers' temporary directories (.../pytest-N/popen-gwK) share their parent: this run's.
    run = item.config._tmp_path_factory.getbasetemp().parent
    with _cores_lock(run).held(solo=item.get_closest_marker("solo") is not None):
        yield


@pytest.fixture(scope="session")
def lab_machine():
    """Skip unless this machine can make emulated labs (root and iproute2, ``ddp_ring_hooks.lab``);
    first remove the labs that killed runs left behind, and at the end of the session any lab
    this session still owns (a test killed half-way, e.g. by its timeout)."""
    from ddp_ring_hooks.lab import remove_labs_of, remove_stale_labs, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    remove_stale_labs()
    yield
    remove_labs_of(os.getpid())


def algorithm_cases(world_size: int, *, flat_hierarchies: bool = False) -> list[tuple[str, dict]]:
    """Every ``(algorithm, options)`` pair the registry gives as an example for ``world_size``
    ranks (the tree pipelined or not, hierarchical in every shape of several nodes of several
    ranks); with ``flat_hierarchies``, hierarchical also as one node and as nodes of one rank."""
    cases = list(algorithm_examples(world_size, scheduled_only=True))
    if flat_hierarchies:
        cases += [("hierarchical", {"local_size": g}) for g in sorted({1, world_size})]
    return cases


class Net(torch.nn.Module):
    """A few layers of different sizes, plus one that forward skips when asked to."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(32, 96), torch.nn.Tanh(), torch.nn.Linear(96, 96), torch.nn.Tanh(), torch.nn.Linear(96, 7)
        )
        self.unused = torch.nn.Linear(7, 7)

    def forward(self, x, use_all=True):
        out = self.body(x)
        return self.unused(out) if use_all else out


def sgd_steps(model: torch.nn.Module, rank: int, steps: int = 3) -> list[torch.Tensor]:
    """Train ``model`` (a DDP-wrapped :class:`Net`) for ``steps`` SGD steps on this rank's
    seeded inputs; the parameters after them."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(8, 32, generator=generator)).square().mean().backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def rank_input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The seeded input of ``rank``: the same on every run, different per rank and size."""
    generator = torch.Generator().manual_seed(1000 * rank + numel)
    return torch.randn(numel, generator=generator, dtype=torch.float64).to(dtype)


def digest(tensor: torch.Tensor) -> str:
    """SHA-256 of the tensor's bytes: equal digests mean bit-identical values."""
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def within_summation_bound(result, inputs, dtype, world_size) -> float:
    """How far ``result`` is from the exact sum, as a fraction of the allowed bound (<= 1 passes).

    The bound is the textbook one for recursive summation, ``p · u · Σ|x_i|`` (``u`` = unit
    roundoff of the dtype): one rounding per addition plus the final conversion.
    """
    exact = torch.stack([x.double() for x in inputs]).sum(0)
    bound = world_size * UNIT_ROUNDOFF[dtype] * torch.stack([x.double().abs() for x in inputs]).sum(0)
    excess = (result.double() - exact).abs() / bound.clamp_min(torch.finfo(torch.float64).tiny)
    return float(excess.max()) if excess.numel() else 0.0


def imports_torch(module: str) -> bool:
    """Whether importing ``module`` (``ddp_ring_hooks`` or a part of it) loads torch, checked in a
    fresh interpreter (the package's own ``__init__`` imports its public names on first use)."""
    code = f"import importlib, sys; importlib.import_module({module!r}); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
                         env=checkout_environment())
    return out.stdout.strip() == "True"


def native_and_ring_in_one_backward(rank: int, device: torch.device) -> dict:
    """Train a DDP model whose buckets ``auto`` splits between ``native`` and the ring: the last
    layer's 1 MiB closes DDP's 1 MiB first bucket and goes to ``native``, the other 8 MiB to the
    ring (a calibration that makes native cheaper below ~2 MB at 2 ranks). Returns the algorithms
    chosen and the parameters after 6 steps."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddp_ring_hooks
    from ddp_ring_hooks.cost_model import Calibration

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 256))
    model = DDP(net.to(device), device_ids=[device.index] if device.type == "cuda" else None)
    # At p=2: native costs n * 1 ns/B, the ring 2 ms + n * 1 ps/B.
    calibration = {"native": Calibration(alpha=0.0, beta=1e-9), "ring": Calibration(alpha=1e-3, beta=1e-12)}
    state = ddp_ring_hooks.register(model, algorithm="auto", candidates=("ring", "native"), calibration=calibration)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(6):
        optimizer.zero_grad()
        model(torch.randn(16, 1024, generator=generator).to(device)).square().mean().backward()
        optimizer.step()
    chosen = sorted(set(state.plan.selector._choices.values()))
    state.close()
    return {"chosen": chosen, "params": [p.detach().cpu() for p in model.parameters()]}



# -- the main job, once per session --------------------------------------------------------------

#: A short run of the main job: tiny model, k = 1 and 2, STEPS measured steps (and at least
#: MIN_MICRO_BATCHES micro-batches) after WARMUP_STEPS per fit, MICRO_BATCH sequences per rank.
MAIN_JOB_ACCUMULATE, MAIN_JOB_STEPS, MAIN_JOB_WARMUP_STEPS, MAIN_JOB_MIN_MICRO_BATCHES = (1, 2), 3, 1, 6
MAIN_JOB_MICRO_BATCH = 2


def main_job_command(output, *extra: str) -> list[str]:
    """``torchrun ... accumulation_sweep.py`` with the short run's flags (``extra`` wins)."""
    sweep = Path(__file__).resolve().parents[1] / "train_examples" / "accumulation_sweep.py"
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(sweep),
        "--accumulate", ",".join(map(str, MAIN_JOB_ACCUMULATE)), "--steps", str(MAIN_JOB_STEPS),
        "--warmup-steps", str(MAIN_JOB_WARMUP_STEPS), "--min-micro-batches", str(MAIN_JOB_MIN_MICRO_BATCHES),
        "--warmup-fit-steps", "1", "--micro-batch", str(MAIN_JOB_MICRO_BATCH), "--seq-len", "16", "--width", "32", "--layers", "2",
        "--heads", "2", "--bucket-cap-mb", "0.02", "--accelerator", "cpu", "--output-dir", str(output), *extra,
    ]


def checkout_environment() -> dict[str, str]:
    """The checkout need not be installed: the package is found from the repository root."""
    root = str(Path(__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}


def run_main_job(output, *extra: str) -> subprocess.CompletedProcess:
    """Run it to the end (every rank killed after a timeout); fail with its output if it fails."""
    launched = subprocess.Popen(main_job_command(output, *extra), env=checkout_environment(), start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = launched.communicate(timeout=300)
    finally:
        if launched.poll() is None:
            os.killpg(launched.pid, signal.SIGKILL)
            launched.wait()
    assert launched.returncode == 0, out[-3000:] + err[-3000:]
    return subprocess.CompletedProcess(launched.args, launched.returncode, out, err)


@pytest.fixture(scope="session")
def main_job_run(tmp_path_factory) -> dict:
    """One two-round run of the short main job, shared by the sweep and the TensorBoard tests:
    ``output/version_0`` holds one TensorBoard run per k and round."""
    output = tmp_path_factory.mktemp("main_job")
    finished = run_main_job(output, "--rounds", "2")
    return {"output": output, "run": output / "version_0", "stdout": finished.stdout}


@functools.cache
def help_text(program: tuple[str, ...]) -> str:
    """What ``program --help`` prints (once per program per session: the scripts' check and the
    docs' check share it), asked of one help process (``tests/scripts/help_server.py``: torch is
    imported once, not once per program) or, for a program it cannot run, of the program itself."""
    root = Path(__file__).resolve().parents[1]
    answer = _help_server().ask(program)
    if answer.get("returncode") is None:
        done = subprocess.run([*program, "--help"], cwd=root, env=checkout_environment(), capture_output=True,
                              text=True, timeout=180)
        answer = {"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
    assert answer["returncode"] == 0, f"{' '.join(program)} --help failed: {answer['stderr'][-2000:]}"
    return answer["stdout"]


HELP_TIMEOUT_S = 180


class _HelpServer:
    """The help process, started on the first question, killed at the session's end."""

    def __init__(self) -> None:
        root = Path(__file__).resolve().parents[1]
        self.process = subprocess.Popen(
            [sys.executable, str(root / "tests" / "scripts" / "help_server.py")], cwd=root, env=checkout_environment(),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )

    def ask(self, program: tuple[str, ...]) -> dict:
        self.process.stdin.write(json.dumps(list(program)) + "\n")
        self.process.stdin.flush()
        readable, _, _ = select.select([self.process.stdout], [], [], HELP_TIMEOUT_S)
        if not readable:  # a --help that hangs fails its test, not the session
            self.close()
            _help_server.cache_clear()
            raise AssertionError(f"{' '.join(program)} --help did not answer within {HELP_TIMEOUT_S} s")
        line = self.process.stdout.readline()
        assert line, f"the help process died answering {' '.join(program)} --help"
        return json.loads(line)

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


@functools.cache
def _help_server() -> _HelpServer:
    server = _HelpServer()
    atexit.register(server.close)
    return server
