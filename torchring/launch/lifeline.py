"""The lifeline of a process torchring-run starts on another host: its stdin, the launcher's pipe
(through ssh). When it closes (the launcher stopped the job, exited or was killed, or the ssh
connection dropped), the process stops what it runs. A remote command has no other tie to the
launcher: without a terminal, ending the ssh client does not signal the remote side."""

from __future__ import annotations

import os
import threading
from typing import Callable

__all__ = ["watch"]


def watch(on_close: Callable[[], None]) -> None:
    """Moves stdin aside (children get /dev/null) and calls `on_close` on a daemon thread once it closes."""
    lifeline = os.dup(0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)

    def wait() -> None:
        while True:
            try:
                if not os.read(lifeline, 4096):
                    break
            except OSError:
                break
        on_close()

    threading.Thread(target=wait, daemon=True, name="torchring-lifeline").start()
