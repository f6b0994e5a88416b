"""Sharding an IterableDataset across ranks and DataLoader workers.

Stream item i belongs to rank i % R; within a rank's share, its k-th item goes to worker
k % W. So what a rank reads does not depend on how many loader workers it (or any other
rank) runs, and every item is read exactly once. With ``even=True`` and a dataset that has
__len__, each rank stops after floor(N / R) items, so every rank gets the same number (the
last N mod R are dropped); without __len__ ranks can differ by one item, which a loop
running a collective per batch must allow for.
"""

from __future__ import annotations

from typing import Any, Iterator

from torch.utils.data import IterableDataset, get_worker_info

from .sampler import replicas_and_rank

__all__ = ["ShardedIterableDataset"]


class ShardedIterableDataset(IterableDataset):
    """Yields the share of `dataset`'s stream that belongs to this rank and worker."""

    def __init__(self, dataset: IterableDataset, num_replicas: int | None = None,
                 rank: int | None = None, even: bool = True) -> None:
        self.dataset = dataset
        self.num_replicas, self.rank = replicas_and_rank(num_replicas, rank)
        self.even = even

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        limit = None
        if self.even and hasattr(self.dataset, "__len__"):
            limit = len(self.dataset) // self.num_replicas  # type: ignore[arg-type]
        mine = 0  # items of this rank's share seen so far
        for i, item in enumerate(self.dataset):
            if i % self.num_replicas != self.rank:
                continue
            if limit is not None and mine >= limit:
                return
            if mine % workers == worker:
                yield item
            mine += 1

    def __len__(self) -> int:
        if not hasattr(self.dataset, "__len__"):
            raise TypeError("the wrapped IterableDataset has no __len__")
        n = len(self.dataset)  # type: ignore[arg-type]
        return n // self.num_replicas if self.even else len(range(self.rank, n, self.num_replicas))
