"""torchring.data: rank-aware sampling and loaders that keep accelerators fed."""

from .evaluation import all_reduce_metrics, gather_ordered
from .iterable import ShardedIterableDataset
from .loader import DataLoader, default_num_workers
from .prefetch import DevicePrefetcher
from .sampler import DistributedSampler

__all__ = ["DistributedSampler", "DataLoader", "ShardedIterableDataset", "DevicePrefetcher",
           "gather_ordered", "all_reduce_metrics", "default_num_workers"]
