"""Name-keyed negotiation: ranks may issue named operations in different orders and still meet.

The engine runs a communicator's collectives in the order each rank submits them, so ranks must
agree on that order. Horovod's users do not promise one: two async ops issued as (a, b) on one
rank and (b, a) on another must both complete. One ``Negotiator`` per process set makes the order.

How it works, in the words the code uses. A *request* is what one rank asks for: an operation
``name`` ("allreduce.grad.w1"), its ``kind`` and the metadata every rank must agree on (dtype,
shapes, op, scale factors, root). ``submit()`` puts the request in this rank's ``_queue`` and wakes
the *negotiation thread*. The thread runs *rounds*; round k of every member is one allgather on the
set's private communicator, carrying the requests each rank queued since its round k-1, so after
every round all members hold the same ``_table`` (name -> {rank: request}). A name is *ready* when
every member that has not joined asked for it; ready names are validated and started in the order
their first request arrived (round, then rank, then position), which is the same on every rank, so
the data operations reach the engine in one order everywhere. Validation failures (a shape or dtype
that differs) resolve the entry with an error that names the ranks, on every rank, and nothing is
sent. A thread with nothing of its own in flight sleeps; its peers then wait in their round's
allgather until it has something to say (the engine's timeout bounds that wait, and a stall warning
names the pending operations and the ranks missing after ``stall_warning_s``).

``join``: a rank that called hvd.join() is *joined* from the round its join request arrives; the
others' allreduces and reducescatters no longer wait for it, and it takes part in them with zeros.
The join itself is ready when every member joined; its result is the highest rank among those that
joined in the last round. ``barrier`` is ready when every member asked: the round itself is the
synchronization, no data moves.
"""

from __future__ import annotations

import pickle
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .._core import log as _log
from .._core.errors import CollectiveMismatchError, TorchringError, WaitTimeoutError
from .._core.types import OpKind
from . import timeline

__all__ = ["Done", "Request", "Entry", "Negotiator", "validate", "register_joined_starter"]

# Horovod's request kinds as the engine's OpKinds (barrier and join compare nothing); their
# OpSpec rows say what the ranks must agree on. A joined rank supplies zeros, which only a
# reduction can take.
_KINDS = {"allreduce": OpKind.ALLREDUCE, "allgather": OpKind.ALLGATHER, "broadcast": OpKind.BROADCAST,
          "alltoall": OpKind.ALLTOALL, "reducescatter": OpKind.REDUCE_SCATTER}
_NO_JOINED = tuple(name for name, kind in _KINDS.items() if not kind.reduces)  # no joined rank then
_SLOT = 4096  # bytes each rank sends in a round's first allgather; more goes in a second one


@dataclass(frozen=True)
class Request:
    """One rank's request for operation `name` (what every rank must agree on)."""

    name: str
    kind: str  # allreduce, allgather, broadcast, alltoall, reducescatter, barrier, join
    dtype: str = ""
    shapes: tuple[tuple[int, ...], ...] = ()
    device: str = "cpu"
    op: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    root: int = -1
    splits: tuple[int, ...] | None = None
    stamp: float = 0.0  # join: when this rank joined (time.time()), to name the last one


class Done:
    """A start result that is finished already (barrier, join): wait() returns `value`."""

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def wait(self, timeout: float | None = None) -> Any:
        return self.value

    def is_completed(self) -> bool:
        return True


@dataclass
class Entry:
    """This rank's side of a request: started (or failed) by the negotiation thread."""

    request: Request
    start: Callable[[dict[int, Request], frozenset[int]], Any]  # (requests by rank, joined) -> result
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None
    submitted: float = field(default_factory=time.monotonic)

    def resolve(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


def _differ(requests: dict[int, Request], what: str, get: Callable[[Request], Any]) -> str | None:
    """'rank 0 sent X, rank 1 sent Y' when the ranks' `get` values differ, else None."""
    values = {r: get(q) for r, q in requests.items()}
    if len(set(map(repr, values.values()))) <= 1:
        return None
    shown = ", ".join(f"rank {r} sent {v}" for r, v in sorted(values.items()))
    return f"the ranks disagree on the {what}: {shown}"


def validate(requests: dict[int, Request], joined: frozenset[int]) -> str | None:
    """Why the ranks' `requests` for one name cannot run together, or None when they can."""
    kind = next(iter(requests.values())).kind
    op_kind = _KINDS.get(kind)
    if op_kind is None:  # barrier, join
        return None
    if joined and kind in _NO_JOINED:
        return (f"rank(s) {sorted(joined)} called hvd.join() and supply no data; {kind} cannot run "
                "while a rank has joined (only allreduce and reducescatter take zeros from joined ranks)")
    checks: list[tuple[str, Callable[[Request], Any]]] = [
        ("dtype", lambda q: q.dtype), ("device", lambda q: q.device),
        ("number of tensors", lambda q: len(q.shapes))]
    if op_kind.ragged:
        checks.append(("number of dimensions", lambda q: [len(s) for s in q.shapes]))
        checks.append(("shape after the first dimension", lambda q: [list(s[1:]) for s in q.shapes]))
    else:
        checks.append(("shape", lambda q: list(q.shapes[0]) if len(q.shapes) == 1 else
                       [list(s) for s in q.shapes]))
    if op_kind.reduces:
        checks += [("reduction op", lambda q: q.op), ("prescale_factor", lambda q: q.prescale),
                   ("postscale_factor", lambda q: q.postscale)]
    if op_kind.rooted:
        checks.append(("root rank", lambda q: q.root))
    for what, get in checks:
        why = _differ(requests, what, get)
        if why:
            return why
    return None


class Negotiator:
    """The negotiation thread of one process set (see the top of this file)."""

    def __init__(self, group: Any, members: tuple[int, ...], me: int, set_id: int,
                 cycle_s: float, stall_warning_s: float) -> None:
        self._group, self._members, self._me, self._set_id = group, members, me, set_id
        self._cycle_s, self._stall_s = cycle_s, stall_warning_s
        self._lock = threading.Condition()
        self._queue: list[Entry] = []
        self._mine: dict[str, Entry] = {}  # name -> this rank's entry, until resolved
        self._table: dict[str, dict[int, Request]] = {}
        self._first: dict[str, tuple[int, int, int]] = {}  # name -> (round, rank, position)
        self._joined: dict[int, int] = {}  # rank -> round its join arrived
        self._round = 0
        self._warned: set[str] = set()
        self._stopping = False
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=f"torchring-hvd-set{set_id}",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the caller's side
    def submit(self, entry: Entry) -> None:
        """Queues `entry`; ValueError if an operation of the same name is still in flight here."""
        name = entry.request.name
        with self._lock:
            if self._failure is not None:
                raise self._failure
            if self._stopping:
                raise TorchringError(f"rank {self._me}: {name}: Horovod is shutting down")
            if name in self._mine:
                raise ValueError(f"rank {self._me}: an operation named {name!r} is already in flight "
                                 f"on process set {self._set_id}; wait for it (hvd.synchronize) or "
                                 "give the new one another name")
            self._mine[name] = entry
            self._queue.append(entry)
            self._lock.notify_all()
        timeline.negotiate_start(name, entry.request.kind)

    def stop(self) -> None:
        """Ends the thread after its current round; unfinished entries fail."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        self._thread.join(timeout=5)
        self._fail_all(TorchringError(f"rank {self._me}: Horovod was shut down (process set "
                                      f"{self._set_id}) before this operation ran"))

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        idle = 0  # rounds in a row that neither made progress nor carried a new request
        try:
            while True:
                with self._lock:
                    while not self._queue and not self._mine and not self._stopping:
                        self._lock.wait()
                    if self._stopping:
                        return
                    new, self._queue = self._queue, []
                progressed = self._run_round([e.request for e in new])
                idle = 0 if progressed or new else idle + 1
                if not progressed:
                    # Nothing became ready: wait a cycle, longer after each fruitless round (up
                    # to 10 cycles), or until this rank submits something.
                    with self._lock:
                        if not self._queue and not self._stopping:
                            self._lock.wait(self._cycle_s * min(1 + idle, 10))
                self._check_stalls()
        except BaseException as exc:  # the communicator failed: every entry fails with it
            with self._lock:
                self._failure = exc
            self._fail_all(exc)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            entries, self._mine, self._queue = list(self._mine.values()), {}, []
        for entry in entries:
            entry.resolve(error=exc)

    def _exchange(self, payload: bytes) -> list[bytes]:
        """Every member's `payload`, by position in the set (one allgather, two when large)."""
        n = len(self._members)
        slot = torch.zeros(_SLOT, dtype=torch.uint8)
        head = struct.pack("<q", len(payload))
        slot[:8] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        fits = len(payload) <= _SLOT - 8
        if fits and payload:
            slot[8:8 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        rows = self._wait(self._group.allgather_async(slot.view(1, _SLOT))).view(n, _SLOT)
        sizes = [struct.unpack("<q", bytes(rows[i, :8].tolist()))[0] for i in range(n)]
        if all(s <= _SLOT - 8 for s in sizes):
            return [bytes(rows[i, 8:8 + sizes[i]].numpy().tobytes()) for i in range(n)]
        big = max(sizes)
        buf = torch.zeros(big, dtype=torch.uint8)
        if payload:
            buf[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        rows = self._wait(self._group.allgather_async(buf.view(1, big))).view(n, big)
        return [rows[i, :sizes[i]].numpy().tobytes() for i in range(n)]

    def _wait(self, handle: Any) -> Any:
        """`handle`'s result, checking for stalls every second while the round waits for peers."""
        while True:
            try:
                return handle.wait(timeout=1.0)
            except WaitTimeoutError:
                if self._stopping:  # hvd.shutdown() here while peers never came: give up now
                    raise TorchringError(f"rank {self._me}: Horovod was shut down (process set "
                                         f"{self._set_id}) while a negotiation round waited for "
                                         "other ranks") from None
                self._check_stalls()

    def _run_round(self, new: list[Request]) -> bool:
        """One round: share `new`, then start or fail every name that became ready."""
        self._round += 1
        timeline.cycle_start()
        received = self._exchange(pickle.dumps(new) if new else b"")
        for pos, (rank, data) in enumerate(zip(self._members, received)):
            for i, request in enumerate(pickle.loads(data) if data else []):
                if request.kind == "join":
                    self._joined.setdefault(rank, self._round)
                self._table.setdefault(request.name, {})[rank] = request
                self._first.setdefault(request.name, (self._round, pos, i))
        ready = [name for name in self._table if self._is_ready(name)]
        ready.sort(key=self._first.__getitem__)
        for name in ready:
            self._finish(name)
        return bool(ready)

    def _is_ready(self, name: str) -> bool:
        asked = self._table[name]
        kind = next(iter(asked.values())).kind
        if kind == "join":
            return len(asked) == len(self._members)
        if kind in _NO_JOINED and self._joined:
            return True  # fails at once (validate): waiting could not help, and unnamed
            # operations' counters differ between ranks that skipped some while joined
        return all(r in asked or r in self._joined for r in self._members)

    def _finish(self, name: str) -> None:
        requests = self._table.pop(name)
        self._first.pop(name, None)
        self._warned.discard(name)
        with self._lock:
            entry = self._mine.pop(name, None)
        kind = next(iter(requests.values())).kind
        joined = frozenset(self._joined)
        if kind == "join":
            # The last to join: by round, then by when each called join() (joins that met in
            # one round because the last joiner's thread was idle until then), then by rank.
            last = max(self._joined, key=lambda r: (self._joined[r], requests[r].stamp, r))
            self._joined.clear()
            if entry is not None:
                entry.resolve(Done(last))
            return
        why = validate(requests, joined)
        if why is not None:
            if entry is not None:
                entry.resolve(error=CollectiveMismatchError(
                    f"rank {self._me}: {kind} {name!r} on process set {self._set_id} cannot run: "
                    f"{why}; every rank must issue the same operation under one name"))
            return
        if entry is None:  # a joined rank: it takes part with zeros (start(...) knows how)
            starter = _JOINED_STARTERS.get(kind)
            if starter is not None and self._me in joined:
                try:
                    starter(self._group, requests, joined)
                except Exception as exc:  # this rank's zeros could not be sent: say so, go on
                    _log.logger.error(f"rank {self._me}: {name!r}: this rank has joined and could "
                                      f"not take part with zeros: {exc}")
            return
        timeline.negotiate_end(name, kind)
        try:
            entry.resolve(entry.start(requests, joined))
        except Exception as exc:  # a local problem starting the op (the engine refused it)
            entry.resolve(error=exc)

    def _check_stalls(self) -> None:
        if self._stall_s <= 0:
            return
        now = time.monotonic()
        with self._lock:
            mine = list(self._mine.items())
        for name, entry in mine:
            if name in self._warned or now - entry.submitted < self._stall_s:
                continue
            self._warned.add(name)
            asked = self._table.get(name, {})
            missing = [r for r in self._members if r not in asked and r not in self._joined]
            _log.logger.warning(
                f"rank {self._me}: {name!r} (process set {self._set_id}) has waited "
                f"{now - entry.submitted:.0f} s; ranks that have not submitted it: "
                f"{missing or 'unknown (they have not reached this round yet)'}. One or more ranks "
                "skipped this operation or submitted it under another name; this will end in the "
                "engine's timeout (TORCHRING_TIMEOUT)")


# kind -> start(group, requests, joined) for a joined rank without an entry of its own (ops fills it).
JoinedStarter = Callable[[Any, dict[int, Request], frozenset[int]], Any]
_JOINED_STARTERS: dict[str, JoinedStarter] = {}


def register_joined_starter(kind: str, start: JoinedStarter) -> None:
    """How a joined rank takes part in a `kind` operation with zeros (called by the ops module)."""
    _JOINED_STARTERS[kind] = start
