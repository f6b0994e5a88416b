"""Groups underneath: their creation through the store, their communicators, and what a
collective needs to know about the group it runs on (a Target).

A group is a communicator over some of the world's ranks. ``create(ranks)`` is collective over
the world: the n-th call on every rank makes group n (ids count from 1; 0 is the world). Every
rank publishes the ranks it asked for under ``{prefix}group/{id}/ranks/{rank}``; the members
read every rank's list, so a rank that asked for another group is named (ValueError) and one
that never called is named after the timeout (CommunicatorFailedError). The members then wire a
communicator of their own under ``{prefix}group/{id}/`` exactly as init() wires the world's:
shared memory among the members of each host, TCP links between hosts.

collectives/groups.py puts a method per collective on top (the public Group); the collectives take a
Group or None (the world) and turn it into a Target with ``target()``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence, TypeVar

from . import context as _context, rendezvous as _rendezvous


def normalize_ranks(ranks: Any, world: int, rank: int) -> tuple[int, ...]:
    """`ranks` as new_group() keeps them: world ranks, sorted; a ValueError for a duplicate, a
    non-integer or a rank outside [0, world)."""
    where = f"rank {rank}: torchring.new_group"
    if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
        raise TypeError(f"{where}: ranks must be a list of world ranks, got {ranks!r}")
    ranks = list(ranks)
    bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int)]
    if bad:
        raise TypeError(f"{where}: ranks must be integers, got {bad[0]!r} in {ranks}")
    outside = [r for r in ranks if not 0 <= r < world]
    if outside:
        raise ValueError(f"{where}({ranks}): rank {outside[0]} is not in [0, {world}) (the world "
                         f"has {world} ranks)")
    twice = sorted({r for r in ranks if ranks.count(r) > 1})
    if twice:
        raise ValueError(f"{where}({ranks}): rank {twice[0]} is listed more than once; list each "
                         "rank once")
    return tuple(sorted(ranks))


def group_hosts(host_groups: Sequence[Sequence[int]], members: Sequence[int]) -> list[list[int]]:
    """The world's ranks per host restricted to `members` (sorted world ranks) and renumbered to
    group ranks; hosts without a member dropped, hosts ordered by their smallest group rank."""
    index = {w: g for g, w in enumerate(members)}
    hosts = [sorted(index[r] for r in host if r in index) for host in host_groups]
    return sorted((h for h in hosts if h), key=lambda h: h[0])


def ranks_text(ranks: Sequence[int]) -> str:
    """A group's ranks as messages show them (long lists shortened)."""
    if len(ranks) <= 12:
        return str(list(ranks))
    return f"[{', '.join(map(str, ranks[:8]))}, ..., {ranks[-1]}] ({len(ranks)} ranks)"


@dataclass(frozen=True)
class Target:
    """What a collective runs on: a communicator, this rank's place in it, and how to name it."""

    comm: Any
    rank: int  # this rank's rank in the communicator
    size: int
    world_rank: int
    gid: int  # 0: the world
    ranks: Sequence[int]  # world ranks by rank of the communicator

    @property
    def is_world(self) -> bool:
        return self.gid == 0

    def where(self, what: str) -> str:
        """The start of every message: the rank (and its group), then the function called."""
        if self.is_world:
            return f"rank {self.world_rank}: torchring.{what}"
        return (f"rank {self.world_rank} (rank {self.rank} of group {self.gid}, world ranks "
                f"{ranks_text(self.ranks)}): torchring.{what}")


class GroupBase:
    """A group's identity and life (the public Group in collectives/groups.py adds the collectives)."""

    def __init__(self, gid: int, ranks: tuple[int, ...], state: Any, comm: Any) -> None:
        self._gid, self._ranks, self._state, self._comm = gid, ranks, state, comm
        me = state.launch.rank
        self._rank = ranks.index(me) if me in ranks else -1
        self._destroyed = False
        self._built_target: Target | None = None  # _target()'s, built on first use

    @property
    def id(self) -> int:
        """The group's number: 0 for the world, then 1, 2, ... in the order of new_group() calls."""
        return self._gid

    @property
    def ranks(self) -> tuple[int, ...]:
        """The group's world ranks, ascending; group rank i is ranks[i]."""
        return self._ranks

    @property
    def is_member(self) -> bool:
        """True on the ranks of the group."""
        return self._rank >= 0

    def rank(self) -> int:
        """This process's rank in the group, or -1 if it is not a member."""
        return self._rank

    def size(self) -> int:
        """Number of ranks in the group."""
        return len(self._ranks)

    def group_rank(self, world_rank: int) -> int:
        """The group rank of world rank `world_rank`, or -1 if it is not a member."""
        return self._ranks.index(world_rank) if world_rank in self._ranks else -1

    def world_rank(self, group_rank: int) -> int:
        """The world rank of group rank `group_rank`."""
        if isinstance(group_rank, bool) or not isinstance(group_rank, int) or \
                not 0 <= group_rank < len(self._ranks):
            raise ValueError(f"{self._name()}: group rank {group_rank!r} is not in [0, {len(self._ranks)})")
        return self._ranks[group_rank]

    def destroy(self) -> None:
        """Shuts the group's communicator down (the world group: torchring.shutdown())."""
        if self._gid == 0:
            if _context._state is self._state:
                _context.shutdown()
            return
        self._destroyed = True
        comm = self._state.groups.pop(self._gid, None)
        if comm is not None:
            comm.shutdown()

    def _name(self) -> str:
        return "the world group" if self._gid == 0 else f"group {self._gid} (world ranks {ranks_text(self._ranks)})"

    def _target(self, what: str) -> Target:
        me = self._state.launch.rank
        if _context._state is not self._state:
            raise RuntimeError(
                f"rank {me}: torchring.{what} on {self._name()}, which belongs to a torchring "
                "session that was shut down; after torchring.init() create the group again with "
                "torchring.new_group() (or use torchring.world_group())")
        if self._destroyed:
            raise RuntimeError(f"rank {me}: torchring.{what} on {self._name()}, which was destroyed; "
                               "create a new one with torchring.new_group()")
        if self._rank < 0:
            raise ValueError(f"rank {me}: torchring.{what} on {self._name()}, but rank {me} is not "
                             "a member; call it only on the group's ranks (group.is_member says)")
        if self._built_target is None:  # built once (see target())
            comm = self._state.comm if self._gid == 0 else self._comm
            self._built_target = Target(comm, self._rank, len(self._ranks), me, self._gid, self._ranks)
        return self._built_target

    def __repr__(self) -> str:
        state = "destroyed" if self._destroyed else f"rank {self._rank}" if self._rank >= 0 else "not a member"
        return f"<torchring.Group {self._gid} ranks={ranks_text(self._ranks)} ({state})>"


G = TypeVar("G", bound=GroupBase)


def target(group: GroupBase | None, what: str) -> Target:
    """Where a collective called as torchring.`what` runs: `group`, or the world for None."""
    if group is None:
        state = _context._require(what)
        if state.world_target is None:  # one per init(): building a frozen dataclass costs ~1 µs a call
            me, world = state.launch.rank, state.launch.world_size
            state.world_target = Target(state.comm, me, world, me, 0, range(world))
        return state.world_target
    if not isinstance(group, GroupBase):
        _context._require(what)
        raise TypeError(f"rank {_context.rank()}: torchring.{what}: group must be a torchring.Group "
                        f"(from torchring.new_group()) or None for the world, got {type(group).__name__}")
    return group._target(what)


def world(cls: type[G]) -> G:
    """The world as a `cls` (one object per init())."""
    state = _context._require("world_group")
    if not isinstance(state.world_group, cls):
        state.world_group = cls(0, tuple(range(state.launch.world_size)), state, state.comm)
    return state.world_group


def create(cls: type[G], ranks: Any) -> G:
    """new_group(): the next group of this process, wired up on its members (see the top)."""
    state = _context._require("new_group")
    me, world = state.launch.rank, state.launch.world_size
    members = normalize_ranks(ranks, world, me)
    gid = state.next_group
    state.next_group += 1
    prefix = f"{state.prefix}group/{gid}/"
    if state.store is not None:
        state.store.set(prefix + f"ranks/{me}", json.dumps(list(members)))
    if me not in members:
        return cls(gid, members, state, None)
    settings, timeout = state.settings, state.settings.timeout
    if len(members) > 1:
        for r in range(world):
            if r == me:
                continue
            what = (f"rank {r} to call torchring.new_group() for group {gid} (every rank of the "
                    "world calls it, members or not, in the same order)")
            theirs = json.loads(_rendezvous.get(state.store, prefix + f"ranks/{r}", me, what, timeout))
            if theirs != list(members):
                raise ValueError(
                    f"rank {me}: torchring.new_group({list(members)}) makes group {gid} here, but "
                    f"rank {r}'s group {gid} is new_group({theirs}); every rank must call "
                    "new_group() with the same ranks, in the same order")
    grank, hosts = members.index(me), group_hosts(state.host_groups, members)
    label = f"group {gid} of world ranks {ranks_text(members)} (the ranks in this message are group ranks): "
    comm = _rendezvous.connect(state.engine, state.store, prefix, grank, len(members), settings,
                               state.host, state.master_addr, secret=state.secret, groups=hosts,
                               arena_bytes=0, label=label, trace_name=f"group{gid}",
                               trace_desc="torchring.new_group", trace_ranks=list(members)).comm
    state.groups[gid] = comm
    return cls(gid, members, state, comm)
