"""Membership epochs: which processes form the world from now on, agreed through the store.

A job starts in epoch 0 with the launcher's ranks. When a collective fails (a peer died, a
cable was pulled) or the world is to grow, every process that can go on calls join() for the
next epoch, and leaves with the same answer as every other member: the epoch's members in
order, its own new rank, the new world size.

    keys under  torchring/{job}/elastic/{epoch}/
      arrivals        a counter; store.add() gives each joiner its arrival index a = 1, 2, ...
      member/{a}      the joiner's Member (uid, old rank, host), as JSON
      closed          the number of members n, written once by compare_set: the first joiner to
                      decide wins, every joiner reads the same n
    and             torchring/{job}/elastic/current   the newest closed epoch, for newcomers

The epoch closes, once at least `min_size` joiners are there, as soon as `expected` arrived (the
old world less the members known dead: world.py counts the dead processes on its own host, and
adds the joiners known to wait), or once no new joiner arrived for `settle` seconds, at least
`gather` seconds passed since the deciding joiner's own arrival, and every old rank that
`alive()` names has arrived (a lost host's ranks never arrive; a silent host's survivors notice
up to a few seconds apart: the rest read the first one's failure on the old world's board
within a second and arrive first, while the first still asks the board why; its post there says
it lives, so the epoch waits for it, up to `timeout`). Members already in a world let waiting processes in at a commit:
pending() counts the joiners of the next epoch, and the members join it too, expecting them.
Joiners 1..n are the epoch's members; a joiner that arrives after the close (a = n + 1, ...) is
not, and learns so by name. The members' new ranks keep the old
order: survivors sorted by their old rank, newcomers after them in arrival order, so rank 0
stays rank 0 unless it was lost.

Stale processes cannot join a newer epoch's world by accident: every epoch's wiring lives under
its own store prefix with its own secret, which the engine's handshake checks.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Member:
    """One process of an epoch: who it is (uid: host:pid) and which rank it had before (-1: new)."""

    uid: str
    old_rank: int
    host: str


@dataclass(frozen=True)
class Epoch:
    """An agreed membership: its number, its members in rank order, and this process's rank."""

    number: int
    members: tuple[Member, ...]
    rank: int

    @property
    def size(self) -> int:
        """The new world size."""
        return len(self.members)


class NotAMemberError(RuntimeError):
    """This process arrived after the epoch had closed without it."""


class JobEndedError(RuntimeError):
    """The job finished while this process waited to be let in."""


def _prefix(job: str, epoch: int) -> str:
    return f"torchring/{job}/elastic/{epoch}/"


def current(store: Any, job: str) -> int:
    """The newest closed epoch of `job` (0 before any re-forming)."""
    return int(store.add(f"torchring/{job}/elastic/current", 0))


def order(members: list[Member]) -> list[Member]:
    """Rank order: survivors by old rank, then newcomers as they arrived (stable)."""
    return sorted(members, key=lambda m: (m.old_rank < 0, m.old_rank if m.old_rank >= 0 else 0))


def pending(store: Any, job: str, epoch: int) -> int:
    """How many processes wait to join `epoch` (a newcomer, or a survivor that came too late for
    the epoch before): the members let them in at their next commit."""
    return int(store.add(_prefix(job, epoch) + "arrivals", 0))


def join(store: Any, job: str, epoch: int, me: Member, expected: int, min_size: int, settle: float,
         timeout: float, poll: float = 0.01, may_close: bool = True, ended_key: str | None = None,
         gather: float = 0.0, alive: Callable[[], set[int]] | None = None) -> Epoch:
    """Joins `epoch` of `job` and returns it once closed (see the module docstring); raises
    NotAMemberError if it closed before this process arrived, TimeoutError if fewer than
    `min_size` joined within `timeout` seconds (with enough, the settle time decides). A joiner
    with `may_close` False only waits: it is let in when the members come (a process waiting
    for a running world cannot tell how many will); it raises JobEndedError once `ended_key` is
    set in the store (the launcher's word that a member finished the job)."""
    keys = _prefix(job, epoch)
    arrival = int(store.add(keys + "arrivals", 1))
    store.set(keys + f"member/{arrival}", json.dumps(dataclasses.asdict(me)))
    start = last_change = time.monotonic()
    seen = arrival
    while True:
        closed = _closed(store, keys)
        if closed is None and not may_close:
            if ended_key is not None and store.check([ended_key]):
                raise JobEndedError(f"{me.uid}: job {job!r} finished while this process waited to join epoch "
                                    f"{epoch}; there is nothing left for it to do")
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"{me.uid}: the members of job {job!r} did not come to let it into epoch "
                                   f"{epoch} within {timeout:.0f} s (they do at their next commit)")
            time.sleep(poll)
            continue
        if closed is None:
            count = int(store.add(keys + "arrivals", 0))
            now = time.monotonic()
            if count != seen:
                seen, last_change = count, now
            quiet = now - last_change >= settle and now - start >= gather
            if quiet and count < expected and alive is not None and now - start < timeout:
                missing = alive() - {m.old_rank for m in _arrived(store, keys, count)}
                if missing:  # they live (they said so on the board): wait for them
                    time.sleep(max(poll, 0.1))
                    continue
            if count >= min_size and (count >= expected or quiet):
                closed = _close(store, keys, count)
            elif count < min_size and now - start > timeout:
                raise TimeoutError(
                    f"{me.uid} (rank {me.old_rank} before): epoch {epoch} of job {job!r} has {count} of "
                    f"the {min_size} members it needs after {timeout:.0f} s; the rest of the job is gone or "
                    f"cannot reach the store: start more ranks, or lower the minimum size")
            else:
                time.sleep(poll)
                continue
        if arrival > closed:
            raise NotAMemberError(
                f"{me.uid} (rank {me.old_rank} before) reached epoch {epoch} of job {job!r} after it closed "
                f"with {closed} members; it joins the next epoch, when the world is re-formed again")
        members = order(_arrived(store, keys, closed))
        rank = next(i for i, m in enumerate(members) if m.uid == me.uid)
        if rank == 0:  # one writer: the epoch's rank 0 says it is the newest
            store.set(f"torchring/{job}/elastic/current", str(epoch))
        return Epoch(epoch, tuple(members), rank)


def _arrived(store: Any, keys: str, count: int) -> list[Member]:
    """The first `count` joiners of the epoch under `keys`."""
    return [Member(**json.loads(store.get(keys + f"member/{a}"))) for a in range(1, count + 1)]


def _closed(store: Any, keys: str) -> int | None:
    """The closed epoch's member count, or None while it is open (check() never blocks)."""
    if not store.check([keys + "closed"]):
        return None
    return int(store.get(keys + "closed"))


def _close(store: Any, keys: str, count: int) -> int:
    """Closes the epoch with `count` members unless another joiner closed it first; the winner's count."""
    return int(store.compare_set(keys + "closed", "", str(count)))
