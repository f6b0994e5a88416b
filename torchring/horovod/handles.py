"""Horovod's int handles: what ``*_async`` returns, and ``poll`` / ``synchronize`` on it.

A handle stands for a negotiator ``Entry`` (negotiator.py). The negotiation thread resolves the
entry once every rank submitted the operation: with what its start function returned (a running
torchring Handle, or a finished value such as a barrier's) or with an error. ``synchronize`` waits
for that, then for the engine, and passes the engine's output through the operation's ``finish``
(a division for an integer Average, a narrow, a decompression, ...). Inputs and outputs stay
referenced here until then, so the engine never writes into freed memory.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any, Callable

from . import timeline
from .exceptions import raised_as_horovod, to_horovod
from .negotiator import Done, Entry

__all__ = ["Done", "add", "poll", "synchronize", "wait_entry", "clear"]


@dataclass
class _Slot:
    entry: Entry
    finish: Callable[[Any], Any]
    keep: Any  # inputs and outputs kept alive until synchronize()


_lock = threading.Lock()
_slots: dict[int, _Slot] = {}
_numbers = itertools.count()


def add(entry: Entry, finish: Callable[[Any], Any], keep: Any = None) -> int:
    """A new handle for `entry`; synchronize() returns finish(engine output)."""
    with _lock:
        handle = next(_numbers)
        _slots[handle] = _Slot(entry, finish, keep)
    return handle


def clear() -> None:
    """Forgets every handle (hvd.shutdown(): their operations were failed)."""
    with _lock:
        _slots.clear()


def poll(handle: int) -> bool:
    """True once the operation behind `handle` finished (synchronize() will not block)."""
    with _lock:
        slot = _slots.get(handle)
    if slot is None:
        raise ValueError(f"hvd.poll({handle!r}): no such handle (already synchronized, or not "
                         "returned by an *_async call of this hvd.init() session)")
    entry = slot.entry
    if not entry.done.is_set():
        return False
    return entry.error is not None or entry.result.is_completed()


def wait_entry(entry: Entry) -> Any:
    """The engine output of `entry` (waits for negotiation, then for the engine)."""
    while not entry.done.wait(0.5):
        pass
    if entry.error is not None:
        raise to_horovod(entry.error)
    with raised_as_horovod():
        return entry.result.wait()


def synchronize(handle: int) -> Any:
    """Waits for the operation behind `handle` and returns its output (None for an unknown handle)."""
    with _lock:
        slot = _slots.get(handle)
    if slot is None:
        return None
    try:
        out = slot.finish(wait_entry(slot.entry))
    finally:
        with _lock:
            _slots.pop(handle, None)
        timeline.op_end(slot.entry.request.name)
    return out
