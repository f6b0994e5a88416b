"""Whether this host's /dev/shm holds what the shared-memory transport may use, said once at init.

A container starts with a 64 MiB /dev/shm (docker's default; Kubernetes pods have no larger one
unless an emptyDir of medium Memory is mounted there). torchring's shared-memory transport runs
in it (its control region and segments are a few MiB per rank, reserved at init: a /dev/shm too
small for those fails init with the error that names it), but the arena that tensors may live
in (TORCHRING_SHM_ARENA_MB per rank, committed as tensors are placed there: wrap's gradient
buckets, torchring.empty) is then mostly out of reach: what does not fit stays in private
memory, which costs one copy per allreduce. ``advice`` says so with the sizes and the fix, for
local rank 0 to log once; nothing when the room is enough or the arena is off.
"""

from __future__ import annotations

import os

__all__ = ["advice", "advice_once", "room_mb"]

_NEEDED_PER_RANK_MB = 64  # below this per rank, the arena holds too little to be worth having


def room_mb(path: str = "/dev/shm") -> tuple[float, float] | None:
    """(total, free) MiB of the file system at `path`; None where it cannot be read."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize / 2**20, st.f_bavail * st.f_frsize / 2**20


def advice(local_size: int, arena_mb: int, room: tuple[float, float] | None, path: str = "/dev/shm") -> str | None:
    """The note for a host whose `room` (total, free MiB) is small for `local_size` ranks with
    arenas of `arena_mb` each; None when it is not."""
    if room is None or local_size < 2 or arena_mb <= 0:
        return None
    total, free = room
    wanted = min(arena_mb, _NEEDED_PER_RANK_MB) * local_size
    if free >= wanted:
        return None
    return (f"{path} has {free:.0f} MiB free of {total:.0f} MiB for {local_size} ranks on this host (a "
            f"container's default is 64 MiB): the shared-memory transport runs, but tensors that do not "
            f"fit its arena (TORCHRING_SHM_ARENA_MB={arena_mb} per rank) stay in private memory, one copy "
            f"more per allreduce. Give it more room: docker run --shm-size=2g (Kubernetes: an emptyDir "
            f"with medium: Memory mounted at /dev/shm), or set TORCHRING_SHM_ARENA_MB=0 to silence this")


_said = False


def advice_once(local_size: int, arena_mb: int) -> str | None:
    """advice() for this host's /dev/shm, the first time it has something to say in this process."""
    global _said
    note = None if _said else advice(local_size, arena_mb, room_mb())
    _said = _said or note is not None
    return note
