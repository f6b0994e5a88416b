"""The collectives API: checks the caller's input, then hands the work to the engine.

Every collective is queued on its group's communicator (the world's for ``group=None``) and
runs in submission order; every rank of the group must submit the same collectives in the same
order (the engine compares a header of each and raises CollectiveMismatchError on every rank
when they differ, after which the next collective runs normally; docs/errors.md has every
error). Ranks given to a collective (``src``, ``dst``) are ranks of its group. The blocking
forms run on the calling thread when nothing is queued; the ``_async`` forms return a Handle at
once and run on the communicator's progress thread.

CUDA tensors go the way torchring._core.gpu_path chose at init(): on the "nccl" path allreduce,
broadcast, allgather and reduce_scatter of the world group go to the NCCL communicator (its
header compared by the CPU engine too); everything else (the other collectives, any collective
of a group made by new_group(), scaling factors, uneven reduce_scatter rows) and the "staged"
path go through a pinned host copy that the CPU engine reduces, copied back when waited for.
Either way the caller's input is checked once, and messages name the function the caller called.
allreduce of a sparse COO tensor is three allgathers (sparse.py).

This module also holds the dispatch that rooted, alltoall and p2p share; the checks they all
share are in _checks.py.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable

import torch

from .._core import context as _context, gpu_path as _gpu_path
from .._core.group_wiring import GroupBase, Target, target
from .._core.types import Handle, OpKind, ReduceOp, _profiler_on, profiled
from . import _checks, sparse

__all__ = [
    "ReduceOp", "Handle", "allreduce", "allreduce_async", "broadcast", "broadcast_async",
    "allgather", "allgather_async", "reduce_scatter", "reduce_scatter_async", "barrier",
    "barrier_async", "broadcast_object", "allgather_object",
]

def rows_of(rows: int, size: int, rank: int) -> tuple[int, int]:
    """(first row, number of rows) of `rank`'s share of `rows` split over `size` ranks: the
    first rows % size ranks get one row more (reduce_scatter)."""
    base, extra = divmod(rows, size)
    return rank * base + min(rank, extra), base + (rank < extra)


def _submit(kind: OpKind, t: torch.Tensor | None, op: int, root: int, inline: bool,
            what: str, tg: Target | None = None, **kw: Any) -> Any:
    """Queues a CPU collective on the engine (the world's without `tg`); returns its Work."""
    comm = tg.comm if tg is not None else _context.communicator(what)
    return comm.submit(int(kind), t, int(op), root, inline, **kw)


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


def _host(t: torch.Tensor) -> torch.Tensor:
    """`t` as the CPU engine takes it: itself on the CPU, a pinned copy of a CUDA tensor."""
    return _pinned_copy(t) if t.is_cuda else t


def _staged(kind: OpKind, t: torch.Tensor, op: int, root: int, inline: bool, what: str,
            tg: Target | None = None, **kw: Any) -> Handle:
    """Runs a collective of a CUDA tensor on the CPU engine through a pinned host copy."""
    host = _pinned_copy(t)
    back: Callable[[torch.Tensor], torch.Tensor]
    if kind.in_place:
        back = t.copy_  # in place, like the CPU form
    else:
        back = lambda out: out.to(t.device)  # noqa: E731  a new tensor, like the CPU form
    return Handle(_submit(kind, host, op, root, inline, what, tg, **kw), back)


def nccl_runs(kind: OpKind, dtype: torch.dtype, is_world: bool, extra: bool, op: int = ReduceOp.SUM) -> bool:
    """True when the NCCL path (once chosen) runs this CUDA collective: the world's four NCCL
    kinds without extra arguments (factors, out=, uneven rows), in a dtype NCCL has (not int16),
    reducing with an op NCCL has (not BAND, BOR or BXOR)."""
    bitwise = kind.reduces and ReduceOp(op).bitwise
    return is_world and kind.nccl and not extra and dtype != torch.int16 and not bitwise


def _run(kind: OpKind, t: torch.Tensor, op: int, root: int, inline: bool, what: str, tg: Target,
         nccl: bool = True, **kw: Any) -> Handle:
    """Starts a checked tensor's collective on the path for its device (the NCCL path only
    for `nccl` calls of the world's four NCCL kinds without extra keywords)."""
    if not t.is_cuda:
        return Handle(_submit(kind, t, op, root, inline, what, tg, **kw))
    if nccl and _gpu_path.path() == "nccl" and nccl_runs(kind, t.dtype, tg.is_world, bool(kw), op):
        return _nccl(kind, t, op, root, what)
    return _staged(kind, t, op, root, inline, what, tg, **kw)


def _allreduce(tensor: torch.Tensor, op: ReduceOp, prescale: float, postscale: float,
               group: GroupBase | None, what: str, inline: bool) -> Handle:
    if sparse.is_sparse(tensor):  # three allgathers (collectives/sparse.py)
        return sparse.allreduce_async(tensor, op, prescale, postscale, group, what)
    tg = target(group, what)
    t = _checks.check_tensor(tensor, what, tg)
    op = _checks.check_op(OpKind.ALLREDUCE, t, op, what, tg)
    kw = _checks.scale_kwargs(OpKind.ALLREDUCE, t, prescale, postscale, what, tg)
    return _run(OpKind.ALLREDUCE, t, op, -1, inline, what, tg, **kw)


@profiled
def allreduce_async(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, group: GroupBase | None = None) -> Handle:
    """Starts an in-place allreduce of `tensor`; wait() returns `tensor`."""
    return _allreduce(tensor, op, prescale_factor, postscale_factor, group, "allreduce_async", False)


def _allreduce_checked(tensor: torch.Tensor, op: ReduceOp, prescale: float, postscale: float,
                       group: GroupBase | None) -> torch.Tensor:
    """allreduce through the Python checks (what the engine's fast path does not take)."""
    return _allreduce(tensor, op, prescale, postscale, group, "allreduce", True).wait()


_allreduce_checked = profiled(_allreduce_checked, "allreduce")


def allreduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, group: GroupBase | None = None) -> torch.Tensor:
    """Reduces `tensor` across ranks in place (each input times prescale_factor, the result
    times postscale_factor) and returns it."""
    # The common call (world, no scaling, no profiler) goes straight to the engine, which
    # checks the tensor and op as _checks.check_tensor/check_op do and declines anything they would
    # refuse; the checked path then words the error.
    state = _context._state
    if (state is not None and group is None and type(op) is ReduceOp and type(prescale_factor) is float
            and type(postscale_factor) is float and prescale_factor == 1.0 and postscale_factor == 1.0
            and not _profiler_on() and state.allreduce_now(tensor, op)):
        return tensor
    return _allreduce_checked(tensor, op, prescale_factor, postscale_factor, group)


def _broadcast(tensor: torch.Tensor, src: int, group: GroupBase | None, what: str,
               inline: bool) -> Handle:
    tg = target(group, what)
    t = _checks.check_tensor(tensor, what, tg)
    src = _checks.check_rank(src, "src", what, tg)
    return _run(OpKind.BROADCAST, t, 0, src, inline, what, tg)


@profiled
def broadcast_async(tensor: torch.Tensor, src: int = 0, group: GroupBase | None = None) -> Handle:
    """Starts copying rank `src`'s `tensor` into every rank's `tensor`."""
    return _broadcast(tensor, src, group, "broadcast_async", False)


@profiled
def broadcast(tensor: torch.Tensor, src: int = 0, group: GroupBase | None = None) -> torch.Tensor:
    """Copies rank `src`'s `tensor` into every rank's `tensor` and returns it."""
    return _broadcast(tensor, src, group, "broadcast", True).wait()


def _allgather(tensor: torch.Tensor, group: GroupBase | None, what: str, inline: bool) -> Handle:
    tg = target(group, what)
    t = _checks.check_tensor(tensor, what, tg)
    t = t.reshape(1) if t.dim() == 0 else t  # a scalar is one row
    return _run(OpKind.ALLGATHER, t, 0, -1, inline, what, tg)


@profiled
def allgather_async(tensor: torch.Tensor, group: GroupBase | None = None) -> Handle:
    """Starts an allgather; wait() returns every rank's tensor concatenated along dim 0."""
    return _allgather(tensor, group, "allgather_async", False)


@profiled
def allgather(tensor: torch.Tensor, group: GroupBase | None = None) -> torch.Tensor:
    """Concatenates every rank's `tensor` along dim 0 (its size may differ per rank)."""
    return _allgather(tensor, group, "allgather", True).wait()


def _reduce_scatter(tensor: torch.Tensor, op: ReduceOp, prescale: float, postscale: float,
                    group: GroupBase | None, what: str, inline: bool) -> Handle:
    tg = target(group, what)
    t = _checks.check_tensor(tensor, what, tg)
    op = _checks.check_op(OpKind.REDUCE_SCATTER, t, op, what, tg)
    _checks.check_rows(t, what, tg)
    kw = _checks.scale_kwargs(OpKind.REDUCE_SCATTER, t, prescale, postscale, what, tg)
    even = t.shape[0] % tg.size == 0  # NCCL splits evenly only
    return _run(OpKind.REDUCE_SCATTER, t, op, -1, inline, what, tg, nccl=even, **kw)


@profiled
def reduce_scatter_async(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                         prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                         group: GroupBase | None = None) -> Handle:
    """Starts a reduce_scatter (keep `tensor` unchanged until wait()); wait() returns this rank's rows."""
    return _reduce_scatter(tensor, op, prescale_factor, postscale_factor, group,
                           "reduce_scatter_async", False)


@profiled
def reduce_scatter(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, prescale_factor: float = 1.0,
                   postscale_factor: float = 1.0, group: GroupBase | None = None) -> torch.Tensor:
    """Reduces `tensor` across ranks and returns this rank's rows of the result: dim 0 split
    in rank order, the first dim0 % size ranks one row more."""
    return _reduce_scatter(tensor, op, prescale_factor, postscale_factor, group,
                           "reduce_scatter", True).wait()


def _barrier(group: GroupBase | None, what: str, inline: bool) -> Any:
    """Submits a barrier (always on the CPU engine); returns the engine's Work."""
    return _submit(OpKind.BARRIER, None, 0, -1, inline, what, target(group, what))


@profiled
def barrier_async(group: GroupBase | None = None) -> Handle:
    """Starts a barrier; wait() returns once every rank has reached it."""
    return Handle(_barrier(group, "barrier_async", False))


@profiled
def barrier(group: GroupBase | None = None) -> None:
    """Returns once every rank has called barrier()."""
    _barrier(group, "barrier", True).wait(0.0)  # no Handle: a barrier has no result


def _to_bytes_tensor(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


@profiled
def broadcast_object(obj: Any, src: int = 0, group: GroupBase | None = None) -> Any:
    """Returns rank `src`'s picklable `obj` on every rank."""
    tg = target(group, "broadcast_object")
    src = _checks.check_rank(src, "src", "broadcast_object", tg)
    mine = tg.rank == src
    payload = _to_bytes_tensor(obj) if mine else None
    length = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64)
    broadcast(length, src, group)
    buffer = payload if payload is not None else torch.empty(int(length.item()), dtype=torch.uint8)
    broadcast(buffer, src, group)
    return obj if mine else pickle.loads(buffer.numpy().tobytes())


@profiled
def allgather_object(obj: Any, group: GroupBase | None = None) -> list[Any]:
    """Returns the list of every rank's picklable `obj`, indexed by (group) rank."""
    payload = _to_bytes_tensor(obj)
    lengths = allgather(torch.tensor([payload.numel()], dtype=torch.int64), group).tolist()
    data = allgather(payload, group).numpy().tobytes()
    out, start = [], 0
    for n in lengths:
        out.append(pickle.loads(data[start:start + n]))
        start += n
    return out
