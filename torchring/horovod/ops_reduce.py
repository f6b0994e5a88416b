"""Horovod's reductions: allreduce (plain, in place, grouped, sparse), barrier and join.

Every call becomes a negotiated request (negotiator.py) named ``<op>.<name>``, or
``<op>.noname.<n>`` without a name. Once every rank of the process set asked, the negotiation
thread starts the engine's allreduce (``allreduce_many`` for a group) on the set's private
communicator. Horovod's arithmetic: ``Average`` is the sum divided by the set's size (joined
ranks count: they add zeros); floating tensors are scaled by the engine (prescale before the
sum, rounded to the tensor's dtype; postscale and the 1/size of Average applied to the sum);
integer tensors are scaled in float64 and cast back, and their Average is a division that
truncates toward zero, as Horovod's tests expect. ``average=`` is the deprecated spelling of
``op`` (True: Average, False: Sum). The autograd rule of allreduce is an allreduce of the
gradient with the same op and factors.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Sequence

import torch

from .. import cuda
from .._core.types import dtype_name
from ..collectives._checks import dtype_advice
from . import handles
from .basics import Average, Sum, to_reduce_op
from .compression import Compression
from .negotiator import Done, Entry, Request, register_joined_starter
from .process_sets import ProcessSet, global_process_set

__all__ = ["allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
           "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
           "barrier", "join", "poll", "synchronize", "submit",
           "check_tensor", "resolve_op", "engine_scaling"]

poll = handles.poll
synchronize = handles.synchronize


def resolve_op(op: Any, average: Any, what: str) -> int:
    """The op of a call that may use the deprecated `average=` (default Average)."""
    if average is not None:
        if op is not None:
            raise ValueError(f"hvd.{what}: give op= or the deprecated average=, not both")
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in a "
                      "future torchring.horovod version", DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average if op is None else op


def check_tensor(t: Any, what: str, in_place: bool = False) -> torch.Tensor:
    """`t` if it can go to the engine (a tensor; contiguous when written in place)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"hvd.{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.is_sparse:
        raise ValueError(f"hvd.{what}: sparse tensors go through hvd.sparse_allreduce_async (or "
                         "DistributedOptimizer(sparse_as_dense=True))")
    advice = dtype_advice(t.dtype)  # the rule torchring's collectives apply, in Horovod's words
    if advice:
        raise ValueError(f"hvd.{what}: tensor dtype {dtype_name(t.dtype)} is not supported; {advice}")
    if in_place and not t.is_contiguous():
        raise ValueError(f"hvd.{what}: the tensor is required to be contiguous (it is written in place)")
    return t


def submit(ps: ProcessSet, request_name: str | None, kind: str, what: str, fields: dict[str, Any],
           start: Callable[[dict[int, Request], frozenset[int]], Any],
           finish: Callable[[Any], Any], keep: Any = None, prefix: str | None = None) -> int:
    """Queues one negotiated operation on `ps` and returns its handle."""
    negotiator = ps.negotiator(what)
    prefix = prefix or kind
    name = f"{prefix}.{request_name}" if request_name is not None else ps.auto_name(prefix)
    entry = Entry(Request(name=name, kind=kind, **fields), start)
    negotiator.submit(entry)
    return handles.add(entry, finish, keep)


def _device_of(q: Request) -> torch.device:
    if q.device == "cuda":
        return cuda.device() or torch.device("cuda")
    return torch.device(q.device)


def _dtype_of(q: Request) -> torch.dtype:
    return getattr(torch, q.dtype.removeprefix("torch."))


def engine_scaling(q: Request, set_size: int) -> tuple[Any, float, float]:
    """(engine op, engine prescale, engine postscale) for request `q`; integer scaling happens
    outside the engine (see the top)."""
    engine_op = to_reduce_op(Sum if q.op == Average else q.op)
    if not _dtype_of(q).is_floating_point:
        return engine_op, 1.0, 1.0
    post = q.postscale / set_size if q.op == Average else q.postscale
    return engine_op, q.prescale, post


def _int_finish(t: torch.Tensor, op: int, postscale: float, set_size: int) -> torch.Tensor:
    """Applies an integer tensor's postscale and Average after the sum (in place)."""
    if t.dtype.is_floating_point:
        return t
    if postscale != 1.0:
        t.copy_((t.double() * postscale).to(t.dtype))
    if op == Average:
        t.copy_(torch.div(t, set_size, rounding_mode="trunc"))
    return t


def _allreduce_request(tensors: Sequence[torch.Tensor], op: int, pre: float, post: float) -> dict[str, Any]:
    if op != Average:  # Adasum's NotImplementedError, an unknown op's ValueError: now, on this rank
        to_reduce_op(op)
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1 or len({t.device.type for t in tensors}) > 1:
        raise ValueError("hvd.grouped_allreduce: every tensor of a group must have one dtype and "
                         f"device, got {sorted(map(str, dtypes))}")
    return dict(dtype=str(tensors[0].dtype), shapes=tuple(tuple(t.shape) for t in tensors),
                device=tensors[0].device.type, op=int(op), prescale=float(pre), postscale=float(post))


def _start_allreduce(group: Any, bufs: list[torch.Tensor], q: Request) -> Any:
    engine_op, pre, post = engine_scaling(q, group.size())
    if len(bufs) == 1:
        return group.allreduce_async(bufs[0], engine_op, prescale_factor=pre, postscale_factor=post)
    return group.allreduce_many_async(bufs, engine_op, prescale_factor=pre, postscale_factor=post)


def _joined_allreduce(group: Any, requests: dict[int, Request], joined: frozenset[int]) -> Any:
    q = next(iter(requests.values()))
    zeros = [torch.zeros(s, dtype=_dtype_of(q), device=_device_of(q)) for s in q.shapes]
    return _start_allreduce(group, zeros, q)


register_joined_starter("allreduce", _joined_allreduce)


def _allreduce_bufs(tensors: list[torch.Tensor], in_place: bool, op: int, name: str | None,
                    pre: float, post: float, ps: ProcessSet, what: str, grouped: bool) -> int:
    fields = _allreduce_request(tensors, op, pre, post)
    bufs = [t if in_place else t.detach().contiguous().clone() for t in tensors]
    if not bufs[0].dtype.is_floating_point and pre != 1.0:
        for b in bufs:
            b.copy_((b.double() * pre).to(b.dtype))
    group = ps._private
    size = len(ps.ranks or ())

    def start(requests: dict[int, Request], joined: frozenset[int]) -> Any:
        return _start_allreduce(group, bufs, requests[min(requests)])

    def finish(_: Any) -> Any:
        outs = [_int_finish(b, op, post, size) for b in bufs]
        return outs if grouped else outs[0]

    return submit(ps, name, "allreduce", what, fields, start, finish, keep=(tensors, bufs),
                  prefix="grouped_allreduce" if grouped else "allreduce")


def allreduce_async(tensor: torch.Tensor, average: Any = None, name: str | None = None, op: Any = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Starts an out-of-place allreduce; synchronize(handle) returns the result."""
    op = resolve_op(op, average, "allreduce_async")
    t = check_tensor(tensor, "allreduce_async")
    return _allreduce_bufs([t], False, op, name, prescale_factor, postscale_factor, process_set,
                           "allreduce_async", False)


def allreduce_async_(tensor: torch.Tensor, average: Any = None, name: str | None = None, op: Any = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """Starts an in-place allreduce of `tensor`; synchronize(handle) returns it."""
    op = resolve_op(op, average, "allreduce_async_")
    t = check_tensor(tensor, "allreduce_async_", in_place=True)
    return _allreduce_bufs([t], True, op, name, prescale_factor, postscale_factor, process_set,
                           "allreduce_async_", False)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Any, op: int, pre: float, post: float,
                ps: ProcessSet) -> torch.Tensor:
        ctx.op, ctx.pre, ctx.post, ctx.ps = op, pre, post, ps
        return synchronize(allreduce_async(tensor, None, name, op, pre, post, ps))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        out = allreduce(grad, None, None, Compression.none, ctx.op, ctx.pre, ctx.post, ctx.ps)
        return out, None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: Any = None, name: str | None = None,
              compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduces `tensor` across the process set (Average by default) and returns a new tensor."""
    op = resolve_op(op, average, "allreduce")
    check_tensor(tensor, "allreduce")
    wire, ctx = compression.compress(tensor)
    out = _Allreduce.apply(wire, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, ctx)


def allreduce_(tensor: torch.Tensor, average: Any = None, name: str | None = None, op: Any = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduces `tensor` in place across the process set and returns it."""
    op = resolve_op(op, average, "allreduce_")
    return synchronize(allreduce_async_(tensor, None, name, op, prescale_factor, postscale_factor,
                                        process_set))


def _tensor_list(tensors: Any, what: str, in_place: bool = False) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError(f"hvd.{what}: expected a non-empty list of tensors")
    return [check_tensor(t, what, in_place) for t in tensors]


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Any = None, name: str | None = None,
                            op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Starts one allreduce of a list of tensors (negotiated and fused as a unit)."""
    op = resolve_op(op, average, "grouped_allreduce_async")
    ts = _tensor_list(tensors, "grouped_allreduce_async")
    return _allreduce_bufs(ts, False, op, name, prescale_factor, postscale_factor, process_set,
                           "grouped_allreduce_async", True)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Any = None, name: str | None = None,
                             op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    """Starts one in-place allreduce of a list of tensors."""
    op = resolve_op(op, average, "grouped_allreduce_async_")
    ts = _tensor_list(tensors, "grouped_allreduce_async_", in_place=True)
    return _allreduce_bufs(ts, True, op, name, prescale_factor, postscale_factor, process_set,
                           "grouped_allreduce_async_", True)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: Any, op: int, pre: float, post: float, ps: ProcessSet,
                *tensors: torch.Tensor) -> Any:
        ctx.op, ctx.pre, ctx.post, ctx.ps = op, pre, post, ps
        return tuple(synchronize(grouped_allreduce_async(list(tensors), None, name, op, pre, post, ps)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        outs = grouped_allreduce(list(grads), None, None, Compression.none, ctx.op, ctx.pre,
                                 ctx.post, ctx.ps)
        return (None, None, None, None, None, *outs)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Any = None, name: str | None = None,
                      compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduces a list of tensors as one unit and returns new tensors."""
    op = resolve_op(op, average, "grouped_allreduce")
    ts = _tensor_list(tensors, "grouped_allreduce")
    wires, ctxs = zip(*(compression.compress(t) for t in ts))
    outs = _GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, process_set, *wires)
    return [compression.decompress(o, c) for o, c in zip(outs, ctxs)]


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Any = None, name: str | None = None,
                       op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduces a list of tensors in place as one unit and returns them."""
    op = resolve_op(op, average, "grouped_allreduce_")
    return synchronize(grouped_allreduce_async_(tensors, None, name, op, prescale_factor,
                                                postscale_factor, process_set))


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Returns once every rank of the process set called barrier()."""
    handle = submit(process_set, None, "barrier", "barrier", {}, lambda r, j: Done(),
                    lambda out: None)
    synchronize(handle)


def join(device: int = -1) -> int:
    """Marks this rank as out of data: until every rank joined, it takes part in the others'
    allreduces with zeros. Returns the last rank to join (the same on every rank)."""
    ps = global_process_set
    entry = Entry(Request(name="join", kind="join", stamp=time.time()), lambda r, j: Done())
    ps.negotiator("join").submit(entry)
    return int(handles.wait_entry(entry))
