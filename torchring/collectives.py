"""The collectives API: checks the caller's input, then hands the work to the engine.

Every collective is queued on the process's communicator and runs in submission order;
every rank must submit the same collectives in the same order (the engine compares a
header of each and raises TorchringError on every rank when they differ). The blocking
forms run on the calling thread when nothing is queued; the ``_async`` forms return a
Handle at once and run on the communicator's progress thread.
"""

from __future__ import annotations

import enum
import pickle
from typing import Any, Callable

import torch

from . import _context, cuda

__all__ = [
    "ReduceOp", "Handle", "allreduce", "allreduce_async", "broadcast", "broadcast_async",
    "allgather", "allgather_async", "reduce_scatter", "reduce_scatter_async", "barrier",
    "barrier_async", "broadcast_object", "allgather_object",
]


class ReduceOp(enum.IntEnum):
    """How allreduce and reduce_scatter combine the ranks' values."""

    SUM = 0
    AVG = 1
    MIN = 2
    MAX = 3
    PRODUCT = 4


class _Kind(enum.IntEnum):
    ALLREDUCE = 0
    BROADCAST = 1
    ALLGATHER = 2
    REDUCE_SCATTER = 3
    BARRIER = 4


_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
           torch.uint8, torch.int32, torch.int64, torch.bool)
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class Handle:
    """An operation in flight: ``wait()`` returns its result or raises its failure."""

    def __init__(self, work: Any, finish: Callable[[torch.Tensor], Any] | None = None) -> None:
        self._work = work
        self._finish = finish
        self._done = False
        self._result: Any = None

    def wait(self, timeout: float | None = None) -> Any:
        """Blocks until the operation is done (the GIL is released) and returns its result."""
        if not self._done:
            out = self._work.wait(0.0 if timeout is None else float(timeout))
            self._result = self._finish(out) if self._finish else out
            self._done = True
        return self._result

    def synchronize(self, timeout: float | None = None) -> Any:
        """Like wait(), but for CUDA work also blocks the host until the GPU finished it."""
        if hasattr(self._work, "synchronize"):
            self._work.synchronize(0.0 if timeout is None else float(timeout))
        return self.wait(timeout)

    def is_completed(self) -> bool:
        """True once the operation finished, successfully or not (wait() tells which)."""
        return self._done or self._work.is_completed()

    def __repr__(self) -> str:
        state = "completed" if self.is_completed() else "pending"
        return f"<torchring.Handle #{self._work.seq} {state}>"


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


def _check_tensor(t: Any, what: str) -> torch.Tensor:
    comm = _context.communicator(what)
    del comm
    where = f"rank {_context.rank()}: torchring.{what}"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where} expects a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{where}: {t.layout} tensors are not supported; pass a dense tensor "
                        "(tensor.to_dense())")
    if t.dtype not in _DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in _DTYPES)
        raise TypeError(f"{where}: dtype {t.dtype} of tensor {list(t.shape)} is not supported; "
                        f"use one of {names}")
    if t.device.type == "cuda":
        cuda.check(t, where)
    elif t.device.type != "cpu":
        raise ValueError(f"{where}: tensor {_describe(t)} is on {t.device}; torchring handles "
                         "CPU and CUDA tensors")
    if not t.is_contiguous():
        raise ValueError(f"{where}: tensor {_describe(t)} is not contiguous (strides "
                         f"{t.stride()}); pass tensor.contiguous() and use that tensor afterwards")
    return t


def _check_op(t: torch.Tensor, op: Any, what: str) -> ReduceOp:
    where = f"rank {_context.rank()}: torchring.{what}"
    if not isinstance(op, ReduceOp):
        raise TypeError(f"{where}: op must be a torchring.ReduceOp, got {op!r}")
    if t.dtype == torch.bool and op not in (ReduceOp.MIN, ReduceOp.MAX):
        raise TypeError(f"{where}: bool tensors support ReduceOp.MIN and MAX only, got {op.name}; "
                        "convert to an integer dtype to sum or multiply")
    if op == ReduceOp.AVG and t.dtype not in _FLOATS:
        raise ValueError(f"{where}: ReduceOp.AVG needs a floating-point tensor, got {_describe(t)}; "
                         "use SUM and divide, or convert to float")
    return op


def _check_src(src: Any, what: str) -> int:
    world = _context.size()
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < world:
        raise ValueError(f"rank {_context.rank()}: torchring.{what}: src must be a rank in "
                         f"[0, {world}), got {src!r}")
    return src


def _submit(kind: _Kind, t: torch.Tensor | None, op: int, root: int, inline: bool) -> Any:
    return _context.communicator(kind.name.lower()).submit(int(kind), t, int(op), root, inline)


def _allreduce(tensor: torch.Tensor, op: ReduceOp, what: str, inline: bool) -> Handle:
    t = _check_tensor(tensor, what)
    op = _check_op(t, op, what)
    if t.is_cuda:
        return cuda.allreduce(t, op)
    return Handle(_submit(_Kind.ALLREDUCE, t, op, -1, inline))


def allreduce_async(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> Handle:
    """Starts an in-place allreduce of `tensor`; wait() returns `tensor`."""
    return _allreduce(tensor, op, "allreduce_async", False)


def allreduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
    """Reduces `tensor` across ranks in place and returns it."""
    return _allreduce(tensor, op, "allreduce", True).wait()


def _broadcast(tensor: torch.Tensor, src: int, what: str, inline: bool) -> Handle:
    t = _check_tensor(tensor, what)
    src = _check_src(src, what)
    if t.is_cuda:
        return cuda.broadcast(t, src)
    return Handle(_submit(_Kind.BROADCAST, t, 0, src, inline))


def broadcast_async(tensor: torch.Tensor, src: int = 0) -> Handle:
    """Starts copying rank `src`'s `tensor` into every rank's `tensor`."""
    return _broadcast(tensor, src, "broadcast_async", False)


def broadcast(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Copies rank `src`'s `tensor` into every rank's `tensor` and returns it."""
    return _broadcast(tensor, src, "broadcast", True).wait()


def _allgather(tensor: torch.Tensor, what: str, inline: bool) -> Handle:
    t = _check_tensor(tensor, what)
    t = t.reshape(1) if t.dim() == 0 else t  # a scalar is one row
    if t.is_cuda:
        return cuda.allgather(t)
    return Handle(_submit(_Kind.ALLGATHER, t, 0, -1, inline))


def allgather_async(tensor: torch.Tensor) -> Handle:
    """Starts an allgather; wait() returns every rank's tensor concatenated along dim 0."""
    return _allgather(tensor, "allgather_async", False)


def allgather(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenates every rank's `tensor` along dim 0 (its size may differ per rank)."""
    return _allgather(tensor, "allgather", True).wait()


def _reduce_scatter(tensor: torch.Tensor, op: ReduceOp, what: str, inline: bool) -> Handle:
    t = _check_tensor(tensor, what)
    op = _check_op(t, op, what)
    world, me = _context.size(), _context.rank()
    if t.dim() == 0 or t.shape[0] % world != 0:
        raise ValueError(f"rank {me}: torchring.{what}: dim 0 of tensor {_describe(t)} must be "
                         f"divisible by the world size {world}; pad it to a multiple of {world}")
    if t.is_cuda:
        return cuda.reduce_scatter(t, op)
    return Handle(_submit(_Kind.REDUCE_SCATTER, t, op, -1, inline))


def reduce_scatter_async(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> Handle:
    """Starts a reduce_scatter (keep `tensor` unchanged until wait()); wait() returns this rank's rows."""
    return _reduce_scatter(tensor, op, "reduce_scatter_async", False)


def reduce_scatter(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
    """Reduces `tensor` across ranks and returns rows [rank*m, (rank+1)*m), m = dim0/size()."""
    return _reduce_scatter(tensor, op, "reduce_scatter", True).wait()


def barrier_async() -> Handle:
    """Starts a barrier; wait() returns once every rank has reached it."""
    return Handle(_submit(_Kind.BARRIER, None, 0, -1, False))


def barrier() -> None:
    """Returns once every rank has called barrier()."""
    Handle(_submit(_Kind.BARRIER, None, 0, -1, True)).wait()


def _to_bytes_tensor(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Returns rank `src`'s picklable `obj` on every rank."""
    src = _check_src(src, "broadcast_object")
    mine = _context.rank() == src
    payload = _to_bytes_tensor(obj) if mine else None
    length = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64)
    broadcast(length, src)
    buffer = payload if payload is not None else torch.empty(int(length.item()), dtype=torch.uint8)
    broadcast(buffer, src)
    return obj if mine else pickle.loads(buffer.numpy().tobytes())


def allgather_object(obj: Any) -> list[Any]:
    """Returns the list of every rank's picklable `obj`, indexed by rank."""
    payload = _to_bytes_tensor(obj)
    lengths = allgather(torch.tensor([payload.numel()], dtype=torch.int64)).tolist()
    data = allgather(payload).numpy().tobytes()
    out, start = [], 0
    for n in lengths:
        out.append(pickle.loads(data[start:start + n]))
        start += n
    return out
