"""A rendezvous store in a process of its own, as torchrun's agent or a job's store server runs
it: the tests that lose the store kill that process."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from typing import Iterator

_SERVE = ("import datetime, sys, time, torch.distributed as d\n"
          "s = d.TCPStore('127.0.0.1', 0, None, True, timeout=datetime.timedelta(seconds=600), "
          "wait_for_workers=False)\n"
          "print(s.port, flush=True)\n"
          "time.sleep(600)\n")


@contextlib.contextmanager
def store_server() -> Iterator[tuple[int, int]]:
    """(pid, port) of a TCPStore server on 127.0.0.1, stopped when the block ends."""
    proc = subprocess.Popen([sys.executable, "-c", _SERVE], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.strip():
            raise RuntimeError(f"the store server ended before it listened (exit code {proc.wait()})")
        yield proc.pid, int(line)
    finally:
        proc.kill()
        proc.wait()
