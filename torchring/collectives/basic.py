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

This module also holds the checks and the dispatch that rooted, alltoall and p2p share.
"""

from __future__ import annotations

import math
import pickle
import time
from typing import Any, Callable

import torch

from .._core import context as _context, gpu_path as _gpu_path
from .._core.group_wiring import GroupBase, Target, target
from .._core.types import (DTYPES, FLOATS, Handle, OpKind, ReduceOp, _profiler_on, describe, dtype_name,
                           profiled)

__all__ = [
    "ReduceOp", "Handle", "allreduce", "allreduce_async", "broadcast", "broadcast_async",
    "allgather", "allgather_async", "reduce_scatter", "reduce_scatter_async", "barrier",
    "barrier_async", "broadcast_object", "allgather_object",
]

_NCCL_KINDS = (OpKind.ALLREDUCE, OpKind.BROADCAST, OpKind.ALLGATHER, OpKind.REDUCE_SCATTER)
_IN_PLACE = (OpKind.ALLREDUCE, OpKind.BROADCAST, OpKind.REDUCE, OpKind.SCATTER)  # result = input


def _check_tensor(t: Any, what: str, tg: Target, name: str = "tensor") -> torch.Tensor:
    where = tg.where(what)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where} expects a torch.Tensor as {name}, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{where}: {t.layout} tensors are not supported ({name}); pass a dense "
                        "tensor (tensor.to_dense())")
    if t.dtype not in DTYPES:
        names = ", ".join(dtype_name(d) for d in DTYPES)
        raise TypeError(f"{where}: {name} {describe(t)} has a dtype torchring does not support; "
                        f"use one of {names}")
    if t.device.type == "cuda":
        _gpu_path.check(t, where)
    elif t.device.type != "cpu":
        raise ValueError(f"{where}: {name} {describe(t)} is on {t.device}; torchring handles "
                         "CPU and CUDA tensors")
    if not t.is_contiguous():
        raise ValueError(f"{where}: {name} {describe(t)} is not contiguous (strides "
                         f"{t.stride()}); pass tensor.contiguous() and use that tensor afterwards")
    return t


def _check_op(t: torch.Tensor, op: Any, what: str, tg: Target) -> ReduceOp:
    where = tg.where(what)
    if not isinstance(op, ReduceOp):
        raise TypeError(f"{where}: op must be a torchring.ReduceOp, got {op!r}")
    if t.dtype == torch.bool and op not in (ReduceOp.MIN, ReduceOp.MAX):
        raise TypeError(f"{where}: bool tensors support ReduceOp.MIN and MAX only, got {op.name}; "
                        "convert to an integer dtype to sum or multiply")
    if op == ReduceOp.AVG and t.dtype not in FLOATS:
        raise ValueError(f"{where}: ReduceOp.AVG needs a floating-point tensor, got {describe(t)}; "
                         "use SUM and divide, or convert to float")
    return op


def _check_rank(value: Any, name: str, what: str, tg: Target) -> int:
    """A src/dst/peer argument: a rank of `tg`'s group."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < tg.size:
        kind = "a rank" if tg.is_world else "a rank of the group (group ranks, not world ranks)"
        raise ValueError(f"{tg.where(what)}: {name} must be {kind} in [0, {tg.size}), got {value!r}")
    return value


def _scale_kwargs(t: torch.Tensor, prescale: Any, postscale: Any, what: str,
                  tg: Target) -> dict[str, float]:
    """The engine's prescale/postscale keywords (none when both are 1)."""
    for name, value in (("prescale_factor", prescale), ("postscale_factor", postscale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{tg.where(what)}: {name} must be a finite number, got {value!r}")
    if prescale == 1 and postscale == 1:
        return {}
    if t.dtype not in FLOATS:
        raise ValueError(f"{tg.where(what)}: prescale_factor/postscale_factor other than 1 need a "
                         f"floating-point tensor, got {describe(t)}; scale it yourself or convert")
    return {"prescale": float(prescale), "postscale": float(postscale)}


def rows_of(rows: int, size: int, rank: int) -> tuple[int, int]:
    """(first row, number of rows) of `rank`'s share of `rows` split over `size` ranks: the
    first rows % size ranks get one row more (reduce_scatter)."""
    base, extra = divmod(rows, size)
    return rank * base + min(rank, extra), base + (rank < extra)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True if the bytes of contiguous `a` and `b` overlap."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


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
    if kind in _IN_PLACE:
        back = t.copy_  # in place, like the CPU form
    else:
        back = lambda out: out.to(t.device)  # noqa: E731  a new tensor, like the CPU form
    return Handle(_submit(kind, host, op, root, inline, what, tg, **kw), back)


def nccl_runs(kind: OpKind, dtype: torch.dtype, is_world: bool, extra: bool) -> bool:
    """True when the NCCL path (once chosen) runs this CUDA collective: the world's four NCCL
    kinds without extra arguments (factors, out=, uneven rows), in a dtype NCCL has (not int16)."""
    return is_world and kind in _NCCL_KINDS and not extra and dtype != torch.int16


def _run(kind: OpKind, t: torch.Tensor, op: int, root: int, inline: bool, what: str, tg: Target,
         nccl: bool = True, **kw: Any) -> Handle:
    """Starts a checked tensor's collective on the path for its device (the NCCL path only
    for `nccl` calls of the world's four NCCL kinds without extra keywords)."""
    if not t.is_cuda:
        return Handle(_submit(kind, t, op, root, inline, what, tg, **kw))
    if nccl and _gpu_path.path() == "nccl" and nccl_runs(kind, t.dtype, tg.is_world, bool(kw)):
        return _nccl(kind, t, op, root, what)
    return _staged(kind, t, op, root, inline, what, tg, **kw)


class _Works:
    """Several engine Works waited for as one (allreduce_many of several dtypes)."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works
        self.seq = works[0].seq if works else -1

    def _each(self, method: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout if timeout > 0 else None
        for work in self.works:  # a timeout of 0 waits for ever, so a spent deadline waits 1 us
            left = 0.0 if deadline is None else max(deadline - time.monotonic(), 1e-6)
            getattr(work, method)(left)

    def wait(self, timeout: float = 0.0) -> None:
        self._each("wait", timeout)

    def synchronize(self, timeout: float = 0.0) -> None:
        self._each("synchronize", timeout)

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


def _allreduce(tensor: torch.Tensor, op: ReduceOp, prescale: float, postscale: float,
               group: GroupBase | None, what: str, inline: bool) -> Handle:
    tg = target(group, what)
    t = _check_tensor(tensor, what, tg)
    op = _check_op(t, op, what, tg)
    kw = _scale_kwargs(t, prescale, postscale, what, tg)
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
    # checks the tensor and op as _check_tensor/_check_op do and declines anything they would
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
    t = _check_tensor(tensor, what, tg)
    src = _check_rank(src, "src", what, tg)
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
    t = _check_tensor(tensor, what, tg)
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


def _check_rows(t: torch.Tensor, what: str, tg: Target) -> None:
    if t.dim() == 0:
        raise ValueError(f"{tg.where(what)}: tensor {describe(t)} has no dim 0 to split over the "
                         f"ranks; pass a tensor of at least one dimension (tensor.reshape(1))")


def _reduce_scatter(tensor: torch.Tensor, op: ReduceOp, prescale: float, postscale: float,
                    group: GroupBase | None, what: str, inline: bool) -> Handle:
    tg = target(group, what)
    t = _check_tensor(tensor, what, tg)
    op = _check_op(t, op, what, tg)
    _check_rows(t, what, tg)
    kw = _scale_kwargs(t, prescale, postscale, what, tg)
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


def _barrier(group: GroupBase | None, what: str, inline: bool) -> Handle:
    tg = target(group, what)
    return Handle(_submit(OpKind.BARRIER, None, 0, -1, inline, what, tg))


@profiled
def barrier_async(group: GroupBase | None = None) -> Handle:
    """Starts a barrier; wait() returns once every rank has reached it."""
    return _barrier(group, "barrier_async", False)


@profiled
def barrier(group: GroupBase | None = None) -> None:
    """Returns once every rank has called barrier()."""
    _barrier(group, "barrier", True).wait()


def _to_bytes_tensor(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


@profiled
def broadcast_object(obj: Any, src: int = 0, group: GroupBase | None = None) -> Any:
    """Returns rank `src`'s picklable `obj` on every rank."""
    tg = target(group, "broadcast_object")
    src = _check_rank(src, "src", "broadcast_object", tg)
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
