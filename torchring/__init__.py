"""torchring: data-parallel training for PyTorch on a ring-allreduce engine.

    import torchring
    torchring.init()
    torchring.allreduce(tensor)            # in place, SUM by default
    group = torchring.new_group([0, 1])    # every rank calls it; group.allreduce(tensor) ...
"""

# torchring.cuda.path(), reason(), device(); torchring.memory.empty(), grad_pool_stats()
from . import c10d, cuda, memory
from ._core.context import init, is_initialized, local_rank, local_size, rank, shutdown, size, transport
from ._core.errors import CollectiveMismatchError, CommunicatorFailedError, TorchringError, WaitTimeoutError
from .collectives.algorithms import algorithm, link_cost
from .collectives.basic import (Handle, ReduceOp, allgather, allgather_async, allgather_object, allreduce,
                                allreduce_async, barrier, barrier_async, broadcast, broadcast_async,
                                broadcast_object, reduce_scatter, reduce_scatter_async)
from .collectives.exchange import all_to_all_single, all_to_all_single_async, alltoall, alltoall_async
from .collectives.groups import Group, new_group, world_group
from .collectives.p2p import irecv, isend, recv, send
from .collectives.stats import stats, stragglers
from .collectives.rooted import (allgather_into, allgather_into_async, allreduce_many, allreduce_many_async,
                                 gather, gather_async, reduce, reduce_async, reduce_scatter_into,
                                 reduce_scatter_into_async, scatter, scatter_async)
from ._wrap.memory import empty
from ._wrap.model import DistributedModel, wrap
from ._wrap.sync_batch_norm import SyncBatchNorm
from .trace import dump_trace

c10d.register()  # dist.init_process_group("torchring") from here on (nothing is built yet)

__version__ = "0.1.0"

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "transport", "dump_trace", "stats", "stragglers", "TorchringError", "CommunicatorFailedError",
    "CollectiveMismatchError", "WaitTimeoutError", "ReduceOp", "Handle", "allreduce", "allreduce_async",
    "broadcast", "broadcast_async", "allgather", "allgather_async", "reduce_scatter",
    "reduce_scatter_async", "barrier", "barrier_async", "broadcast_object",
    "allgather_object", "empty", "wrap", "DistributedModel",
    "Group", "new_group", "world_group",
    "send", "recv", "isend", "irecv",
    "reduce", "reduce_async", "gather", "gather_async", "scatter", "scatter_async",
    "allgather_into", "allgather_into_async", "reduce_scatter_into", "reduce_scatter_into_async",
    "allreduce_many", "allreduce_many_async",
    "alltoall", "alltoall_async", "all_to_all_single", "all_to_all_single_async",
    "SyncBatchNorm", "algorithm", "link_cost",
]
