"""When a rank writes its flight-recorder dump: on a failure, on SIGUSR1 or SIGTERM, on request.

``arm()`` (torchring.init calls it) starts one daemon thread, ``torchring-trace``, blocked on a
pipe. Three things write to that pipe:

- the engine, one byte "F" whenever a communicator fails or an operation mismatches
  (engine/flight_recorder.h notifyFailure, from whichever thread saw it);
- Python's own C signal handler for SIGUSR1 and SIGTERM, through ``signal.set_wakeup_fd``: it
  writes the signal's number at once, even while the main thread is blocked in a lock, a sleep
  or a collective, which is what lets a hung rank still answer. SIGTERM is how a launcher
  (torch's agent, so torchring-run) stops the ranks left when one failed: the rank dumps, then
  dies of SIGTERM as it would have, so the launcher finds every rank's record;
- ``dump_trace()``, which then also waits for the file.

The thread takes the engine's snapshot and the Python stacks of every thread, and writes the
dump (dump.py) to ``TORCHRING_TRACE_DIR`` (default: one directory per job under the temporary
directory). A failure is dumped at most once per second (the file of the latest one stays); at
exit, a failure whose dump is still being written is waited for. A signal is taken only when
the process has no handler of its own for it, and the wakeup fd only when nobody else set one
(then a signal is seen once the main thread runs Python again).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import dump as _dump

_log = logging.getLogger("torchring")
_FAILURE, _REQUEST, _QUIT = b"F", b"R", b"Q"


@dataclass
class _Armed:
    engine: Any
    directory: Path
    rank: int
    world: int
    host: str
    timeout_s: float
    read_fd: int
    write_fd: int
    thread: threading.Thread | None = None
    old_wakeup_fd: int | None = None      # set when this module took the wakeup fd
    old_handlers: dict[int, Any] = field(default_factory=dict)  # the signals this module took
    lock: threading.Lock = field(default_factory=threading.Lock)
    written: threading.Condition = field(default_factory=threading.Condition)
    dumps: int = 0                        # dumps written so far
    pending_failure: bool = False         # a failure was announced and its dump not yet written
    last_failure_dump: float = 0.0
    last_path: Path | None = None


_armed: _Armed | None = None


def arm(engine: Any, rank: int, world: int, host: str, directory: str | os.PathLike[str],
        timeout_s: float, frames: bool = True) -> None:
    """Starts dumping this rank's flight records to `directory` on failures and signals
    (idempotent); `frames`: operations also record the Python line that issued them."""
    global _armed
    if _armed is not None:
        _armed.rank, _armed.world, _armed.host = rank, world, host
        _armed.directory, _armed.timeout_s = Path(directory), timeout_s
        return
    package = str(Path(__file__).resolve().parents[1]) + os.sep
    torch_dir = str(Path(sys.modules["torch"].__file__).resolve().parent) + os.sep if "torch" in sys.modules else None
    if frames:
        engine.set_trace_skip_prefixes([p for p in (package, torch_dir) if p])
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    state = _Armed(engine, Path(directory), rank, world, host, timeout_s, read_fd, write_fd)
    engine.set_trace_notify_fd(write_fd)
    _take_signal(state)
    state.thread = threading.Thread(target=_serve, args=(state,), name="torchring-trace", daemon=True)
    state.thread.start()
    _armed = state
    atexit.register(_at_exit)


_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


def _take_signal(state: _Armed) -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread
    for signum in _SIGNALS:
        if signal.getsignal(signum) not in (signal.SIG_DFL, None):
            _log.info("torchring: %s has a handler of this program's; the flight recorder does not "
                      "dump on it (torchring.dump_trace() still writes a dump)", signal.Signals(signum).name)
            continue
        state.old_handlers[signum] = signal.signal(signum, _on_signal)
    if not state.old_handlers:
        return
    try:
        old = signal.set_wakeup_fd(state.write_fd, warn_on_full_buffer=False)
    except ValueError:
        return
    if old != -1:  # someone else's (asyncio): give it back; SIGUSR1 then waits for the main thread
        signal.set_wakeup_fd(old)
    else:
        state.old_wakeup_fd = old


def _on_signal(signum: int, frame: Any) -> None:
    state = _armed
    if state is not None and state.old_wakeup_fd is None:  # no wakeup fd of ours: tell the thread here
        _poke(state, bytes([signum]))


def _poke(state: _Armed, byte: bytes) -> None:
    try:
        os.write(state.write_fd, byte)
    except (BlockingIOError, OSError):
        pass  # a full pipe already has a dump coming


def _serve(state: _Armed) -> None:
    while True:
        try:
            data = os.read(state.read_fd, 64)
        except OSError:
            return
        if not data or _QUIT in data:
            return
        failure = _FAILURE in data
        request = _REQUEST in data or bytes([signal.SIGUSR1]) in data
        if bytes([signal.SIGTERM]) in data:  # dump, then end as SIGTERM would have
            _write(state, "SIGTERM")
            _die_of_sigterm()
        if failure:
            state.pending_failure = True
            if time.monotonic() - state.last_failure_dump < 1.0 and not request:
                time.sleep(1.0)  # a burst of failures (every group at once): dump once after it
        if failure or request:
            reason = "failure" if failure else "request"
            _write(state, reason)
            if failure:
                state.last_failure_dump = time.monotonic()


def _die_of_sigterm() -> None:
    """Ends the process as SIGTERM's default action does (this thread may not be the main one,
    where Python sets handlers: libc's signal() is called directly)."""
    try:
        ctypes.CDLL(None).signal(signal.SIGTERM, ctypes.c_void_p(0))  # SIG_DFL
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the signal is delivered to some thread; none of ours handles it now
    finally:
        os._exit(128 + signal.SIGTERM)


def _write(state: _Armed, reason: str) -> Path | None:
    with state.lock:
        failed = state.pending_failure
        state.pending_failure = False
        try:
            built = _dump.build(state.engine.trace_snapshot(), rank=state.rank, world=state.world,
                                host=state.host, reason=reason if not failed else "failure",
                                timeout_s=state.timeout_s)
            path = _dump.write(built, state.directory, state.rank)
        except Exception as e:  # a dump must never take the job down
            _log.warning("torchring: rank %d could not write its flight-recorder dump to %s: %s",
                         state.rank, state.directory, e)
            path = None
    with state.written:
        state.dumps += 1
        state.last_path = path
        state.written.notify_all()
    return path


def dump_now(reason: str = "request") -> Path | None:
    """Writes this rank's dump now, on the calling thread; its path (None when not armed or it failed)."""
    state = _armed
    return _write(state, reason) if state is not None else None


def directory() -> Path | None:
    """Where this rank's dumps go (None before torchring.init)."""
    return _armed.directory if _armed is not None else None


def _at_exit() -> None:
    state = _armed
    if state is not None and state.pending_failure:
        _write(state, "failure")


def disarm() -> None:
    """Stops dumping: the thread ends, SIGUSR1 and the wakeup fd go back to what they were."""
    global _armed
    state, _armed = _armed, None
    if state is None:
        return
    state.engine.set_trace_notify_fd(-1)
    if threading.current_thread() is threading.main_thread():
        if state.old_wakeup_fd is not None:
            signal.set_wakeup_fd(state.old_wakeup_fd)
        for signum, old in state.old_handlers.items():
            if signal.getsignal(signum) is _on_signal:
                signal.signal(signum, old if old is not None else signal.SIG_DFL)
    _poke(state, _QUIT)
    if state.thread is not None:
        state.thread.join(timeout=5)
    for fd in (state.read_fd, state.write_fd):
        try:
            os.close(fd)
        except OSError:
            pass
    atexit.unregister(_at_exit)
