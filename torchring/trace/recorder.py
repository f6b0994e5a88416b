"""When a rank writes its flight-recorder dump: on a failure, on SIGUSR1 or SIGTERM, on request.

``arm()`` (torchring.init calls it) starts one daemon thread, ``torchring-trace``, blocked on a
pipe. Two things write to that pipe:

- the engine, one byte "F" whenever a communicator fails or an operation mismatches
  (engine/flight_recorder.h notifyFailure, from whichever thread saw it);
- the engine's C handler for SIGUSR1 and SIGTERM (engine/flight_recorder.h takeSignals): it
  writes the signal's number at once, even while the main thread is blocked in a lock, a sleep
  or a collective, which is what lets a hung rank still answer. SIGTERM is how a launcher
  (torch's agent, so torchring-run) stops the ranks left when one failed: the rank dumps, then
  the engine's watchdog ends it as SIGTERM would have (after 3 s at most, dump or not), so the
  launcher finds every rank's record and no rank outlives its SIGTERM by more than that;
- ``dump_trace()`` writes on the calling thread instead.

Every TORCHRING_STATUS_S seconds (when above 0; torchring-run sets 1) the same thread writes the
rank's status file next to the dumps (status.py), which ``torchring-run --status`` and its live
view read; shutdown and exit write it a last time, marked exited.

The thread takes the engine's snapshot and the Python stacks of every thread, and writes the
dump (dump.py) to ``TORCHRING_TRACE_DIR`` (default: one directory per job under the temporary
directory). A failure is dumped at most once per second (the file of the latest one stays); at
exit, a failure whose dump is still being written is waited for. A signal is taken only while
its action is still the default (a program's own handler stays); a forked child (a DataLoader
worker), which shares the pipe, takes the default action at once.
"""

from __future__ import annotations

import atexit
import logging
import os
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import data_wait as _data_wait, dump as _dump, status as _status

_log = logging.getLogger("torchring")
_FAILURE = b"F"
_WAKE = b"W"  # re-armed: take up the status interval again
_SIGTERM_GRACE_S = 3.0  # how long a SIGTERM'd rank may take to dump before it ends anyway


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
    lock: threading.Lock = field(default_factory=threading.Lock)
    pending_failure: bool = False         # a failure was announced and its dump not yet written
    failures_dumped: int = 0              # engine.trace_failures() when the last dump began
    last_failure_dump: float = 0.0
    pid: int = field(default_factory=os.getpid)  # the armed process (a fork's copy does nothing)
    status_s: float = 0.0                 # seconds between status files (0: none)
    rates: _status.Rates = field(default_factory=_status.Rates)
    last_status: dict[str, Any] | None = None
    stopped: bool = False                 # shutdown() wrote the last status; none until armed again


_armed: _Armed | None = None


def arm(engine: Any, rank: int, world: int, host: str, directory: str | os.PathLike[str],
        timeout_s: float, frames: bool = True, status_s: float = 0.0, data_wait: bool = True) -> None:
    """Starts dumping this rank's flight records to `directory` on failures and signals
    (idempotent); `frames`: operations also record the Python line that issued them;
    `status_s` > 0: the rank's status file is written there that often; `data_wait`: torch
    DataLoader batches are timed (data_wait.py)."""
    global _armed
    if data_wait:
        _data_wait.install()
    # Registered again on every call: at exit this runs before whatever registered since
    # (torchring.shutdown), while the communicators still live.
    atexit.unregister(_at_exit)
    atexit.register(_at_exit)
    if _armed is not None:
        _armed.rank, _armed.world, _armed.host = rank, world, host
        _armed.directory, _armed.timeout_s = Path(directory), timeout_s
        _armed.status_s, _armed.stopped = status_s, False
        try:
            os.write(_armed.write_fd, _WAKE)  # the thread may wait without a timeout since shutdown
        except OSError:
            pass
        return
    package = str(Path(__file__).resolve().parents[1]) + os.sep
    torch_dir = str(Path(sys.modules["torch"].__file__).resolve().parent) + os.sep if "torch" in sys.modules else None
    if frames:
        engine.set_trace_skip_prefixes([p for p in (package, torch_dir) if p])
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    state = _Armed(engine, Path(directory), rank, world, host, timeout_s, read_fd, write_fd, status_s=status_s)
    engine.set_trace_notify_fd(write_fd)
    _take_signals(state)
    state.thread = threading.Thread(target=_serve, args=(state,), name="torchring-trace", daemon=True)
    state.thread.start()
    _armed = state


def _take_signals(state: _Armed) -> None:
    taken = state.engine.take_trace_signals(_SIGTERM_GRACE_S)
    for signum in (signal.SIGUSR1, signal.SIGTERM):
        if signum not in taken:
            _log.info("torchring: %s has a handler of this program's; the flight recorder does not "
                      "dump on it (torchring.dump_trace() still writes a dump)", signal.Signals(signum).name)


def _serve(state: _Armed) -> None:
    while True:
        try:
            timeout = state.status_s if state.status_s > 0 and not state.stopped else None
            if not select.select([state.read_fd], [], [], timeout)[0]:
                write_status(state)
                continue
            data = os.read(state.read_fd, 64)
        except OSError:
            return
        if not data:
            return
        failure = _FAILURE in data
        request = bytes([signal.SIGUSR1]) in data
        if bytes([signal.SIGTERM]) in data:  # dump; the engine's watchdog then ends the process
            _write(state, "SIGTERM")
            write_status(state, ending=True, how="stopped by SIGTERM")
            state.engine.trace_signal_dumped()
            return
        if failure:
            state.pending_failure = True
            if time.monotonic() - state.last_failure_dump < 1.0 and not request:
                time.sleep(1.0)  # a burst of failures (every group at once): dump once after it
        if failure or request:
            reason = "failure" if failure else "request"
            _write(state, reason)
            if failure:
                state.last_failure_dump = time.monotonic()


def _write(state: _Armed, reason: str) -> Path | None:
    with state.lock:
        return _write_locked(state, reason)


def _write_locked(state: _Armed, reason: str) -> Path | None:
    announced = state.engine.trace_failures()
    failed = state.pending_failure or announced > state.failures_dumped
    state.pending_failure = False
    state.failures_dumped = announced
    try:
        snapshot = state.engine.trace_snapshot()
        if not snapshot[0] and reason != "request":  # every communicator is gone: keep the last dump
            return None
        built = _dump.build(snapshot, rank=state.rank, world=state.world, host=state.host,
                            reason=reason if not failed else "failure", timeout_s=state.timeout_s)
        return _dump.write(built, state.directory, state.rank)
    except Exception as e:  # a dump must never take the job down
        _log.warning("torchring: rank %d could not write its flight-recorder dump to %s: %s",
                     state.rank, state.directory, e)
        return None


def write_status(state: _Armed | None = None, ending: bool = False, how: str = "exited") -> None:
    """Writes the rank's status file now (`ending`: its last, marked `how`). Never raises."""
    state = state or _armed
    if state is None or state.status_s <= 0 or state.pid != os.getpid() or (state.stopped and not ending):
        return
    with state.lock:
        try:
            status = _status.measure(state.engine, state.rank, state.world, state.host, state.status_s,
                                     state.rates, how if ending else "running")
            if ending and status["ops"] == 0 and state.last_status:  # the communicators are gone
                status = dict(state.last_status, state=how, time_ns=status["time_ns"], current=None)
            state.last_status = status
            _status.write(state.directory, status)
        except Exception as e:  # the status must never take the job down
            _log.debug("torchring: rank %d could not write its status to %s: %s", state.rank, state.directory, e)
        if ending:
            state.stopped = True


def dump_now(reason: str = "request") -> Path | None:
    """Writes this rank's dump now, on the calling thread; its path (None when not armed or it failed)."""
    state = _armed
    return _write(state, reason) if state is not None else None


def _at_exit() -> None:
    # The thread's dump in progress is waited for (once the interpreter finalizes, a daemon thread
    # stops where it is, its file unwritten); a failure whose byte it has not read yet is dumped
    # here: the engine's count says.
    state = _armed
    if state is None or state.pid != os.getpid():  # a forked child: its lock may be held forever
        return
    with state.lock:
        if state.pending_failure or state.engine.trace_failures() > state.failures_dumped:
            _write_locked(state, "failure")
    if not state.stopped:
        write_status(state, ending=True)

