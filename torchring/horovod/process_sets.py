"""Horovod's process sets on torchring's groups.

A ``ProcessSet`` is a list of world ranks. Registered (``hvd.init(process_sets=[...])`` or
``hvd.add_process_set(...)``, called by every rank in the same order, members or not), it gets an
id and two torchring groups over its ranks:

- ``.group``, for direct engine collectives that every member calls in the same order (the
  DistributedOptimizer's buckets, SyncBatchNorm, broadcast_parameters); the global set's is
  ``torchring.world_group()``;
- a private one that only its ``Negotiator`` uses: the name-matched hvd collectives (negotiator.py).

So direct and negotiated traffic never interleave on one communicator. ``global_process_set`` is
one object for the life of the program (Horovod's functions take it as a default argument); its
groups are set up by every ``hvd.init()`` and dropped by ``hvd.shutdown()``.
"""

from __future__ import annotations

from typing import Any, Sequence

from .._core import context as _context
from ..collectives import groups
from . import knobs
from .negotiator import Negotiator

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set"]


class ProcessSet:
    """A set of world ranks that run collectives together (registered by hvd.init or add_process_set)."""

    process_set_id: int | None = None
    ranks: list[int] | None = None

    def __init__(self, ranks_or_comm: Sequence[int]) -> None:
        try:
            ranks = sorted(set(ranks_or_comm))
        except TypeError:
            raise ValueError("ProcessSet(...) takes a list of world ranks; torchring does not take "
                             f"MPI communicators (got {type(ranks_or_comm).__name__})") from None
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError(f"ProcessSet({list(ranks_or_comm)!r}): ranks must be ints")
        self.ranks = ranks
        self.group: Any = None  # torchring.Group for direct collectives (after registration)
        self._private: Any = None
        self._negotiator: Negotiator | None = None
        self._counters: dict[str, int] = {}

    def size(self) -> int | None:
        """Number of ranks in the set, or None when it is not registered."""
        return None if self.process_set_id is None else len(self.ranks or ())

    def rank(self) -> int | None:
        """This process's rank within the set (-1 if not a member), or None when not registered."""
        if self.process_set_id is None:
            return None
        me = _context.rank()
        return self.ranks.index(me) if me in (self.ranks or ()) else -1

    def included(self) -> bool | None:
        """Whether this process is in the set (None before hvd.init())."""
        if self.ranks is None or not _context.is_initialized():
            return None
        return _context.rank() in self.ranks

    def auto_name(self, kind: str) -> str:
        """`<kind>.noname.<n>`: the n-th unnamed `kind` of this set (the same on every rank that
        issues the same unnamed operations)."""
        n = self._counters.get(kind, 0)
        self._counters[kind] = n + 1
        return f"{kind}.noname.{n}"

    def negotiator(self, what: str) -> Negotiator:
        """The set's negotiator, or a clear error when the set cannot run `what` here."""
        me = _context.rank() if _context.is_initialized() else -1
        if self.process_set_id is None or self._private is None:
            raise ValueError(f"rank {me}: hvd.{what}: {self} is not registered; pass it to hvd.init("
                             "process_sets=...) or hvd.add_process_set() first (after hvd.init())")
        if self._negotiator is None:
            raise ValueError(f"rank {me}: hvd.{what}: rank {me} is not in {self}; call it only on "
                             "the set's ranks (process_set.included() says)")
        return self._negotiator

    def _register(self, set_id: int, direct: Any, private: Any) -> None:
        self.process_set_id, self.group, self._private = set_id, direct, private
        self._counters = {}
        if private.is_member:
            k = knobs.current()
            self._negotiator = Negotiator(private, tuple(private.ranks), _context.rank(), set_id,
                                          k.cycle_time_ms / 1000.0,
                                          k.stall_warning_s if k.stall_check else 0.0)

    def _unregister(self) -> None:
        if self._negotiator is not None:
            self._negotiator.stop()
        for g in (self._private, self.group):
            if g is not None and g.id != 0:
                g.destroy()
        self._negotiator, self._private, self.group = None, None, None
        if self is not global_process_set:
            self.process_set_id = None

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0
_registered: dict[int, ProcessSet] = {}
_next_id = 1


def ready() -> bool:
    """True while the global set is set up (between hvd.init() and hvd.shutdown())."""
    return global_process_set._private is not None and _context.is_initialized()


def start(process_sets: Any) -> None:
    """Sets up the global set, then each of `process_sets` (a list, or "dynamic")."""
    global _next_id
    world = list(range(_context.size()))
    global_process_set.ranks = world
    global_process_set._register(0, groups.world_group(), groups.new_group(world))
    _registered.clear()
    _registered[0] = global_process_set
    _next_id = 1
    if process_sets is None or process_sets == "dynamic":
        return
    for ps in process_sets:
        add_process_set(ps)


def stop() -> None:
    """Drops every set's negotiator and groups (the global set object stays, unregistered)."""
    for ps in reversed(list(_registered.values())):
        ps._unregister()
    _registered.clear()


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Registers a process set (every rank calls it, in the same order) and returns it."""
    global _next_id
    if not ready():
        raise ValueError("hvd.add_process_set(): call hvd.init() first")
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    me, world = _context.rank(), _context.size()
    bad = [r for r in ps.ranks or () if not 0 <= r < world]
    if bad or not ps.ranks:
        raise ValueError(f"rank {me}: hvd.add_process_set({ps.ranks}): ranks must be a non-empty "
                         f"list of world ranks in [0, {world})")
    for other in _registered.values():
        if other.ranks == ps.ranks:
            raise ValueError(f"rank {me}: hvd.add_process_set({ps.ranks}): {other} has these ranks "
                             "already; reuse it")
    direct, private = groups.new_group(ps.ranks), groups.new_group(ps.ranks)
    ps._register(_next_id, direct, private)
    _registered[_next_id] = ps
    _next_id += 1
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregisters a process set (every rank calls it); False if it was not registered."""
    if process_set is global_process_set or process_set.process_set_id == 0:
        raise ValueError("hvd.remove_process_set(): the global process set cannot be removed")
    if _registered.get(process_set.process_set_id) is not process_set:
        return False
    del _registered[process_set.process_set_id]
    process_set._unregister()
    return True

