"""Horovod's data-moving collectives: allgather, broadcast, alltoall, reducescatter (and grouped).

Each is negotiated like an allreduce (ops_reduce.submit) and then runs the engine's collective on
the process set's private communicator. What every rank must agree on, checked by the
negotiation on every rank: dtype and device everywhere; for allgather and alltoall the shape
after the first dimension (the first may differ per rank); for broadcast the whole shape and the
root; for reducescatter the shape, the op and the scale factors. ``root_rank`` is a world rank,
also within a process set. The autograd rules are Horovod's: allgather's gradient is the average
allreduce of the gradient, narrowed to this rank's rows; broadcast's is that average on the root
and zeros elsewhere; alltoall's is an alltoall back with the received splits; reducescatter's is
an allgather of the gradient, scaled by the set's size for Sum and by the scale factors.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from .._core import context as _context
from ..collectives import sparse
from .basics import Average, Sum, op_name, to_reduce_op
from .compression import Compression
from .negotiator import Request, register_joined_starter
from .ops_reduce import (_dtype_of, _device_of, _int_finish, _tensor_list, allreduce, check_tensor,
                         engine_scaling, submit, synchronize)
from .process_sets import ProcessSet, global_process_set

__all__ = ["allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
           "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "alltoall",
           "alltoall_async", "reducescatter", "reducescatter_async", "grouped_reducescatter",
           "grouped_reducescatter_async", "sparse_allreduce_async"]


class _Many:
    """Several engine handles started as one negotiated unit; wait() returns their results."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self, timeout: float | None = None) -> list[Any]:
        return [w.wait() for w in self.works]

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def _fields(tensors: Sequence[torch.Tensor], what: str, **more: Any) -> dict[str, Any]:
    if len({t.dtype for t in tensors}) > 1 or len({t.device.type for t in tensors}) > 1:
        raise ValueError(f"hvd.{what}: every tensor of a group must have one dtype and device")
    return dict(dtype=str(tensors[0].dtype), shapes=tuple(tuple(t.shape) for t in tensors),
                device=tensors[0].device.type, **more)


# ---------------------------------------------------------------------------------- allgather
def _allgather(tensors: list[torch.Tensor], name: Any, ps: ProcessSet, what: str, grouped: bool,
               rows: dict[str, list[int]], prefix: str | None = None) -> int:
    """Starts the allgathers; `rows["rows"]` gets every member's first dimension (for backward)."""
    bufs = [t.detach().contiguous() for t in tensors]
    group = ps._private

    def start(requests: dict[int, Request], joined: frozenset[int]) -> Any:
        first = [requests[r].shapes[0] for r in ps.ranks or ()]
        rows["rows"] = [s[0] if s else 1 for s in first]
        return _Many([group.allgather_async(b) for b in bufs])

    def finish(outs: list[torch.Tensor]) -> Any:
        return outs if grouped else outs[0]

    return submit(ps, name, "allgather", what, _fields(bufs, what), start, finish, keep=bufs,
                  prefix=prefix or ("grouped_allgather" if grouped else "allgather"))


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Starts an allgather along dim 0 (sizes may differ per rank); synchronize() returns it."""
    return _allgather([check_tensor(tensor, "allgather_async")], name, process_set,
                      "allgather_async", False, {})


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """Starts allgathers of a list of tensors as one unit; synchronize() returns a list."""
    ts = _tensor_list(tensors, "grouped_allgather_async")
    return _allgather(ts, name, process_set, "grouped_allgather_async", True, {})


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: Any, ps: ProcessSet, prefix: str, *tensors: torch.Tensor) -> Any:
        rows: dict[str, list[int]] = {}
        outs = synchronize(_allgather(list(tensors), name, ps, prefix, True, rows, prefix))
        ctx.ps, ctx.rows, ctx.shapes = ps, rows["rows"], [t.shape for t in tensors]
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        me = (ctx.ps.ranks or []).index(torch_rank())
        offset, mine = sum(ctx.rows[:me]), ctx.rows[me]
        outs = []
        for g, shape in zip(grads, ctx.shapes):
            reduced = allreduce(g, None, None, Compression.none, Average, 1.0, 1.0, ctx.ps)
            outs.append(reduced.narrow(0, offset, mine).reshape(shape) if len(shape) else
                        reduced.narrow(0, offset, 1).reshape(shape))
        return (None, None, None, *outs)


def torch_rank() -> int:
    """This process's world rank."""
    return _context.rank()


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenates every rank's `tensor` along dim 0 (sizes may differ per rank)."""
    check_tensor(tensor, "allgather")
    return _Allgather.apply(name, process_set, "allgather", tensor)[0]


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgathers each tensor of a list, as one unit."""
    ts = _tensor_list(tensors, "grouped_allgather")
    return list(_Allgather.apply(name, process_set, "grouped_allgather", *ts))


# ---------------------------------------------------------------------------------- broadcast
def _broadcast(tensor: torch.Tensor, root_rank: int, name: Any, ps: ProcessSet, what: str,
               in_place: bool) -> int:
    t = check_tensor(tensor, what, in_place)
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or root_rank not in (ps.ranks or ()):
        raise ValueError(f"hvd.{what}: root_rank={root_rank!r} is not a rank of {ps} (root_rank is "
                         "a world rank, also within a process set)")
    buf = t if in_place else t.detach().contiguous().clone()
    group, src = ps._private, (ps.ranks or []).index(root_rank)

    def start(requests: dict[int, Request], joined: frozenset[int]) -> Any:
        return group.broadcast_async(buf, src)

    return submit(ps, name, "broadcast", what, _fields([buf], what, root=root_rank), start,
                  lambda out: buf, keep=(tensor, buf))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Starts a broadcast of `root_rank`'s tensor into a new tensor on every rank."""
    return _broadcast(tensor, root_rank, name, process_set, "broadcast_async", False)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """Starts a broadcast of `root_rank`'s tensor into `tensor` on every rank."""
    return _broadcast(tensor, root_rank, name, process_set, "broadcast_async_", True)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: Any, ps: ProcessSet) -> torch.Tensor:
        ctx.root, ctx.ps = root_rank, ps
        return synchronize(broadcast_async(tensor, root_rank, name, ps))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        reduced = allreduce(grad, None, None, Compression.none, Average, 1.0, 1.0, ctx.ps)
        if torch_rank() != ctx.root:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Returns `root_rank`'s tensor on every rank of the process set."""
    check_tensor(tensor, "broadcast")
    return _Broadcast.apply(tensor, root_rank, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrites `tensor` with `root_rank`'s on every rank of the process set and returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ---------------------------------------------------------------------------------- alltoall
def _splits(splits: Any, rows: int, n: int, what: str) -> list[int]:
    """The rows this rank sends to each member."""
    if splits is None:
        if rows % n:
            raise ValueError(f"hvd.{what}: without splits the first dimension ({rows}) must be "
                             f"divisible by the process set's size ({n})")
        return [rows // n] * n
    if isinstance(splits, torch.Tensor):
        if splits.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"hvd.{what}: splits must hold 32-bit (or 64-bit) integers, got {splits.dtype}")
        values = [int(v) for v in splits.flatten().tolist()]
    else:
        values = list(splits)
        if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
            raise ValueError(f"hvd.{what}: splits must be integers, got {values!r}")
    if len(values) != n or any(v < 0 for v in values):
        raise ValueError(f"hvd.{what}: splits must have one non-negative entry per rank of the "
                         f"process set ({n}), got {values}")
    if sum(values) > rows:
        raise ValueError(f"hvd.{what}: the splits add up to {sum(values)} rows but the tensor has {rows}")
    return values


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Starts an alltoall along dim 0; synchronize() returns (output, received_splits)."""
    t = check_tensor(tensor, "alltoall_async")
    ps = process_set
    ps.negotiator("alltoall_async")
    rows = t.shape[0] if t.dim() else 1
    sends = _splits(splits, rows, len(ps.ranks or ()), "alltoall_async")
    buf = t.detach().reshape(rows, *t.shape[1:]).narrow(0, 0, sum(sends)).contiguous()
    group = ps._private

    def start(requests: dict[int, Request], joined: frozenset[int]) -> Any:
        return group.alltoall_async(buf, sends)

    def finish(out: Any) -> Any:
        output, received = out
        return output, torch.as_tensor(received).to(torch.int32).cpu()

    return submit(ps, name, "alltoall", "alltoall_async", _fields([buf], "alltoall_async"),
                  start, finish, keep=(tensor, buf))


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: Any, ps: ProcessSet) -> Any:
        output, received = synchronize(alltoall_async(tensor, splits, name, ps))
        ctx.ps, ctx.received = ps, received
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> Any:
        back, _received = alltoall(grad, ctx.received, None, ctx.ps)
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Sends rows of `tensor` to each rank (equal parts, or `splits`); returns the rows received,
    and with `splits` also how many came from each rank."""
    output, received = _Alltoall.apply(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


# ---------------------------------------------------------------------------------- reducescatter
def _reducescatter(tensors: list[torch.Tensor], name: Any, op: int, ps: ProcessSet, pre: float,
                   post: float, what: str, grouped: bool, prefix: str | None = None) -> int:
    to_reduce_op(Sum if op == Average else op)  # Adasum and unknown ops fail here, on this rank
    for t in tensors:
        if t.dim() == 0:
            raise ValueError(f"hvd.{what}: a scalar cannot be scattered; give a tensor with a first dimension")
    bufs = [t.detach().contiguous().clone() for t in tensors]
    if not bufs[0].dtype.is_floating_point and pre != 1.0:
        for b in bufs:
            b.copy_((b.double() * pre).to(b.dtype))
    group, size = ps._private, len(ps.ranks or ())
    fields = _fields(bufs, what, op=int(op), prescale=float(pre), postscale=float(post))

    def start(requests: dict[int, Request], joined: frozenset[int]) -> Any:
        q = requests[min(requests)]
        engine_op, e_pre, e_post = engine_scaling(q, group.size())
        return _Many([group.reduce_scatter_async(b, engine_op, prescale_factor=e_pre,
                                                 postscale_factor=e_post) for b in bufs])

    def finish(outs: list[torch.Tensor]) -> Any:
        outs = [_int_finish(o, op, post, size) for o in outs]
        return outs if grouped else outs[0]

    return submit(ps, name, "reducescatter", what, fields, start, finish, keep=(tensors, bufs),
                  prefix=prefix or ("grouped_reducescatter" if grouped else "reducescatter"))


def _joined_reducescatter(group: Any, requests: dict[int, Request], joined: frozenset[int]) -> Any:
    q = next(iter(requests.values()))
    engine_op, pre, post = engine_scaling(q, group.size())
    return _Many([group.reduce_scatter_async(torch.zeros(s, dtype=_dtype_of(q), device=_device_of(q)),
                                             engine_op, prescale_factor=pre, postscale_factor=post)
                  for s in q.shapes])


register_joined_starter("reducescatter", _joined_reducescatter)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """Starts a reduction whose result is split along dim 0 (the first ranks get a row more)."""
    t = check_tensor(tensor, "reducescatter_async")
    return _reducescatter([t], name, op, process_set, prescale_factor, postscale_factor,
                          "reducescatter_async", False)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: int = Average, process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """Starts reducescatters of a list of tensors as one unit."""
    ts = _tensor_list(tensors, "grouped_reducescatter_async")
    return _reducescatter(ts, name, op, process_set, prescale_factor, postscale_factor,
                          "grouped_reducescatter_async", True)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: Any, op: int, ps: ProcessSet, pre: float, post: float, prefix: str,
                *tensors: torch.Tensor) -> Any:
        ctx.op, ctx.ps, ctx.pre, ctx.post = op, ps, pre, post
        outs = synchronize(_reducescatter(list(tensors), name, op, ps, pre, post, prefix, True, prefix))
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        scale = (len(ctx.ps.ranks) if ctx.op == Sum else 1) * ctx.pre * ctx.post
        outs = [allgather(g * scale if scale != 1 else g, None, ctx.ps) for g in grads]
        return (None, None, None, None, None, None, *outs)


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = Compression.none,
                  op: int = Average, process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduces `tensor` across the set and returns this rank's part of dim 0."""
    check_tensor(tensor, "reducescatter")
    wire, c = compression.compress(tensor)
    out = _Reducescatter.apply(name, op, process_set, prescale_factor, postscale_factor,
                               "reducescatter", wire)[0]
    return compression.decompress(out, c)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: Any = Compression.none, op: int = Average,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reducescatters each tensor of a list, as one unit."""
    ts = _tensor_list(tensors, "grouped_reducescatter")
    wires, ctxs = zip(*(compression.compress(t) for t in ts))
    outs = _Reducescatter.apply(name, op, process_set, prescale_factor, postscale_factor,
                                "grouped_reducescatter", *wires)
    return [compression.decompress(o, c) for o, c in zip(outs, ctxs)]


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: int,
                           process_set: ProcessSet = global_process_set) -> Callable[[], torch.Tensor]:
    """Starts a sparse allreduce (two allgathers: indices, values); returns a callable that
    waits and gives the coalesced sum (divided by the set's size for Average)."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise ValueError("hvd.sparse_allreduce_async: expected a sparse COO tensor")
    if op not in (Average, Sum):
        raise ValueError(f"hvd.sparse_allreduce_async: op must be hvd.Average or hvd.Sum, got {op_name(op)}")
    rows, values = sparse.pack(tensor)  # one row per non-zero: gathered along dim 0
    base = name if name is not None else process_set.auto_name("sparse_allreduce")
    hi = allgather_async(rows, f"{base}.indices", process_set)
    hv = allgather_async(values, f"{base}.values", process_set)
    size, shape = len(process_set.ranks or ()), tensor.shape

    def wait() -> torch.Tensor:
        vals = synchronize(hv)
        return sparse.unpack(synchronize(hi), vals / size if op == Average else vals, shape)

    return wait
