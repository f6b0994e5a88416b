"""torchring.data.DataLoader: torch's DataLoader with distributed sampling and defaults
that keep an accelerator fed. Every default can be overridden by passing the argument.

Defaults: a DistributedSampler (IterableDatasets are sharded by rank and worker instead);
num_workers = the CPUs available to this process divided by the ranks on this host (at
most 8, at least 1); persistent_workers and prefetch_factor=2 when there are workers;
pin_memory when CUDA is available; and a generator seeded from (seed, rank), so worker
seeds (torch, random, numpy) differ between ranks and workers yet repeat run to run.

The loader counts where the epoch stands for the rank's status (torchring/trace/progress.py);
its batches, their samples and how long the training loop waited for each are counted as every
torch DataLoader's are (torchring/trace/data_wait.py, unless TORCHRING_DATA_WAIT=0), so that a
straggler report tells a rank whose data loading is slow from one whose compute is.
"""

from __future__ import annotations

from typing import Any

import os
from collections.abc import Iterator

import torch
from torch.utils.data import Dataset, IterableDataset

from .._core import context as _context, env as _env
from .._core.settings import Settings
from ..trace import data_wait as _data_wait, progress as _progress
from .iterable import ShardedIterableDataset
from .sampler import DistributedSampler

__all__ = ["DataLoader", "default_num_workers"]

_UNSET: Any = object()


def default_num_workers() -> int:
    """Worker processes per rank: this host's CPUs shared by its ranks, between 1 and 8."""
    local = _context.local_size() if _context.is_initialized() else 1
    return max(1, min(8, _env.available_cpus() // max(1, local)))


def _rank() -> int:
    return _context.rank() if _context.is_initialized() else 0


def DataLoader(dataset: Dataset, batch_size: int = 1, shuffle: bool = True, *,
               seed: int = 0, drop_last: bool = False, sampler: Any = None,
               num_workers: int | None = None, pin_memory: bool | None = None,
               persistent_workers: bool | None = None, prefetch_factor: int | None = _UNSET,
               generator: torch.Generator | None = None, exact: bool = False,
               **kwargs: Any) -> torch.utils.data.DataLoader:
    """A torch DataLoader over this rank's share of `dataset`, with fast defaults."""
    if batch_size is None or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    iterable = isinstance(dataset, IterableDataset)
    if iterable:
        if sampler is not None:
            raise ValueError("an IterableDataset takes no sampler; it is sharded by rank and worker")
        if not isinstance(dataset, ShardedIterableDataset):
            dataset = ShardedIterableDataset(dataset)
    elif sampler is None:
        sampler = DistributedSampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last,
                                     exact=exact)
    if sampler is not None and hasattr(sampler, "__len__"):
        per_rank = len(sampler)
        if drop_last and per_rank < batch_size:
            raise ValueError(
                f"rank {_rank()}: batch_size={batch_size} with drop_last=True gives this rank 0 batches "
                f"(it holds {per_rank} samples of {len(dataset)}); lower batch_size or use drop_last=False")
    workers = default_num_workers() if num_workers is None else num_workers
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    if persistent_workers is None:
        persistent_workers = workers > 0
    if prefetch_factor is _UNSET:
        prefetch_factor = 2 if workers > 0 else None
    if generator is None:
        generator = torch.Generator()
        generator.manual_seed((seed * 1_000_003 + _rank()) % (2**63))
    return CountingDataLoader(
        dataset, batch_size=batch_size, shuffle=False, sampler=sampler, drop_last=drop_last,
        num_workers=workers, pin_memory=pin_memory, persistent_workers=persistent_workers,
        prefetch_factor=prefetch_factor, generator=generator, **kwargs)


class CountingDataLoader(torch.utils.data.DataLoader):
    """torch's DataLoader that notes each epoch it starts in the rank's progress."""

    def __iter__(self) -> Iterator[Any]:
        if not _data_wait.installed() and Settings.from_env(os.environ).data_wait:
            _data_wait.install()  # its batches are timed as every torch DataLoader's
        batches = super().__iter__()
        try:
            length = len(self)
        except TypeError:  # an IterableDataset without a length
            length = 0
        _progress.epoch_started(length)
        return batches
