"""``hvd.SyncBatchNorm``: Horovod's synchronized batch norm, on torchring.SyncBatchNorm.

Horovod's constructor (no group argument: statistics span the global process set). What differs
from ``horovod.torch.SyncBatchNorm``: CPU tensors work too (Horovod's needs CUDA), and the
statistics travel as direct collectives on the global set's group rather than as named
negotiated allgathers, so they never wait on the negotiation cycle. As in Horovod, a layer built
with ``track_running_stats=False`` also synchronizes its batch statistics in eval mode.
"""

from __future__ import annotations

from .._core import context as _context
from ..collectives.groups import Group
from .._wrap.sync_batch_norm import SyncBatchNorm as _TorchringSyncBatchNorm
from .process_sets import global_process_set

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_TorchringSyncBatchNorm):
    """BatchNorm over the batches of every rank of Horovod's global process set."""

    _sync_in_eval = True

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _resolve_group(self) -> Group:
        group = global_process_set.group
        if group is None:
            raise ValueError(f"rank {_context.rank()}: hvd.SyncBatchNorm: Horovod has not been "
                             "initialized; call hvd.init() before the first training forward")
        return group
