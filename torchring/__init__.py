"""torchring: data-parallel training for PyTorch on a ring-allreduce engine.

    import torchring
    torchring.init()
    torchring.allreduce(tensor)            # in place, SUM by default
"""

from . import cuda  # torchring.cuda.path(), reason(), device()
from ._context import (init, is_initialized, local_rank, local_size, rank, shutdown, size,
                       transport)
from ._errors import (CollectiveMismatchError, CommunicatorFailedError, TorchringError,
                      WaitTimeoutError)
from .collectives import (Handle, ReduceOp, allgather, allgather_async, allgather_object,
                          allreduce, allreduce_async, barrier, barrier_async, broadcast,
                          broadcast_async, broadcast_object, reduce_scatter,
                          reduce_scatter_async)
from .memory import empty
from .model import DistributedModel, wrap

__version__ = "0.1.0"

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "transport", "TorchringError", "CommunicatorFailedError",
    "CollectiveMismatchError", "WaitTimeoutError", "ReduceOp", "Handle", "allreduce", "allreduce_async",
    "broadcast", "broadcast_async", "allgather", "allgather_async", "reduce_scatter",
    "reduce_scatter_async", "barrier", "barrier_async", "broadcast_object",
    "allgather_object", "empty", "wrap", "DistributedModel",
]
