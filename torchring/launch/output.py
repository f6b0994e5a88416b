"""What torchring-run shows of its ranks' output: each line, and each carriage-return
redraw (a tqdm bar), starts with the rank's prefix, so a progress bar stays one updating line
on a terminal and a log file has no blank prefixed lines.

torch's own tee (torchrun --tee) reads the ranks' log files in text mode, where a lone
carriage return ends a line, so every redraw of a bar became a new "[default0]:" line. Here
torch's agent still redirects each rank, but into a named pipe that torchring-run reads as
bytes and prefixes with `prefix_chunk`, a pure function. A rank's stdout and stderr share
one pipe when the launcher's stdout and stderr are the same file (a terminal), so a rank's
log lines and its bar (tqdm writes to stderr) arrive in the order the rank wrote them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable
from typing import BinaryIO

import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, LogsDest, Std
from torch.distributed.launcher.api import elastic_launch

__all__ = ["whole_lines", "prefix_chunk", "rank_label", "Console", "RankOutput", "rank_output", "launch"]

_POLL_S = 0.05


def whole_lines(pending: bytes) -> tuple[bytes, bytes]:
    """(the whole lines of `pending`, ended by b"\\n" or b"\\r"; the unfinished rest)."""
    cut = max(pending.rfind(b"\n"), pending.rfind(b"\r")) + 1
    return pending[:cut], pending[cut:]


def prefix_chunk(data: bytes, prefix: bytes, at_start: bool) -> tuple[bytes, bool]:
    """`data` with `prefix` before the first byte after each line start (b"\\n" or b"\\r");
    `at_start` says whether the stream is at a line start before `data`, and is returned
    for after it. A prefix goes only before text, so no prefixed blank line is ever made."""
    out = bytearray()
    for piece in _pieces(data):
        if piece in (b"\n", b"\r"):
            out += piece
            at_start = True
        else:
            if at_start:
                out += prefix
            out += piece
            at_start = False
    return bytes(out), at_start


def _pieces(data: bytes) -> list[bytes]:
    """`data` cut into runs of text and single b"\\n" / b"\\r" bytes, in order."""
    out, start = [], 0
    for i, byte in enumerate(data):
        if byte in (10, 13):
            if i > start:
                out.append(data[start:i])
            out.append(data[i:i + 1])
            start = i + 1
    if start < len(data):
        out.append(data[start:])
    return out


def rank_label(env: dict[str, str]) -> str:
    """The default prefix of a rank's lines: its global rank, e.g. "[3]: "."""
    return f"[{env.get('RANK', '?')}]: "


class Console:
    """One destination (the launcher's stdout or stderr, or both when they are the same
    file) that drops what it is given once its reader is gone (`| head` quit), so no rank
    blocks on a full pipe. Its `owner` is the rank stream that left the current line
    unfinished: another stream starts a new line first, so two ranks' text never share a line."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.owner: _Stream | None = None  # the stream whose text ends the current line
        self.broken = False  # the reader went away (e.g. `| head`): output is dropped

    def write(self, data: bytes) -> None:
        """Writes `data`, or drops it once the destination is gone (the ranks must not block)."""
        if not self.broken:
            try:
                self.out.write(data)
            except (OSError, ValueError):
                self.broken = True

    def flush(self) -> None:
        """Flushes, as write() does, without raising."""
        if not self.broken:
            try:
                self.out.flush()
            except (OSError, ValueError):
                self.broken = True


class _Stream:
    """One rank's output pipe (stdout, stderr, or both), and where it goes."""

    def __init__(self, path: str, prefix: bytes, console: Console) -> None:
        os.mkfifo(path)
        # opened before torch's agent opens it to write, so that open does not block
        self.fd: int | None = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        self.prefix, self.console = prefix, console
        self.at_start = True
        self.cut = False  # another stream ended this one's unfinished line for it

    def pump(self) -> bool:
        """Copies what the rank wrote since the last call, prefixed; True if there was any."""
        if self.fd is None:
            return False
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return False  # nothing new
        if not data:
            return False  # no writer now (not started yet, or done)
        if self.cut and data.startswith(b"\n"):
            data = data[1:]  # the newline written for it when another stream cut in
        self.cut = False
        console = self.console
        if data and console.owner is not None and console.owner is not self:
            console.write(b"\n")  # another stream left a line unfinished: keep it
            console.owner.at_start = console.owner.cut = True
        text, self.at_start = prefix_chunk(data, self.prefix, self.at_start)
        console.write(text)
        if data:
            console.owner = None if data.endswith((b"\n", b"\r")) else self
        return True

    def close(self) -> None:
        """Closes the pipe (the launcher removes it afterwards)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class RankOutput(DefaultLogsSpecs):
    """torch's agent sends each rank's stdout and stderr into pipes; this reads them and
    copies them to the launcher's stdout and stderr with `label(rank env)` before each
    line and redraw. With `only_rank0`, global rank 0 writes straight to the launcher's
    terminal (a real tty: its bar looks as without a launcher) and the others to /dev/null."""

    def __init__(self, label: Callable[[dict[str, str]], str] = rank_label, only_rank0: bool = False) -> None:
        self._dir = tempfile.mkdtemp(prefix="torchring-run-")
        super().__init__(log_dir=self._dir, redirects=Std.ALL, tee=Std.NONE)
        self._label, self._only_rank0 = label, only_rank0
        self._streams: list[_Stream] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._consoles = _consoles()
        self._thread = threading.Thread(target=self._follow, name="torchring-run-output", daemon=True)
        self._thread.start()

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """Where each rank writes (a pipe per rank, or per stream), read from now on."""
        dest = super().reify(envs)
        for local_rank, env in envs.items():
            if self._only_rank0:
                shown = env.get("RANK") == "0"
                dest.stdouts[local_rank] = "" if shown else os.devnull  # "": the launcher's own
                dest.stderrs[local_rank] = "" if shown else os.devnull
                continue
            prefix = self._label(env).encode()
            out, err = self._consoles
            streams = [_Stream(dest.stdouts[local_rank], prefix, out)]
            if err is out:
                dest.stderrs[local_rank] = dest.stdouts[local_rank]  # one pipe: the rank's order
            else:
                streams.append(_Stream(dest.stderrs[local_rank], prefix, err))
            with self._lock:
                self._streams += streams
        return dest

    def _follow(self) -> None:
        """The reader thread: copies new output every 50 ms; after close(), what is left."""
        while True:
            last = self._stop.is_set()
            with self._lock:
                streams = list(self._streams)
            moved = False
            for stream in streams:
                while stream.pump():
                    moved = True
            if last:
                for console in self._consoles:
                    if console.owner is not None:
                        console.write(b"\n")  # end the last unfinished line before the shell's prompt
                        console.owner = None
            if moved or last:
                for console in self._consoles:
                    console.flush()
            if last:
                return
            self._stop.wait(_POLL_S)

    def close(self) -> None:
        """Copies the rest of every rank's output, then removes the pipes."""
        self._stop.set()
        self._thread.join()
        for stream in self._streams:
            stream.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def rank_output(args: argparse.Namespace,
                label: Callable[[dict[str, str]], str] = rank_label) -> RankOutput | None:
    """Who shows the ranks' output for `args` (--no-prefix, --rank0-only): None (the ranks write
    to this terminal directly), rank 0 alone unprefixed, or every rank prefixed with `label`."""
    if args.no_prefix and not args.rank0_only:
        return None
    return RankOutput(label=label, only_rank0=args.rank0_only)


def _consoles() -> tuple[Console, Console]:
    """The launcher's stdout and stderr as consoles; one shared console if they are the
    same file (a terminal, or 2>&1 into a log)."""
    sys.stdout.flush()
    sys.stderr.flush()
    out = Console(sys.stdout.buffer)
    try:
        same = os.path.samestat(os.fstat(sys.stdout.fileno()), os.fstat(sys.stderr.fileno()))
    except (OSError, ValueError, AttributeError):
        same = False
    return out, (out if same else Console(sys.stderr.buffer))


def launch(args: argparse.Namespace, output: RankOutput | None) -> None:
    """torch.distributed.run.run(args), with the ranks' output handled by `output` (None:
    the ranks write straight to the launcher's stdout and stderr)."""
    if args.standalone:  # what torchrun.run does for --standalone, before config_from_args
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, cmd, cmd_args = torchrun.config_from_args(args)
    if output is not None:
        config.logs_specs = output
    try:
        elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
    finally:
        if output is not None:
            output.close()
