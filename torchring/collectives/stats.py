"""Who made whom wait: each rank's waits by peer, and the straggler report made from all of them.

    torchring.stats()           # {"waited_s": {1: 0.02, 2: 3.1}}: this rank's waits, by world rank
                                # (and "own_link_s": 1.4 where its own link held it up)
    torchring.stragglers()      # every rank calls it; the report lines, the slowest rank first

The engine times every wait for a peer past its first check: a rank waiting in shared memory for
a rank of its host, a host's leader waiting on a TCP link for another host's leader (so across
hosts the wait is charged to that host's leader, which waited for its own host first). A
leader's wait during which its own link still held back bytes it had sent is charged to no
peer: it is ``own_link_s`` (a slow link hides behind the socket's buffer, and its rank would
otherwise seem to wait for the partners its bytes had not reached). The totals run from the
communicator's start. A rank that made the others wait is late arriving at
the collectives: the report (torchring/trace/stragglers.py) sums, for each rank, how long every
other rank waited for it, and names the phase it was late in.
"""

from __future__ import annotations

from typing import Any

from .._core import build as _build, context as _context
from ..trace import status as _status, stragglers as _stragglers
from .._core.group_wiring import GroupBase, target
from .basic import allgather_object

__all__ = ["stats", "stragglers"]


def stats(group: GroupBase | None = None) -> dict[str, Any]:
    """This rank's waits for each peer, in seconds by world rank, since the world or `group` formed."""
    t = target(group, "stats")
    waited = t.comm.waited_seconds()
    out: dict[str, Any] = {"waited_s": {t.ranks[r]: s for r, s in enumerate(waited) if s > 0}}
    own = t.comm.own_link_seconds()
    if own > 0:
        out["own_link_s"] = own
    return out


def stragglers(group: GroupBase | None = None, top: int = 5) -> list[str]:
    """The ranks that made the others wait most, as report lines (a collective: every rank calls it)."""
    t = target(group, "stragglers")
    mine = {"rank": t.world_rank, "host": _context.wiring()[2], **stats(group),
            "phases": _status.phases(_build.load())}
    return _stragglers.report(allgather_object(mine, group), top=top)
