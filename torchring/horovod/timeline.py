"""Horovod's timeline: a Chrome trace (chrome://tracing, Perfetto) of every negotiated operation.

``HOROVOD_TIMELINE=/path/file.json`` at hvd.init(), or ``hvd.start_timeline(path)`` later, makes
rank 0 write one row per operation name, with Horovod's phase names: ``NEGOTIATE_<KIND>`` from
the moment this rank submitted it until every rank had (the name became ready), then ``<KIND>``
(``ALLREDUCE``, ``ALLGATHER``, ...) until its result was complete here. With
``HOROVOD_TIMELINE_MARK_CYCLES=1`` (or ``mark_cycles=True``) every negotiation round adds an
instant ``CYCLE_START`` mark. ``hvd.stop_timeline()`` closes the file as valid JSON.

The file is a JSON array of trace events: metadata events name each row (``process_name``,
one ``pid`` per operation name) and carry ``start_time_since_epoch_in_micros``; ``B``/``E``
events open and close phases, ``i`` events are the cycle marks; ``ts`` is microseconds since start.
"""

from __future__ import annotations

import json
import threading
import time
from typing import IO

__all__ = ["start", "stop", "active", "negotiate_start", "negotiate_end", "op_end", "cycle_start"]

_lock = threading.Lock()
_file: IO[str] | None = None
_mark_cycles = False
_t0 = 0.0
_rows: dict[str, int] = {}
_open: dict[str, str] = {}  # name -> the phase open on its row
_first = True


def _write(event: dict) -> None:
    global _first
    assert _file is not None
    _file.write(("[\n" if _first else ",\n") + json.dumps(event))
    _first = False


def _row(name: str) -> int:
    pid = _rows.get(name)
    if pid is None:
        pid = _rows[name] = len(_rows) + 1
        _write({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
        _write({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
    return pid


def _ts() -> int:
    return int((time.time() - _t0) * 1e6)


def start(path: str, mark_cycles: bool = False) -> None:
    """Starts writing the trace to `path` (ends a trace already being written)."""
    global _file, _mark_cycles, _t0, _first
    stop()
    with _lock:
        _file = open(path, "w")
        _mark_cycles, _t0, _first = bool(mark_cycles), time.time(), True
        _rows.clear()
        _open.clear()
        _write({"name": "timeline", "ph": "M", "pid": 0,
                "args": {"start_time_since_epoch_in_micros": int(_t0 * 1e6)}})
        _file.flush()


def stop() -> None:
    """Closes the trace as a valid JSON array (nothing happens when none is being written)."""
    global _file
    with _lock:
        if _file is None:
            return
        now = _ts()
        for name, phase in _open.items():
            _write({"name": phase, "ph": "E", "ts": now, "pid": _rows[name]})
        _open.clear()
        _file.write("\n]\n")
        _file.close()
        _file = None


def active() -> bool:
    """True while a trace is being written."""
    return _file is not None


def _phase(name: str, phase: str) -> None:
    """Closes the phase open on `name`'s row and opens `phase` (None: just close)."""
    with _lock:
        if _file is None:
            return
        pid, now = _row(name), _ts()
        was = _open.pop(name, None)
        if was is not None:
            _write({"name": was, "ph": "E", "ts": now, "pid": pid})
        if phase:
            _open[name] = phase
            _write({"name": phase, "ph": "B", "ts": now, "pid": pid})
        _file.flush()


def negotiate_start(name: str, kind: str) -> None:
    """`name` was submitted here and waits for the other ranks."""
    if _file is not None:
        _phase(name, f"NEGOTIATE_{kind.upper()}")


def negotiate_end(name: str, kind: str) -> None:
    """Every rank submitted `name`; its data operation starts."""
    if _file is not None:
        _phase(name, kind.upper())


def op_end(name: str) -> None:
    """`name`'s result is complete on this rank."""
    if _file is not None and name in _open:
        _phase(name, "")


def cycle_start() -> None:
    """A negotiation round began (recorded with mark_cycles only)."""
    if _file is None or not _mark_cycles:
        return
    with _lock:
        if _file is not None:
            _write({"name": "CYCLE_START", "ph": "i", "ts": _ts(), "pid": 0, "s": "g"})
            _file.flush()
