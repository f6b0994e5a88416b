"""One worker of torchring-run's elastic mode on another host, started over ssh by
torchring/launch/elastic.py:

    ssh HOST 'cd CWD && exec env PATH=... PYTHON -u -m torchring.launch.worker --env-stdin -- PYTHON -u train.py ...'

With --env-stdin it first reads the launcher's environment from its stdin (remote_env.py).

It runs the command as its child and ends with the child's exit status (a signal N as 128 + N,
as a shell reports it). When its lifeline closes (torchring/launch/lifeline.py: the launcher
stopped this worker or is gone), it gives the child SIGTERM, and SIGKILL STOP_GRACE_S later."""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import Sequence

from . import failures as _failures, lifeline as _lifeline, remote_env as _remote_env

__all__ = ["worker_main", "STOP_GRACE_S"]

STOP_GRACE_S = 10.0


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to `proc`, SIGKILL if it still runs STOP_GRACE_S later."""
    proc.terminate()
    timer = threading.Timer(STOP_GRACE_S, lambda: proc.poll() is None and proc.kill())
    timer.daemon = True
    timer.start()


def worker_main(argv: Sequence[str] | None = None) -> int:
    """Runs the command after `--`; its exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--env-stdin"]:
        _remote_env.take()
        args = args[1:]
    command = args[1:] if args[:1] == ["--"] else args
    if not command:
        print("usage: python -m torchring.launch.worker [--env-stdin] -- COMMAND...", file=sys.stderr)
        return 2
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    _lifeline.watch(lambda: _stop(proc))
    return _failures.shell_code(proc.wait())


if __name__ == "__main__":
    sys.exit(worker_main())
