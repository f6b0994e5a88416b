"""Asking a running job how it is doing: torchring-run --status, the live view, the end-of-job report.

Every rank of a torchring-run job writes its status file about once a second to the run's trace
directory (TORCHRING_STATUS_S=1, set here; torchring/trace/status.py). The launcher registers the
run in a per-user directory (``jobs_dir()``: ``<pid>.json`` naming the trace directory and the
world size) for as long as it runs, so that

- ``torchring-run --status`` (another shell, same host and user) finds the running jobs and
  prints each one's table at once: per rank its step, samples/s, share of time in communication,
  operation count, the operation in flight (and for how long, and from which line) or the last
  one, and which ranks are dead (their process is gone) or unresponsive (no status for 3
  intervals);
- ``kill -USR1 <torchring-run's pid>`` prints the same table in the job's own output;
- ``--live S`` prints it every S seconds while the job runs, plain lines that stay clean in a
  log, with a progress bar for the epoch when torchring.data's loader is in use; when the
  launcher's standard input is a terminal, pressing Enter prints it at once (only with --live:
  without it the launcher leaves the terminal's input to the ranks, for pdb and the like);
- at the end of a job that succeeded, when one rank made the others wait a noticeable share of
  the run, the straggler report (torchring/trace/stragglers.py) is printed, with
  the phase it was late in.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any, TextIO

from ..trace import status as _status, stragglers as _stragglers

__all__ = ["jobs_dir", "register", "running_jobs", "query", "LiveView", "answer_sigusr1", "end_report"]

VARIABLE = "TORCHRING_STATUS_S"


def enable(env: MutableMapping[str, str], users: Mapping[str, str]) -> None:
    """Has the ranks write their status every second (in `env`), unless `users` chose an interval."""
    if VARIABLE not in users:
        env[VARIABLE] = "1"


def jobs_dir() -> Path:
    """Where this user's running torchring-run jobs are registered on this host."""
    return Path(tempfile.gettempdir()) / f"torchring-run-{os.getuid()}"


def register(trace_dir: str, world: int, command: list[str]) -> Path:
    """Registers this launcher's job until it exits; the registration's path."""
    path = jobs_dir() / f"{os.getpid()}.json"
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.write_text(json.dumps({"pid": os.getpid(), "trace_dir": trace_dir, "world": world,
                                "command": command, "started": time.time()}))
    atexit.register(lambda: path.unlink(missing_ok=True))
    return path


def running_jobs() -> list[dict[str, Any]]:
    """The registered jobs whose launcher still runs (a stale registration is removed)."""
    jobs = []
    for path in sorted(jobs_dir().glob("*.json")):
        try:
            job = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if _status.alive(int(job.get("pid", 0))):
            jobs.append(job)
        else:
            path.unlink(missing_ok=True)
    return jobs


def table(job: dict[str, Any]) -> list[str]:
    """One job's status table."""
    head = f"torchring-run {job['pid']}: {' '.join(job.get('command', []))}"
    return [head, *_status.lines(job["trace_dir"], job.get("world"))]


def query(pid: int | None = None, out: TextIO = sys.stdout) -> int:
    """torchring-run --status [PID]: prints the table of each running job (or job PID); 1 when none."""
    jobs = [j for j in running_jobs() if pid is None or j["pid"] == pid]
    if not jobs:
        which = f"with launcher pid {pid} " if pid is not None else ""
        print(f"torchring-run --status: no torchring-run job {which}is running on this host as this user "
              f"(registrations: {jobs_dir()})", file=out)
        return 1
    for job in jobs:
        print("\n".join(table(job)), file=out)
    return 0


class LiveView:
    """--live S: the job's table every S seconds, as plain lines, until stop(); with `keys`
    (a file, the launcher's terminal), at once on each line read from it (Enter)."""

    def __init__(self, job: dict[str, Any], interval_s: float, out: TextIO = sys.stderr,
                 keys: TextIO | None = None) -> None:
        self._job, self._interval, self._out, self._keys = job, interval_s, out, keys
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="torchring-run-live", daemon=True)

    def start(self) -> LiveView:
        """Starts printing."""
        self._thread.start()
        if self._keys is not None:
            threading.Thread(target=self._read_keys, name="torchring-run-keys", daemon=True).start()
        return self

    def stop(self) -> None:
        """Stops printing."""
        self._stop.set()

    def _print(self) -> None:
        with self._lock:
            try:
                print("\n".join(_status.lines(self._job["trace_dir"], self._job.get("world"))),
                      file=self._out, flush=True)
            except Exception as e:  # the view must not end the launcher
                print(f"torchring-run: live view: {e}", file=self._out)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._print()

    def _read_keys(self) -> None:
        for _ in iter(self._keys.readline, ""):  # type: ignore[union-attr]
            if self._stop.is_set():
                return
            self._print()


def answer_sigusr1(job: dict[str, Any], out: TextIO = sys.stderr) -> None:
    """kill -USR1 <launcher>: the launcher prints the job's table (where SIGUSR1 is still the default)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None):
        return

    def handler(signum: int, frame: Any) -> None:
        print("\n".join(_status.lines(job["trace_dir"], job.get("world"))), file=out, flush=True)

    signal.signal(signal.SIGUSR1, handler)


def end_report(trace_dir: str, force: bool = False) -> str:
    """The straggler report of a finished job from its ranks' last statuses: "" unless a rank
    made the others wait at least 1 s and 5% of the run in all (or `force`)."""
    statuses = _status.read(trace_dir) if os.path.isdir(trace_dir) else {}
    if not statuses:
        return ""
    records = _status.records(statuses)
    blamed = _stragglers.blame(records)
    worst = max((sum(by.values()) for by in blamed.values()), default=0.0)
    wall = max((s.get("wall_s", 0.0) for s in statuses.values()), default=0.0)
    if not force and worst < max(1.0, 0.05 * wall):
        return ""
    lines = _stragglers.report(records, top=3, at_least_s=0.1 * worst, blamed=blamed)  # the ranks that matter
    return "\n".join(f"torchring-run: {line}" for line in lines)
