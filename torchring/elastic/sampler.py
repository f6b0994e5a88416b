"""ElasticSampler: a distributed sampler that remembers what this epoch has already trained on.

    sampler = torchring.elastic.ElasticSampler(dataset, shuffle=True, seed=0)   # or hvd.elastic's
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    state = torchring.elastic.State(model=model, optimizer=optimizer, sampler=sampler)
    for batch_idx, batch in enumerate(loader):
        ...
        sampler.record_batch(batch_idx, 32)       # or record_indices(the batch's dataset indices)
        if batch_idx % 10 == 0:
            state.commit()
    sampler.set_epoch(epoch + 1)                   # at the END of the epoch

The epoch's order is one seeded shuffle of the whole dataset, the same on every rank. What has
been processed (a count of samples from the front of that order, plus any indices recorded one
by one) is left out when the sampler is reset: after a restore, a sync or a restart with another
world size, the rest of the epoch is split anew over the ranks, padded by repeating indices so
that every rank gets the same number of samples.
"""

from __future__ import annotations

import math
import random
from typing import Any, Iterable, Iterator, Sized

import torch.utils.data

from .._core import context as _context

__all__ = ["ElasticSampler"]


class ElasticSampler(torch.utils.data.Sampler):
    """Splits a dataset over the ranks and re-splits the unprocessed rest after a reset."""

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0  # samples of this epoch's order done, by all ranks together
        self.processed_indices: set[int] = set()  # dataset indices recorded by record_indices
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Starts epoch `epoch` (its own shuffle) with nothing processed; call it at the end of an epoch."""
        self.epoch = epoch
        self.processed_num = 0
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Records that every rank has processed one more batch of `batch_size` samples."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices: Iterable[int]) -> None:
        """Records dataset `indices` as processed by this rank (merged over the ranks at sync)."""
        self.processed_indices.update(int(i) for i in indices)

    def state_dict(self) -> dict[str, Any]:
        """The epoch and what has been processed in it."""
        return dict(epoch=self.epoch, processed_num=self.processed_num,
                    processed_indices=sorted(self.processed_indices))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Takes a state_dict() (also Horovod's, without processed_indices) and resets."""
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.processed_indices = set(state_dict.get("processed_indices", ()))
        self.reset()

    def reset(self) -> None:
        """Splits what is left of the epoch over the current world."""
        self.num_replicas, self.rank = _place()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        done = self.processed_indices
        self.remaining_indices = [i for i in order[self.processed_num:] if i not in done]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        padded = list(self.remaining_indices)
        while padded and len(padded) < self.total_size:  # repeat from the front to even out
            padded += padded[:self.total_size - len(padded)]
        self.indices = padded[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


def _place() -> tuple[int, int]:
    """(world size, rank): torchring's world, else torch.distributed's default group (a job on
    init_process_group alone)."""
    import torch.distributed as dist  # here: torch.distributed is asked only without torchring's world

    if not _context.is_initialized() and dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return _context.size(), _context.rank()
