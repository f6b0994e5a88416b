"""The files a -H job's other hosts write for the launcher: their ranks' status files and
flight-recorder dumps, carried back over the node's ssh output.

Each rank writes its status (torchring/trace/status.py) and, when it fails or is stopped, its
dump into TORCHRING_TRACE_DIR on its own host; the launcher reads them from its own host's
directory. A node on another host (torchring/launch/node.py, ``--relay``) therefore copies them
onto its standard output, which ssh brings to the launcher: each file as one line

    \\x1etorchring-file <name> <base64 of the content>\\n

- while the job runs, every status file that changed, once per TORCHRING_STATUS_S (one write
  of a line under the pipe's atomic size, so it never splits; a rank's unfinished line before it
  is kept, the launcher joins it with its end);
- once its ranks have exited, every status and dump written since the node started.

The launcher's output pump (ssh.py) passes each chunk through ``Receiver.take``: the lines are
cut out of the output and their files written, whole or not at all, into the launcher's trace
directory. Only names a rank writes are accepted (no path can be smuggled in).
"""

from __future__ import annotations

import base64
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import BinaryIO

from ..trace import dump as _dump, status as _status

__all__ = ["MARK", "line_of", "Receiver", "Sender"]

MARK = b"\x1etorchring-file "
_NAMES = re.compile(rf"^(?:{re.escape(_status.PREFIX)}\d+\.json|{re.escape(_dump.PREFIX)}\d+)$")
_ATOMIC = 4096  # a pipe writes this much in one piece (PIPE_BUF)


def line_of(name: str, content: bytes) -> bytes:
    """The relay line carrying file `name` with `content`."""
    return MARK + name.encode() + b" " + base64.b64encode(content) + b"\n"


class Receiver:
    """The launcher's side: takes relay lines out of a node's output and writes their files."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)
        self.received: list[str] = []

    def take(self, data: bytes) -> bytes:
        """`data` (whole lines) less its relay lines, whose files are written."""
        if MARK not in data:
            return data
        out = bytearray()
        while (at := data.find(MARK)) >= 0:
            end = data.find(b"\n", at)
            if end < 0:  # cannot happen for whole lines; keep it as output
                break
            out += data[:at]  # a rank's unfinished line: its end follows the relay line
            self._write(data[at + len(MARK):end])
            data = data[end + 1:]
        return bytes(out + data)

    def _write(self, body: bytes) -> None:
        name, _, encoded = body.partition(b" ")
        text = name.decode(errors="replace")
        if not _NAMES.match(text):
            return
        try:
            content = base64.b64decode(encoded, validate=True)
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.directory / f".{text}.relay"
            tmp.write_bytes(content)
            os.replace(tmp, self.directory / text)
            self.received.append(text)
        except (ValueError, OSError):
            pass


class Sender:
    """A node's side: sends its ranks' changed status files every `interval_s`, and at the end
    (``finish``) every status and dump written since it started."""

    def __init__(self, directory: str, interval_s: float, out: BinaryIO | None = None) -> None:
        self.directory, self.interval_s = Path(directory), interval_s
        self.out = out if out is not None else sys.stdout.buffer
        self.started = time.time()
        self.sent: dict[str, float] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="torchring-relay", daemon=True)

    def start(self) -> Sender:
        """Starts sending status files while the job runs."""
        if self.interval_s > 0:
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.send(f"{_status.PREFIX}*.json", whole_lines=True)

    def send(self, pattern: str, whole_lines: bool) -> None:
        """Sends the files matching `pattern` changed since they were last sent (`whole_lines`:
        only those whose line fits one atomic write)."""
        with self._lock:
            for path in sorted(self.directory.glob(pattern)):
                try:
                    mtime = path.stat().st_mtime
                    if mtime < self.started or self.sent.get(path.name) == mtime:
                        continue
                    line = line_of(path.name, path.read_bytes())
                except OSError:
                    continue
                if whole_lines and len(line) > _ATOMIC:
                    continue
                try:
                    os.write(self.out.fileno(), line) if whole_lines else self.out.write(line)
                    self.sent[path.name] = mtime
                except (OSError, ValueError):
                    return

    def finish(self) -> None:
        """Stops the periodic sending and sends every status and dump not yet sent."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        try:
            self.out.flush()
        except (OSError, ValueError):
            pass
        self.send(f"{_status.PREFIX}*.json", whole_lines=False)
        self.send(f"{_dump.PREFIX}*", whole_lines=False)
        try:
            self.out.flush()
        except (OSError, ValueError):
            pass
