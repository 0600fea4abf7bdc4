"""One job across the lab: a process per host, their output, and an end that never hangs.

The processes start in sessions of their own, so a host's process and everything it started
(torchrun's workers) can be killed together by process group. When one host fails, the others
are usually waiting for it inside a collective and would wait for gloo's timeout (30 minutes by
default): they get a few seconds to fail on their own, then are killed, and the error names
the host that failed first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from .iproute import LabError

#: Seconds the other hosts get to finish after one host failed, before they are killed.
GRACE_AFTER_FAILURE_S = 10.0
_TAIL_CHARACTERS = 3000


@dataclass(frozen=True, slots=True)
class HostResult:
    """How one host's process ended, and what it printed."""

    host: int
    returncode: int  # negative: killed by that signal (-9 when the job killed it)
    stdout: str
    stderr: str


class HostFailed(LabError):
    """A host's process exited with an error (the others were stopped); ``results`` has them all."""

    def __init__(self, message: str, results: list[HostResult]) -> None:
        super().__init__(message)
        self.results = results


class LabTimeout(LabError, TimeoutError):
    """A job ran past its time limit; every host's process was killed."""


class Job:
    """Processes started on some hosts of a lab (``host -> Popen`` with text pipes), drained
    from the start; :meth:`wait` for their results.

    ``echo``: print each line as it comes, host 0's as they are and the others' after
    ``[host i]``. ``what`` names the job in errors.
    """

    def __init__(
        self, processes: Mapping[int, subprocess.Popen], *, echo: bool, what: str,
        helpers: Mapping[str, subprocess.Popen] | None = None,
    ) -> None:
        self.processes = dict(processes)
        self._what = what
        self._readers = {host: _Reader(host, process, echo) for host, process in self.processes.items()}
        # Processes that serve the job (the rendezvous store) until its hosts are done: they
        # must not end before, and are stopped after.
        self._helpers = {name: (process, _Reader(name, process, echo=False)) for name, process in (helpers or {}).items()}

    def wait(self, *, timeout: float | None = 600.0, check: bool = True) -> list[HostResult]:
        """Wait for every host's process; one result per host, by host.

        ``check``: raise :class:`HostFailed` when a host exited with an error. Once one host has
        failed, the others get :data:`GRACE_AFTER_FAILURE_S` seconds, then are killed. Past
        ``timeout`` seconds every process is killed and :class:`LabTimeout` raised.
        """
        try:
            return self._wait(timeout, check)
        finally:  # the helpers; and on Ctrl-C everything (each process has a session of its own)
            self.kill()

    def _wait(self, timeout: float | None, check: bool) -> list[HostResult]:
        deadline = None if timeout is None else time.monotonic() + timeout
        first_failure, failure_deadline = None, float("inf")
        while self.running():
            now = time.monotonic()
            if deadline is not None and now > deadline:
                running = self.running()
                self.kill()
                raise LabTimeout(f"{self._what}: host(s) {running} still running after {timeout:g} s; "
                                 "killed every host's process" + self._tails(running))
            for name, (helper, reader) in self._helpers.items():
                if helper.poll() is not None:
                    self.kill()
                    output = reader.result()
                    raise LabError(f"{self._what}: the {name} ended (exit code {helper.returncode}) before the job: "
                                   f"{(output.stdout + output.stderr).strip()[-_TAIL_CHARACTERS:]}")
            if first_failure is None:
                failed = [host for host, process in self.processes.items() if process.poll() not in (None, 0)]
                if failed:
                    first_failure, failure_deadline = failed[0], now + GRACE_AFTER_FAILURE_S
            elif now > failure_deadline:
                break
            time.sleep(0.05)
        self.kill()  # after a failure: whoever still waits for the failed host; the helpers
        results = [self._readers[host].result() for host in sorted(self.processes)]
        failed = [r.host for r in results if r.returncode != 0]
        if check and failed:
            first = first_failure if first_failure is not None else failed[0]
            raise HostFailed(f"{self._what}: host {first} failed (exit code {self.processes[first].returncode}); "
                             f"hosts with errors: {failed}" + self._tails(failed), results)
        return results

    def running(self) -> list[int]:
        """The hosts whose process has not ended yet."""
        return sorted(host for host, process in self.processes.items() if process.poll() is None)

    def kill(self) -> None:
        """SIGKILL every process of the job that still runs, with everything it started."""
        _kill([*self.processes.values(), *(process for process, _ in self._helpers.values())])

    def _tails(self, hosts: list[int]) -> str:
        parts = []
        for host in hosts:
            result = self._readers[host].result()
            text = (result.stdout + result.stderr).strip()[-_TAIL_CHARACTERS:]
            parts.append(f"\n--- host {host} (last lines) ---\n{text or '(printed nothing)'}")
        return "".join(parts)


def _kill(processes) -> None:
    """SIGKILL each process that still runs, with what it started (each has a session of its own)."""
    for process in processes:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for process in processes:
        process.wait()


class _Reader:
    """Drains one process's stdout and stderr on two threads, keeping and echoing the lines."""

    def __init__(self, host: int | str, process: subprocess.Popen, echo: bool) -> None:
        self._host, self._process = host, process
        self._lines: dict[str, list[str]] = {"stdout": [], "stderr": []}
        prefix = "" if host == 0 else f"[host {host}] "
        self._threads = [
            threading.Thread(target=self._drain, args=(stream, lines, target if echo else None, prefix), daemon=True)
            for stream, lines, target in (
                (process.stdout, self._lines["stdout"], sys.stdout), (process.stderr, self._lines["stderr"], sys.stderr)
            )
        ]
        for thread in self._threads:
            thread.start()

    @staticmethod
    def _drain(stream, lines: list[str], echo_to, prefix: str) -> None:
        for line in stream:
            lines.append(line)
            if echo_to is not None:
                echo_to.write(prefix + line)
                echo_to.flush()

    def result(self) -> HostResult:
        """The result of the process, which has ended (its output is drained first)."""
        returncode = self._process.wait()
        for thread in self._threads:
            thread.join(timeout=5)  # a leftover grandchild may hold the pipe open: do not wait for it
        return HostResult(self._host, returncode, "".join(self._lines["stdout"]), "".join(self._lines["stderr"]))
