"""The NCCL communicator through an in-process re-forming (torchring.elastic): when the new
world is the old one less some ranks, the survivors shrink the old communicator
(ncclCommShrink, NCCL >= 2.27: no new unique id, no new bootstrap) instead of making one.

    world.reform:  parent = gpu_path.keep()          before the old world shuts down
                   ... the next epoch is agreed ...
                   exclude = plan(old_world, [m.old_rank for m in members])
                   init(..., shrink_from=(parent, exclude))  ->  gpu_path.setup -> shrunk()
                   release(parent)

plan() is the old ranks to leave out, or None when the new world is not a subset of the old
one in the old order (a newcomer joined: only a new communicator can include it). shrunk()
asks every rank whether it can (a kept, healthy parent on this device, NCCL with the call,
the same plan) through the epoch's store: one rank that cannot makes every rank take the
fresh path, so no rank waits in a shrink that others never call.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["plan", "can_shrink", "shrunk", "release"]


def plan(old_world: int, old_ranks: Sequence[int]) -> list[int] | None:
    """The old ranks to exclude so that the old communicator becomes the new world (members'
    old ranks in new-rank order); None if a member is new or the order differs."""
    if any(r < 0 or r >= old_world for r in old_ranks) or list(old_ranks) != sorted(set(old_ranks)):
        return None
    return sorted(set(range(old_world)) - set(old_ranks))


def can_shrink(parent: Any, exclude: list[int] | None, device: int | None, supported: bool) -> bool:
    """Whether this rank can take part in a shrink of `parent` (the kept NcclComm, or None)."""
    return (parent is not None and exclude is not None and supported and device is not None
            and parent.device == device and not parent.failed())


def _agree(store: Any, rank: int, world: int, mine: str) -> bool:
    """True if every rank of the new world wrote the same `mine` (a word, or "" for cannot)."""
    if world == 1:
        return bool(mine)
    store.set(f"nccl_shrink/{rank}", mine)
    words = {store.get(f"nccl_shrink/{r}").decode() for r in range(world)}
    return words == {mine} and bool(mine)


def shrunk(engine: Any, shrink_from: tuple[Any, list[int] | None] | None, store: Any, rank: int, world: int,
           device: int, timeout: float) -> Any:
    """The new world's NcclComm made from the kept parent, or None (make a fresh one): see the module docstring."""
    parent, exclude = shrink_from or (None, None)
    ok = can_shrink(parent, exclude, device, bool(engine.NcclComm.shrink_supported()))
    mine = "shrink:" + ",".join(map(str, exclude or [])) if ok else ""
    if not _agree(store, rank, world, mine):
        return None
    if not exclude:  # the same ranks in the same order: the parent is the new world's already
        return parent
    comm = engine.NcclComm(parent, exclude, False, timeout)
    if comm.rank != rank or comm.size != world:
        comm.close()
        raise RuntimeError(f"rank {rank}: ncclCommShrink gave rank {comm.rank} of {comm.size}, expected "
                           f"{rank} of {world}; the re-formed world's order differs from NCCL's")
    return comm


def release(parent: Any, current: Any) -> None:
    """Frees the kept parent unless it is `current` (the new world's communicator itself)."""
    if parent is None or parent is current:
        return
    parent.abort("torchring: the world was re-formed; this NCCL communicator is no longer used")
    parent.close()
