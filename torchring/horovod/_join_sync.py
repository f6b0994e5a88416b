"""``hvd.join()`` for ``hvd.DistributedOptimizer``: a joined rank shadows the syncs it misses.

The optimizer reduces gradients with direct collectives on the global set's group
(_grad_sync.py), outside the negotiator, so the negotiator's join (a joined rank adds zeros to
the negotiated allreduces, negotiator.py) does not reach them by itself. This module links the two:

- every sync of a DistributedOptimizer on the global process set first submits a *marker*: a
  negotiated request of kind ``optimizer_sync`` that moves no data. Its ``splits`` field (not
  validated for this kind) carries the optimizer's *key* (a checksum of its parameters' names
  and shapes, and how many optimizers with that checksum this process made before) and the
  sync's number n among the set's syncs. Its name is ``optimizer_sync.<n % 2>``: two timeline
  rows, not one per step; a name is reused only once the marker of two syncs before is resolved
  (it is, in practice, long before: every rank submitted it before that sync's collectives);
- every rank submits its markers in the same order, since the syncs themselves are collectives
  that every rank runs in one order, so the names match without any agreement;
- on a rank that has joined, the marker becomes ready without an entry of its own and the
  negotiation thread calls ``_shadow`` (the joined starter of the kind): it finds the
  optimizer's sync by key and takes part with zeros (``GradSync.shadow``: every bucket and the
  used-map, the sparse allgathers, the first sync's agreement, in the active ranks' order).
  Average still divides by the set's size, joined ranks counting as zeros, as in Horovod.

The marker is submitted in ``synchronize()``, right before the Reducer's finalize, not at the
first gradient hook of a backward: the joined rank's negotiation thread is busy during a shadow
(it waits until the sync ends), while between backward and step the active ranks may wait for a
negotiated operation (an averaged loss) that needs that thread to add the joined rank's zeros.
From ``synchronize()`` on, the active ranks wait for nothing negotiated until the sync ended.
The cost when nobody joins is that marker: one negotiation round per step, in the background.
While a rank has joined, the others' bucket allreduces started during backward wait for it
until their ``synchronize()``.
"""

from __future__ import annotations

import threading
import weakref
import zlib
from typing import Any, Protocol, Sequence

from .._core import context as _context
from . import timeline
from .negotiator import Done, Entry, Negotiator, Request, register_joined_starter
from .process_sets import global_process_set

__all__ = ["KIND", "Shadowable", "register", "submit_marker"]

KIND = "optimizer_sync"


class Shadowable(Protocol):
    """What a joined rank needs of an optimizer's sync (_grad_sync.GradSync)."""

    def shadow(self) -> None: ...


_lock = threading.Lock()
_syncs: dict[tuple[int, int], weakref.ref] = {}   # key -> the optimizer's sync
_made: dict[int, int] = {}                          # checksum -> syncs made with it


class _Markers:
    """The global set's marker count and the last two markers (reset by a new negotiator)."""

    def __init__(self) -> None:
        self.negotiator: Negotiator | None = None
        self.count = 0
        self.last: list[Entry | None] = [None, None]

    def on(self, negotiator: Negotiator) -> None:
        if negotiator is not self.negotiator:  # hvd.init() again: every rank starts over
            self.negotiator, self.count, self.last = negotiator, 0, [None, None]


_markers = _Markers()


def register(sync: Shadowable, names: Sequence[str], shapes: Sequence[tuple[int, ...]]) -> tuple[int, int]:
    """The key of a new optimizer sync on the global set (the same on every rank that makes the
    same optimizers); a joined rank finds `sync` by it."""
    checksum = zlib.crc32(repr([(n, tuple(s)) for n, s in zip(names, shapes)]).encode())
    with _lock:
        made = _made.get(checksum, 0)
        _made[checksum] = made + 1
        key = (checksum, made)
        _syncs[key] = weakref.ref(sync, lambda ref, key=key: _forget(key, ref))
    return key


def _forget(key: tuple[int, int], ref: weakref.ref) -> None:
    with _lock:
        if _syncs.get(key) is ref:
            del _syncs[key]


def submit_marker(key: tuple[int, int]) -> None:
    """Submits the marker of this rank's next sync of the optimizer with `key` (see the top)."""
    negotiator = global_process_set.negotiator("DistributedOptimizer")
    with _lock:
        _markers.on(negotiator)
        n = _markers.count
        _markers.count += 1
        previous = _markers.last[n % 2]
    if previous is not None:
        previous.done.wait()  # resolved long ago in practice (see the top)
    name = f"{KIND}.{n % 2}"

    def started(requests: dict[int, Request], joined: frozenset[int]) -> Done:
        timeline.op_end(name)  # nothing runs after the negotiation
        return Done()

    entry = Entry(Request(name=name, kind=KIND, splits=(*key, n)), started)
    negotiator.submit(entry)
    with _lock:
        _markers.last[n % 2] = entry


def _shadow(group: Any, requests: dict[int, Request], joined: frozenset[int]) -> None:
    """A joined rank's part in the others' optimizer sync (runs on the negotiation thread)."""
    checksum, made, n = requests[min(requests)].splits  # type: ignore[misc]
    with _lock:
        _markers.on(global_process_set.negotiator("join"))
        _markers.count = n + 1  # this rank's next own sync is the set's next one
        _markers.last[n % 2] = None
        ref = _syncs.get((checksum, made))
    sync = ref() if ref is not None else None
    if sync is None:
        raise RuntimeError(
            f"rank {_context.rank()}: hvd.join(): ranks {sorted(requests)} synchronize a "
            "hvd.DistributedOptimizer that this rank does not have (number "
            f"{made} among those over parameters with checksum {checksum:08x}); this rank cannot "
            "take part and the others will wait until TORCHRING_TIMEOUT. Build the same "
            "DistributedOptimizers, in the same order, on every rank before any rank joins")
    sync.shadow()


register_joined_starter(KIND, _shadow)
