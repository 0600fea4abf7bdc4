"""Ctrl-C that ends a rank waiting in C++ (ddp_ring_hooks/interrupts.py), on real processes, real
signals and a real TCPStore: a main thread stuck in a store ``get`` (as a rank is in a
rendezvous its peer left) is ended 130 after the grace; one that takes the signal in Python
cleans up for as long as it needs; under torchrun, Ctrl-C with one rank in C++ ends the job in
seconds, not torchrun's 30; a rank whose peer took Ctrl-C and left before this rank's own
signal came takes that signal, late, without a traceback; bad calls are refused with the reason."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from ddp_ring_hooks.interrupts import PEER_GONE_MESSAGES

from .conftest import checkout_environment

JOB = Path(__file__).resolve().parent / "scripts" / "ctrl_c_job.py"

#: A process that installs the guard, starts a real TCPStore and sends itself SIGINT after
#: 1 s, while its main thread waits: in C++ ("store", a key nobody sets, 60 s timeout) or in
#: Python ("python", short sleeps); after taking KeyboardInterrupt it cleans up for as many
#: seconds as its third argument says.
WAITER = textwrap.dedent("""
    import datetime, os, signal, sys, threading, time
    import torch.distributed as dist
    from ddp_ring_hooks.interrupts import exit_promptly_on_ctrl_c

    grace_s, waits_in = float(sys.argv[1]), sys.argv[2]
    # Ctrl-C raising KeyboardInterrupt, as in a rank started from a terminal: a shell's background
    # job (fresh-ci's pytest was one) starts with SIGINT ignored, and then the guard has nothing to do.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    assert exit_promptly_on_ctrl_c(grace_s) and exit_promptly_on_ctrl_c(grace_s)  # a second call keeps the first
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    print("waiting", flush=True)
    try:
        if waits_in == "store":
            store.get("a key nobody sets")
        else:
            while True:
                time.sleep(0.05)
    except KeyboardInterrupt:
        print("took Ctrl-C; cleaning up", flush=True)
        time.sleep(float(sys.argv[3]))
        print("cleaned up", flush=True)
""")


def _run_waiter(grace_s: float, waits_in: str, cleanup_s: float = 0.0) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", WAITER, str(grace_s), waits_in, str(cleanup_s)],
                          capture_output=True, text=True, timeout=90)
    return done, time.monotonic() - started


def test_a_main_thread_waiting_in_a_store_is_ended_130_after_the_grace():
    done, took_s = _run_waiter(2.0, "store")
    assert done.returncode == 130, (done.stdout, done.stderr)
    assert "waiting" in done.stdout and "took Ctrl-C" not in done.stdout  # it never took it: the store held it
    assert "Ctrl-C, but its main thread is waiting in C++" in done.stderr and "did not take it in 2 s" in done.stderr
    # 1 s to the signal, 2 s of grace, the start (torch's import): far from the store's 60 s
    assert took_s < 30, took_s


def test_a_main_thread_that_takes_ctrl_c_cleans_up_past_the_grace():
    done, _ = _run_waiter(1.0, "python", cleanup_s=3.0)
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert done.stdout.split() == ["waiting", "took", "Ctrl-C;", "cleaning", "up", "cleaned", "up"]
    assert "main thread is waiting in C++" not in done.stderr


def test_under_torchrun_ctrl_c_with_a_rank_in_cxx_ends_the_job_in_seconds(tmp_path):
    """Ctrl-C as a terminal sends it, to torchrun's process group, once each rank waits; torchrun
    forwards it to each rank (each in a session of its own): rank 0 takes it in Python, rank 1
    is ended by the guard 3 s later, and torchrun, whose grace for its ranks is 30 s, ends with
    them."""
    output = tmp_path / "out.txt"
    with output.open("w") as sink:
        job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                str(JOB), "3"], env=checkout_environment(), start_new_session=True, stdout=sink,
                               stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while output.read_text().count("waiting") < 2 and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert output.read_text().count("waiting") == 2, output.read_text()
        time.sleep(0.5)  # rank 1 inside the store's get
        interrupted = time.monotonic()
        os.killpg(job.pid, signal.SIGINT)
        job.wait(timeout=60)
        took_s = time.monotonic() - interrupted
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    out = output.read_text()
    assert "rank 0 took Ctrl-C" in out and "rank 1 took Ctrl-C" not in out, out
    assert "rank 1: Ctrl-C, but its main thread is waiting in C++" in out, out
    assert took_s < 20, (took_s, out)  # 3 s of grace and torchrun's shutdown; without the guard, 30 s


REFUSALS = textwrap.dedent("""
    import signal, socket, threading
    from ddp_ring_hooks.interrupts import exit_promptly_on_ctrl_c

    def refused(*args):
        try:
            exit_promptly_on_ctrl_c(*args)
        except (ValueError, RuntimeError) as error:
            return f"{type(error).__name__}: {error}"
        return "accepted"

    print(refused(0))
    print(refused("10"))
    print(refused(float("inf")))
    caught = []
    thread = threading.Thread(target=lambda: caught.append(refused()))
    thread.start(); thread.join()
    print(caught[0])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print(exit_promptly_on_ctrl_c(), signal.getsignal(signal.SIGINT) is signal.SIG_IGN)  # nothing to do
    signal.signal(signal.SIGINT, signal.default_int_handler)
    mine, _ = socket.socketpair()
    mine.setblocking(False)
    signal.set_wakeup_fd(mine.fileno())
    print(refused())
    print(signal.set_wakeup_fd(-1) == mine.fileno())  # left as it was
""")


def test_bad_calls_are_refused_with_the_reason_and_change_nothing():
    done = subprocess.run([sys.executable, "-c", REFUSALS], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    zero, text, endless, thread, ignored, owned, kept = done.stdout.splitlines()
    assert zero.startswith("ValueError: grace_s=0:") and text.startswith("ValueError: grace_s='10':")
    assert endless == "ValueError: grace_s=inf: give the seconds the main thread has to take Ctrl-C (a number > 0)"
    assert thread == "RuntimeError: exit_promptly_on_ctrl_c must be called from the main thread (Python's signal handlers live there)"
    assert ignored == "False True"
    assert owned.startswith("RuntimeError: the signal wakeup fd is already in use") and "asyncio" in owned
    assert kept == "True"



#: Two ranks of a gloo group, plain processes with the ``env://`` variables (torchrun's agent
#: would end rank 1 itself once rank 0 has gone). Once rank 1 waits in a barrier, rank 0
#: leaves, as a rank that took Ctrl-C does; rank 1's barrier fails, and rank 1 waits (``wait_s``,
#: the first argument) for its own Ctrl-C, which the test may send as torchrun would: late.
PEER_LEAVES = textwrap.dedent("""
    import signal, sys, time
    import torch.distributed as dist
    from ddp_ring_hooks.interrupts import wait_for_forwarded_ctrl_c

    signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal (see WAITER)
    dist.init_process_group("gloo")
    store = dist.distributed_c10d._get_default_store()  # rank 0's: it must outlive rank 1's start
    if dist.get_rank() == 0:
        store.wait(["rank 1 waits"])
        time.sleep(0.2)  # rank 1 is inside the barrier
        sys.exit(130)
    try:
        try:
            store.set("rank 1 waits", "1")
            dist.barrier()
        except Exception as error:
            print("the barrier failed", flush=True)
            began = time.monotonic()
            try:
                wait_for_forwarded_ctrl_c(error, float(sys.argv[1]))
            finally:
                print(f"waited {time.monotonic() - began:.1f} s", flush=True)
            raise
    except KeyboardInterrupt as interrupt:
        print(f"took Ctrl-C, raised during {type(interrupt.__context__).__name__}", flush=True)
        sys.exit(130)
""")


def _peer_leaves(wait_s: float, ctrl_c_after_s: float | None) -> subprocess.CompletedProcess:
    """Run PEER_LEAVES; SIGINT rank 1 ``ctrl_c_after_s`` after rank 0 has exited (None: never).
    Returns rank 1's result."""
    from tests.scripts.train_with_hook import env_rank_variables, free_port, loopback_environment

    port = free_port()
    ranks = [subprocess.Popen([sys.executable, "-c", PEER_LEAVES, str(wait_s)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**loopback_environment(), **checkout_environment(), **env_rank_variables(rank, port)})
             for rank in range(2)]
    try:
        assert ranks[0].wait(timeout=60) == 130, ranks[0].communicate()
        if ctrl_c_after_s is not None:
            time.sleep(ctrl_c_after_s)
            ranks[1].send_signal(signal.SIGINT)
        out, err = ranks[1].communicate(timeout=60)
        return subprocess.CompletedProcess(ranks[1].args, ranks[1].returncode, out, err)
    finally:
        for rank in ranks:
            rank.kill()


def test_a_rank_whose_peer_left_first_takes_its_own_late_ctrl_c_without_a_traceback():
    """torchrun forwards Ctrl-C rank by rank: rank 1's arrives after rank 0 has gone (1 s here)."""
    done = _peer_leaves(wait_s=20, ctrl_c_after_s=1.0)
    assert done.returncode == 130, (done.stdout, done.stderr)
    said = done.stdout.splitlines()
    assert said[0] == "the barrier failed" and said[-1] == "took Ctrl-C, raised during RuntimeError", said
    assert float(said[1].split()[1]) < 10, said  # the signal ended the wait, far before its 20 s
    assert "Traceback" not in done.stderr, done.stderr


def test_a_peer_that_left_without_ctrl_c_is_still_a_failure_after_the_wait():
    done = _peer_leaves(wait_s=1.5, ctrl_c_after_s=None)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stdout.splitlines()[0] == "the barrier failed"
    assert float(done.stdout.splitlines()[1].split()[1]) >= 1.5, done.stdout
    assert any(gone in done.stderr.splitlines()[-1] for gone in PEER_GONE_MESSAGES), done.stderr[-2000:]  # the error itself


WAIT_REFUSALS = textwrap.dedent("""
    import signal, threading, time
    from ddp_ring_hooks.interrupts import peer_left, wait_for_forwarded_ctrl_c

    signal.signal(signal.SIGINT, signal.default_int_handler)
    gone = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1")
    try:
        raise ValueError("a bug of the script's")
    except ValueError as error:
        wrapped = error
    print(peer_left(gone), peer_left(wrapped), peer_left(RuntimeError("outer")), end=" ")
    try:
        try:
            raise gone
        except RuntimeError as inner:
            raise RuntimeError("the bucket's exchange failed") from inner
    except RuntimeError as outer:
        print(peer_left(outer))  # through the chain
    began = time.monotonic()
    wait_for_forwarded_ctrl_c(wrapped, 30)  # another error: no wait
    caught = []
    thread = threading.Thread(target=lambda: caught.append(wait_for_forwarded_ctrl_c(gone, 30)))
    thread.start(); thread.join()  # off the main thread: no wait (no signal could end it)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    wait_for_forwarded_ctrl_c(gone, 30)  # Ctrl-C ignored: nothing would come
    print(f"{time.monotonic() - began:.1f}")
    for bad in (-1, float("nan"), "5"):
        try:
            wait_for_forwarded_ctrl_c(gone, bad)
        except ValueError as error:
            print(error)
""")


def test_the_wait_is_only_for_a_peer_that_left_on_the_main_thread_and_bad_waits_are_refused():
    done = subprocess.run([sys.executable, "-c", WAIT_REFUSALS], capture_output=True, text=True, timeout=60,
                          env=checkout_environment())
    assert done.returncode == 0, done.stderr
    verdicts, waited, *refused = done.stdout.splitlines()
    assert verdicts == "True False False True"
    assert float(waited) < 5  # none of the three waited its 30 s
    assert refused == [f"wait_s={bad}: give the seconds to wait for a forwarded Ctrl-C (a number >= 0)"
                       for bad in ("-1", "nan", "'5'")]
