"""The collectives API: checks the caller's input, then hands the work to the engine.

Every collective is queued on the process's communicator and runs in submission order;
every rank must submit the same collectives in the same order (the engine compares a
header of each and raises CollectiveMismatchError on every rank when they differ, after which
the next collective runs normally; docs/errors.md has every error). The blocking
forms run on the calling thread when nothing is queued; the ``_async`` forms return a
Handle at once and run on the communicator's progress thread.

CUDA tensors go the way torchring._gpu_path chose at init(): on the "nccl" path to the NCCL
communicator (its header compared by the CPU engine too), on the "staged" path through a
pinned host copy that the CPU engine reduces, copied back when waited for. Either way the
caller's input is checked once, and messages name the function the caller called.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable

import torch

from . import _context, _gpu_path
from ._types import DTYPES, FLOATS, Handle, OpKind, ReduceOp, describe, dtype_name

__all__ = [
    "ReduceOp", "Handle", "allreduce", "allreduce_async", "broadcast", "broadcast_async",
    "allgather", "allgather_async", "reduce_scatter", "reduce_scatter_async", "barrier",
    "barrier_async", "broadcast_object", "allgather_object",
]



def _check_tensor(t: Any, what: str) -> torch.Tensor:
    _context.communicator(what)  # raises before init()
    where = f"rank {_context.rank()}: torchring.{what}"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where} expects a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{where}: {t.layout} tensors are not supported; pass a dense tensor "
                        "(tensor.to_dense())")
    if t.dtype not in DTYPES:
        names = ", ".join(dtype_name(d) for d in DTYPES)
        raise TypeError(f"{where}: tensor {describe(t)} has a dtype torchring does not support; "
                        f"use one of {names}")
    if t.device.type == "cuda":
        _gpu_path.check(t, where)
    elif t.device.type != "cpu":
        raise ValueError(f"{where}: tensor {describe(t)} is on {t.device}; torchring handles "
                         "CPU and CUDA tensors")
    if not t.is_contiguous():
        raise ValueError(f"{where}: tensor {describe(t)} is not contiguous (strides "
                         f"{t.stride()}); pass tensor.contiguous() and use that tensor afterwards")
    return t


def _check_op(t: torch.Tensor, op: Any, what: str) -> ReduceOp:
    where = f"rank {_context.rank()}: torchring.{what}"
    if not isinstance(op, ReduceOp):
        raise TypeError(f"{where}: op must be a torchring.ReduceOp, got {op!r}")
    if t.dtype == torch.bool and op not in (ReduceOp.MIN, ReduceOp.MAX):
        raise TypeError(f"{where}: bool tensors support ReduceOp.MIN and MAX only, got {op.name}; "
                        "convert to an integer dtype to sum or multiply")
    if op == ReduceOp.AVG and t.dtype not in FLOATS:
        raise ValueError(f"{where}: ReduceOp.AVG needs a floating-point tensor, got {describe(t)}; "
                         "use SUM and divide, or convert to float")
    return op


def _check_src(src: Any, what: str) -> int:
    world = _context.size()
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < world:
        raise ValueError(f"rank {_context.rank()}: torchring.{what}: src must be a rank in "
                         f"[0, {world}), got {src!r}")
    return src


def _submit(kind: OpKind, t: torch.Tensor | None, op: int, root: int, inline: bool,
            what: str) -> Any:
    """Queues a CPU collective on the engine; returns its Work."""
    return _context.communicator(what).submit(int(kind), t, int(op), root, inline)


def _nccl(kind: OpKind, t: torch.Tensor, op: int, root: int, what: str) -> Handle:
    """Starts a collective of a CUDA tensor on the NCCL communicator. The CPU engine compares
    its header (kind, dtype, count, op, root, shape) across ranks on its own thread, in order
    with every other collective; NCCL's watchdog aborts on a mismatch."""
    comm, nccl = _context.communicator(what), _gpu_path.nccl_comm()
    rows: list[int] = []
    if kind == OpKind.ALLGATHER:  # NCCL needs every rank's row count up front
        mine = torch.tensor([t.shape[0]], dtype=torch.int64)
        rows = Handle(_submit(OpKind.ALLGATHER, mine, 0, -1, True, what)).wait().tolist()
    check = comm.submit_check(int(kind), t, int(op), root)
    if kind == OpKind.ALLREDUCE:
        work = nccl.allreduce(t, int(op), check)
    elif kind == OpKind.BROADCAST:
        work = nccl.broadcast(t, root, check)
    elif kind == OpKind.ALLGATHER:
        work = nccl.allgather(t, rows, check)
    else:
        work = nccl.reduce_scatter(t, int(op), check)
    return Handle(work)  # an NcclWork: a Work with its check's sequence number


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t)  # synchronous: the host copy is complete before the CPU engine reads it
    return host


def _staged(kind: OpKind, t: torch.Tensor, op: int, root: int, inline: bool, what: str) -> Handle:
    """Runs a collective of a CUDA tensor on the CPU engine through a pinned host copy."""
    host = _pinned_copy(t)
    back: Callable[[torch.Tensor], torch.Tensor]
    if kind in (OpKind.ALLREDUCE, OpKind.BROADCAST):
        back = t.copy_  # in place, like the CPU form
    else:
        back = lambda out: out.to(t.device)  # noqa: E731  a new tensor, like the CPU form
    return Handle(_submit(kind, host, op, root, inline, what), back)


def _run(kind: OpKind, t: torch.Tensor, op: int, root: int, inline: bool, what: str) -> Handle:
    """Starts a checked tensor's collective on the path for its device."""
    if not t.is_cuda:
        return Handle(_submit(kind, t, op, root, inline, what))
    if _gpu_path.path() == "nccl":
        return _nccl(kind, t, op, root, what)
    return _staged(kind, t, op, root, inline, what)


def _allreduce(tensor: torch.Tensor, op: ReduceOp, what: str, inline: bool) -> Handle:
    t = _check_tensor(tensor, what)
    op = _check_op(t, op, what)
    return _run(OpKind.ALLREDUCE, t, op, -1, inline, what)


def allreduce_async(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> Handle:
    """Starts an in-place allreduce of `tensor`; wait() returns `tensor`."""
    return _allreduce(tensor, op, "allreduce_async", False)


def allreduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
    """Reduces `tensor` across ranks in place and returns it."""
    return _allreduce(tensor, op, "allreduce", True).wait()


def _broadcast(tensor: torch.Tensor, src: int, what: str, inline: bool) -> Handle:
    t = _check_tensor(tensor, what)
    src = _check_src(src, what)
    return _run(OpKind.BROADCAST, t, 0, src, inline, what)


def broadcast_async(tensor: torch.Tensor, src: int = 0) -> Handle:
    """Starts copying rank `src`'s `tensor` into every rank's `tensor`."""
    return _broadcast(tensor, src, "broadcast_async", False)


def broadcast(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Copies rank `src`'s `tensor` into every rank's `tensor` and returns it."""
    return _broadcast(tensor, src, "broadcast", True).wait()


def _allgather(tensor: torch.Tensor, what: str, inline: bool) -> Handle:
    t = _check_tensor(tensor, what)
    t = t.reshape(1) if t.dim() == 0 else t  # a scalar is one row
    return _run(OpKind.ALLGATHER, t, 0, -1, inline, what)


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
        raise ValueError(f"rank {me}: torchring.{what}: dim 0 of tensor {describe(t)} must be "
                         f"divisible by the world size {world}; pad it to a multiple of {world}")
    return _run(OpKind.REDUCE_SCATTER, t, op, -1, inline, what)


def reduce_scatter_async(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> Handle:
    """Starts a reduce_scatter (keep `tensor` unchanged until wait()); wait() returns this rank's rows."""
    return _reduce_scatter(tensor, op, "reduce_scatter_async", False)


def reduce_scatter(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
    """Reduces `tensor` across ranks and returns rows [rank*m, (rank+1)*m), m = dim0/size()."""
    return _reduce_scatter(tensor, op, "reduce_scatter", True).wait()


def barrier_async() -> Handle:
    """Starts a barrier; wait() returns once every rank has reached it."""
    return Handle(_submit(OpKind.BARRIER, None, 0, -1, False, "barrier_async"))


def barrier() -> None:
    """Returns once every rank has called barrier()."""
    Handle(_submit(OpKind.BARRIER, None, 0, -1, True, "barrier")).wait()


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
