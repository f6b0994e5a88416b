"""Memory torchring manages: shared-memory tensors that the shared-memory transport reads
without a copy, and the pool that backward's gradients are allocated from."""

from __future__ import annotations

import itertools
import weakref
from typing import Sequence

import torch

from .._core import build as _build, context as _context
from .._core.log import logger

_warned = False


def empty(shape: int | Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Uninitialized tensor in this rank's shared-memory arena (plain memory if there is none)."""
    global _warned
    comm = _context.communicator("empty")
    sizes = [int(shape)] if isinstance(shape, int) else [int(s) for s in shape]
    if any(s < 0 for s in sizes):
        raise ValueError(f"torchring.empty: negative dimension in shape {sizes}")
    tensor = comm.empty_shared(sizes, dtype) if comm.has_shm else None
    if tensor is not None:
        return tensor
    if comm.has_shm and _context.arena_mb() > 0 and not _warned:
        _warned = True
        logger.warning("rank %d: torchring.empty: the shared-memory arena is full or /dev/shm has "
                       "no room left (TORCHRING_SHM_ARENA_MB), or this is a forked child process, "
                       "which cannot use its rank's arena; using regular memory, which costs one "
                       "copy per allreduce (said once per process)", _context.rank())
    return torch.empty(sizes, dtype=dtype)


# --------------------------------------------------------------- gradient memory pool
# Large CPU allocations made inside a wrapped model's backward (its fresh gradients) reuse
# memory kept between steps instead of faulting new pages in (csrc/memory/grad_pool.cpp).
_POOL_SLACK = 64 << 20
_reservations: dict[int, int] = {}  # token -> CPU gradient bytes of a live wrapped model
_tokens = itertools.count()


def _pool_setting() -> int | None:
    """TORCHRING_GRAD_POOL_MB in bytes: None for auto, 0 for off (checked by init())."""
    mb = _context.settings().grad_pool_mb
    return None if mb is None else int(mb * (1 << 20))


def _apply_pool_limit(setting: int | None) -> bool:
    if setting is None:  # auto: nothing is kept once no wrapped model is left
        limit = sum(_reservations.values()) + _POOL_SLACK if _reservations else 0
    else:
        limit = setting
    return bool(_build.load().grad_pool_install(limit))


def _release_pool(token: int) -> None:
    _reservations.pop(token, None)
    setting = _pool_setting()
    if setting is None and _build.load().grad_pool_stats()["installed"]:
        _apply_pool_limit(setting)


def reserve_grad_pool(owner: object, grad_bytes: int) -> bool:
    """Lets backward keep up to the live wrapped models' gradient bytes + 64 MiB between steps
    (until `owner` is collected); False when the pool is off."""
    setting = _pool_setting()
    if setting == 0:
        return False
    token = next(_tokens)
    _reservations[token] = grad_bytes
    weakref.finalize(owner, _release_pool, token).atexit = False
    return _apply_pool_limit(setting)


def grad_pool_begin() -> int:
    """Pools the large allocations of the autograd graph task this thread runs; its id or -1."""
    return int(_build.load().grad_pool_begin())


def grad_pool_end(task: int) -> None:
    """Stops pooling the allocations of graph task `task` (from grad_pool_begin)."""
    _build.load().grad_pool_end(task)


def grad_pool_stats() -> dict[str, int | bool]:
    """The gradient pool's counters: hits, misses, evicted, cached/live/limit bytes, active tasks."""
    return dict(_build.load().grad_pool_stats())
