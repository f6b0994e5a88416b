"""A rank-aware sampler that matches torch's DistributedSampler index for index.

Training mode (the default) gives every rank the same number of samples: the index list
(a permutation of range(N) drawn from seed + epoch when shuffling) is padded by repeating
its head, or cut at the tail with drop_last, to a multiple of the world size R, and rank r
takes indices[r::R]. That is exactly what torch.utils.data.distributed.DistributedSampler
yields, so runs are comparable sample for sample.

Exact mode (``exact=True``, for evaluation) pads nothing: every sample goes to exactly one
rank, and ranks may get different counts (they differ by at most one). A loop that runs a
collective per batch would then hang or fail on the ranks with one batch more; gather the
results after the loop instead (torchring.data.gather_ordered, all_reduce_metrics).

Iterating the sampler again advances the epoch by itself (so forgetting set_epoch() no
longer repeats the same order every epoch); set_epoch() still works and wins;
``auto_epoch=False`` turns the automatic advance off.
"""

from __future__ import annotations

import math
from typing import Iterator, Sized

import torch
from torch.utils.data import Sampler

from .._core import context as _context

__all__ = ["DistributedSampler"]


def replicas_and_rank(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """(num_replicas, rank): the given values, checked; a missing one from torchring.init()."""
    if num_replicas is None or rank is None:
        if not _context.is_initialized():
            raise RuntimeError("torchring.data.DistributedSampler needs the rank and world size: call "
                               "torchring.init() first, or pass num_replicas= and rank=")
        num_replicas = _context.size() if num_replicas is None else num_replicas
        rank = _context.rank() if rank is None else rank
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
    return num_replicas, rank


class DistributedSampler(Sampler[int]):
    """Yields this rank's share of dataset indices; see the module docstring."""

    def __init__(self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 auto_epoch: bool = True, exact: bool = False) -> None:
        self.num_replicas, self.rank = replicas_and_rank(num_replicas, rank)
        self.dataset = dataset
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.auto_epoch, self.exact = auto_epoch, exact
        self.epoch = 0
        self._iterated = False   # an iteration started since the epoch was last chosen
        n, r = len(dataset), self.num_replicas
        if exact and drop_last:
            raise ValueError("exact=True gives every sample to exactly one rank; drop_last=True "
                             "would drop samples: use one or the other")
        if n == 0:
            raise ValueError(f"rank {self.rank}: the dataset is empty; every rank needs data")
        if exact:
            self.num_samples = len(range(self.rank, n, r))
        elif drop_last and n % r != 0:
            self.num_samples = math.ceil((n - r) / r)
        else:
            self.num_samples = math.ceil(n / r)
        if self.num_samples == 0 and not exact:
            raise ValueError(f"rank {self.rank}: {n} samples with drop_last=True over {r} ranks leaves "
                             f"every rank with 0 samples; use drop_last=False or fewer ranks")
        self.total_size = self.num_samples * r

    def indices(self) -> list[int]:
        """This rank's indices for the current epoch (no side effects)."""
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        if self.exact:
            return order[self.rank::self.num_replicas]
        if not self.drop_last:
            padding = self.total_size - len(order)
            if padding <= len(order):
                order += order[:padding]
            else:
                order += (order * math.ceil(padding / len(order)))[:padding]
        else:
            order = order[:self.total_size]
        return order[self.rank:self.total_size:self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        # A generator: the epoch advances when iteration really starts (the first next()), so
        # an iterator made and dropped unused (DataLoader does that) does not skip an epoch.
        if self._iterated and self.auto_epoch:
            self.epoch += 1
        self._iterated = True
        yield from self.indices()

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Uses `epoch` for the next iteration (the automatic advance then skips one step)."""
        self.epoch = epoch
        self._iterated = False
