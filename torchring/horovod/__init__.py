"""Horovod's PyTorch API on torchring's engine: change one line of a Horovod script.

    import torchring.horovod as hvd          # was: import horovod.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

Launch with ``torchring-run -np 4 python train.py`` (horovodrun's common flags work) or torchrun.
Every name of ``horovod.torch`` is here with Horovod's positional order and defaults; what differs
is listed in the README ("Coming from Horovod").
"""

from . import elastic
from .basics import (Adasum, Average, HorovodInternalError, Max, Min, Product, Sum, ccl_built,
                     cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled,
                     is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                     mpi_threads_supported, nccl_built, rank, rocm_built, size)
from .compression import Compression, Compressor
from .optimizer import DistributedOptimizer
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)
from .ops_gather import (allgather, allgather_async, alltoall, alltoall_async, broadcast,
                         broadcast_, broadcast_async, broadcast_async_, grouped_allgather,
                         grouped_allgather_async, grouped_reducescatter,
                         grouped_reducescatter_async, reducescatter, reducescatter_async,
                         sparse_allreduce_async)
from .ops_reduce import (allreduce, allreduce_, allreduce_async, allreduce_async_, barrier,
                         grouped_allreduce, grouped_allreduce_, grouped_allreduce_async,
                         grouped_allreduce_async_, join, poll, synchronize)
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .runtime import init, shutdown, start_timeline, stop_timeline
from .sync_batch_norm import SyncBatchNorm

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size",
    "cross_rank", "mpi_built", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
    "rocm_built", "mpi_enabled", "gloo_enabled", "mpi_threads_supported", "start_timeline",
    "stop_timeline", "HorovodInternalError", "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "sparse_allreduce_async", "allgather", "allgather_async", "grouped_allgather",
    "grouped_allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "barrier", "join", "poll", "synchronize", "ProcessSet",
    "global_process_set", "add_process_set", "remove_process_set", "Compression", "Compressor",
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object",
    "SyncBatchNorm", "elastic", "DistributedOptimizer",
]
