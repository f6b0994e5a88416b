"""Memory torchring manages: shared-memory tensors that the shared-memory transport reads
without a copy, and the pool that backward's gradients are allocated from."""

from __future__ import annotations

import os
import warnings
from typing import Sequence

import torch

from . import _build, _context

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
        warnings.warn("torchring.empty: the shared-memory arena is full or /dev/shm has no room "
                      "left (TORCHRING_SHM_ARENA_MB); using regular memory, which costs one copy "
                      "per allreduce", RuntimeWarning, stacklevel=2)
    return torch.empty(sizes, dtype=dtype)


# --------------------------------------------------------------- gradient memory pool
# Large CPU allocations made inside a wrapped model's backward (its fresh gradients) reuse
# memory kept between steps instead of faulting new pages in (csrc/grad_pool.cpp).
_POOL_SLACK = 64 << 20
_pool_reserved = 0


def reserve_grad_pool(grad_bytes: int) -> bool:
    """Lets backward reuse up to grad_bytes (+64 MiB) between steps; False when the pool is off."""
    global _pool_reserved
    setting = os.environ.get("TORCHRING_GRAD_POOL_MB", "auto").strip().lower()
    if setting in ("0", "off"):
        return False
    if setting == "auto":
        _pool_reserved += grad_bytes
        limit = _pool_reserved + _POOL_SLACK
    else:
        try:
            limit = int(float(setting) * (1 << 20))
        except ValueError:
            raise ValueError(f"TORCHRING_GRAD_POOL_MB={setting!r}: expected 'auto', 0 (off) or a "
                             "number of MiB") from None
    return bool(_build.load().grad_pool_install(limit))


def grad_pool_active(active: bool) -> None:
    """Routes this thread's large CPU allocations through the gradient pool (or stops)."""
    _build.load().grad_pool_set_active(active)


def grad_pool_stats() -> dict[str, int | bool]:
    """The gradient pool's counters: hits, misses, cached/live/limit bytes, active (this thread)."""
    return dict(_build.load().grad_pool_stats())
