"""Tensors in shared memory that the shared-memory transport reads without a copy."""

from __future__ import annotations

import warnings
from typing import Sequence

import torch

from . import _context

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
