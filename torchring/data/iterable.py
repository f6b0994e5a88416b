"""Sharding an IterableDataset across ranks and DataLoader workers.

Stream item i goes to the one (rank, worker) pair with i % (R*W) == rank*W + worker, so
every item is read by exactly one worker of one rank. With ``even=True`` and a dataset
that has __len__, each pair stops after floor(N / (R*W)) items, so every rank gets the
same number of items (the last N mod R*W are dropped); without __len__ ranks can differ
by one item per worker, which a loop running a collective per batch must allow for.
"""

from __future__ import annotations

from typing import Any, Iterator

from torch.utils.data import IterableDataset, get_worker_info

from .sampler import _world


class ShardedIterableDataset(IterableDataset):
    """Yields the share of `dataset`'s stream that belongs to this rank and worker."""

    def __init__(self, dataset: IterableDataset, num_replicas: int | None = None,
                 rank: int | None = None, even: bool = True) -> None:
        self.dataset = dataset
        self.num_replicas, self.rank = _world(num_replicas, rank)
        self.even = even
        self.workers_hint = 1  # set by torchring.data.DataLoader; only __len__ uses it

    def _shard(self) -> tuple[int, int]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        return self.num_replicas * workers, self.rank * workers + worker

    def __iter__(self) -> Iterator[Any]:
        shards, shard = self._shard()
        limit = None
        if self.even and hasattr(self.dataset, "__len__"):
            limit = len(self.dataset) // shards  # type: ignore[arg-type]
        taken = 0
        for i, item in enumerate(self.dataset):
            if limit is not None and taken >= limit:
                return
            if i % shards == shard:
                taken += 1
                yield item

    def __len__(self) -> int:
        if not hasattr(self.dataset, "__len__"):
            raise TypeError("the wrapped IterableDataset has no __len__")
        n = len(self.dataset)  # type: ignore[arg-type]
        shards = self.num_replicas * self.workers_hint
        if self.even:
            return (n // shards) * self.workers_hint
        return sum(len(range(self.rank * self.workers_hint + w, n, shards)) for w in range(self.workers_hint))
