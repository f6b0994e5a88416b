"""Re-forming the world in process: leave the broken communicator, agree on the next epoch's
members through the store (membership.py), and wire a new communicator for them.

    try:
        step()
    except torchring.CommunicatorFailedError:
        epoch = torchring.elastic.reform()      # the survivors, ranked 0..n-1 again
        ...                                     # restore the last commit, sync it, go on

No process starts again: the survivors keep their interpreter, imports, engine, data-loader
workers and memory; a re-forming costs the failure's detection, `settle` seconds of waiting
for joiners when a member died silently, and one init() of the engine (see
benchmarks/RESULTS.md for the times measured).

The store is the launcher's (torchrun's agent, or the job's own): the epoch rendezvous needs it
to outlive the lost host, which holds when it is served outside the workers (the agent of a
host that stays, or a store process of its own). The world's groups end with the old
communicator: new_group() again after a re-forming, as Horovod's process sets are re-made.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

from .._core import context as _context, env as _env, rendezvous as _rendezvous
from . import membership
from .membership import Epoch, Member

_epoch = 0  # the epoch this process's world belongs to (0: the launcher's)

DEFAULT_SETTLE_S = 1.0


def epoch() -> int:
    """The membership epoch of the current world: 0 as launched, +1 at each re-forming."""
    return _epoch


def reform(min_size: int = 1, settle: float = DEFAULT_SETTLE_S, timeout: float | None = None) -> Epoch:
    """Leaves the current world and forms the next epoch's with every process that calls this
    too (the survivors of a failure); returns the epoch, whose rank and size torchring.rank()
    and torchring.size() report from now on. Raises TimeoutError below `min_size` members."""
    global _epoch
    old_rank, old_world = _context.rank(), _context.size()
    settings = _context.settings()
    launch = _env.detect()
    wait = settings.timeout if timeout is None else float(timeout)
    gone = dead_neighbours(*_context.wiring(), old_rank, old_world)
    _context.shutdown()
    host = settings.hostname or socket.gethostname()
    me = Member(f"{host}:{os.getpid()}", old_rank, host)
    if old_world == 1:
        joined = Epoch(_epoch + 1, (me,), 0)
    else:
        store = _rendezvous.store(launch, wait)
        job = f"{_context.job(settings, launch)}/{launch.restart}"
        joined = membership.join(store, job, _epoch + 1, me, expected=old_world - gone, min_size=min_size,
                                 settle=settle, timeout=wait)
    _epoch = joined.number
    _context.init(membership=(joined.rank, joined.size, joined.number))
    return joined


def dead_neighbours(store: Any, prefix: str, host: str, rank: int, world: int) -> int:
    """How many ranks of this world ran on this host in a process that is gone now: the epoch
    then closes as soon as the rest arrive, instead of waiting out the settle time (a lost
    host's ranks have no neighbour left to count them, and cost the settle time)."""
    if store is None:
        return 0
    gone = 0
    for peer in range(world):
        key = prefix + f"info/{peer}"
        if peer == rank or not store.check([key]):
            continue
        info = json.loads(store.get(key))
        if info.get("host") == host and not _alive(int(info["pid"])):
            gone += 1
    return gone


def _alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie, killed and not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
