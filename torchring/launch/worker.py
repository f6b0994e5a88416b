"""One worker of torchring-run's elastic mode on another host, started over ssh by
torchring/launch/elastic.py:

    ssh HOST 'cd CWD && exec env PATH=... PYTHON -u -m torchring.launch.worker --env-stdin -- PYTHON -u train.py ...'

With --env-stdin it first reads the launcher's environment from its stdin (remote_env.py). With
--relay DIR it sends the status files and dumps its command writes in DIR (its
TORCHRING_TRACE_DIR on this host) to the launcher on its standard output (relay.py): the
changed status files once per TORCHRING_STATUS_S while the command runs, the rest once it ends.

It runs the command as its child and ends with the child's exit status (a signal N as 128 + N,
as a shell reports it). When its lifeline closes (torchring/launch/lifeline.py: the launcher
stopped this worker or is gone), it gives the child SIGTERM, and SIGKILL STOP_GRACE_S later."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Sequence

from .._core.settings import Settings
from . import failures as _failures, lifeline as _lifeline, relay as _relay, remote_env as _remote_env

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
    relay_dir = None
    while args[:1] and args[0] != "--" and args[0].startswith("--"):
        option = args.pop(0)
        if option == "--env-stdin":
            _remote_env.take()  # before the lifeline takes stdin over
        elif option.startswith("--relay="):
            relay_dir = option.split("=", 1)[1]
        else:
            args = []
    command = args[1:] if args[:1] == ["--"] else args
    if not command:
        print("usage: python -m torchring.launch.worker [--env-stdin] [--relay=DIR] -- COMMAND...", file=sys.stderr)
        return 2
    relay = _relay.Sender(relay_dir, Settings.from_env(os.environ).status_s).start() if relay_dir else None
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    _lifeline.watch(lambda: _stop(proc))
    try:
        return _failures.shell_code(proc.wait())
    finally:
        if relay is not None:  # the command is gone: its last status and any dump
            relay.finish()


if __name__ == "__main__":
    sys.exit(worker_main())
