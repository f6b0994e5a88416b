"""Rooted and fused collectives: reduce, gather, scatter, allgather_into, reduce_scatter_into and
allreduce_many, each blocking and ``_async``.

Ranks given here (``dst``, ``src``) are ranks of the collective's group (the world's for
``group=None``). CUDA tensors always take the staged path: a host copy the CPU engine works
on, the result copied back when the Handle is waited for.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .._core.errors import CollectiveMismatchError
from .._core.group_wiring import GroupBase, Target, target
from .._core.types import Handle, OpKind, ReduceOp, Works, describe, dtype_name, profiled
from . import _checks
from .basic import _host, _run, _submit, rows_of

__all__ = [
    "reduce", "reduce_async", "gather", "gather_async", "scatter", "scatter_async",
    "allgather_into", "allgather_into_async", "reduce_scatter_into", "reduce_scatter_into_async",
    "allreduce_many", "allreduce_many_async",
]


def split_rows(out: torch.Tensor, shape: Sequence[int], size: int) -> list[torch.Tensor]:
    """`size` views of `out` (every rank's tensor of `shape` concatenated along dim 0, a 0-dim
    tensor as one row), each of `shape`."""
    if len(shape) == 0:
        return [out[r] for r in range(size)]
    rows = shape[0]
    return [out[r * rows:(r + 1) * rows] for r in range(size)]


def _tensor_list(tensors: Any, n: int | None, name: str, what: str, tg: Target) -> list[Any]:
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{tg.where(what)}: {name} must be a list of tensors, got {type(tensors).__name__}")
    if n is not None and len(tensors) != n:
        raise ValueError(f"{tg.where(what)}: {name} holds {len(tensors)} tensors; expected {n}, one "
                         "per rank of the group")
    return list(tensors)


def _like(t: torch.Tensor, items: list[Any], name: str, what: str, tg: Target) -> None:
    """Every item a dense tensor of `t`'s dtype and shape."""
    for i, x in enumerate(items):
        if not isinstance(x, torch.Tensor) or x.layout != torch.strided:
            raise TypeError(f"{tg.where(what)}: {name}[{i}] must be a dense torch.Tensor, got "
                            f"{type(x).__name__ if not isinstance(x, torch.Tensor) else x.layout}")
        if x.dtype != t.dtype or x.shape != t.shape:
            raise ValueError(f"{tg.where(what)}: {name}[{i}] is {describe(x)} but tensor is "
                             f"{describe(t)}; every entry of {name} must have tensor's dtype and shape")


def _reduce(tensor: torch.Tensor, dst: int, op: ReduceOp, group: GroupBase | None, what: str,
            inline: bool) -> Handle:
    tg = target(group, what)
    t = _checks.check_tensor(tensor, what, tg)
    op = _checks.check_op(OpKind.REDUCE, t, op, what, tg)
    dst = _checks.check_rank(dst, "dst", what, tg)
    return _run(OpKind.REDUCE, t, op, dst, inline, what, tg)


@profiled
def reduce_async(tensor: torch.Tensor, dst: int = 0, op: ReduceOp = ReduceOp.SUM,
                 group: GroupBase | None = None) -> Handle:
    """Starts a reduce into rank `dst`'s `tensor`; wait() returns `tensor`."""
    return _reduce(tensor, dst, op, group, "reduce_async", False)


@profiled
def reduce(tensor: torch.Tensor, dst: int = 0, op: ReduceOp = ReduceOp.SUM,
           group: GroupBase | None = None) -> torch.Tensor:
    """Reduces every rank's `tensor` into rank `dst`'s (others keep theirs) and returns it."""
    return _reduce(tensor, dst, op, group, "reduce", True).wait()


def _gather(tensor: torch.Tensor, dst: int, group: GroupBase | None, what: str,
            inline: bool) -> Handle:
    tg = target(group, what)
    t = _checks.check_tensor(tensor, what, tg)
    dst = _checks.check_rank(dst, "dst", what, tg)
    shape, size, device = tuple(t.shape), tg.size, t.device

    def finish(out: torch.Tensor | None) -> list[torch.Tensor] | None:
        return None if out is None else split_rows(out.to(device), shape, size)

    return Handle(_submit(OpKind.GATHER, _host(t), 0, dst, inline, what, tg), finish)


@profiled
def gather_async(tensor: torch.Tensor, dst: int = 0, group: GroupBase | None = None) -> Handle:
    """Starts a gather; wait() returns on `dst` the list of every rank's tensor, None elsewhere."""
    return _gather(tensor, dst, group, "gather_async", False)


@profiled
def gather(tensor: torch.Tensor, dst: int = 0,
           group: GroupBase | None = None) -> list[torch.Tensor] | None:
    """Returns on rank `dst` every rank's `tensor` (same shape everywhere) by rank, None elsewhere."""
    return _gather(tensor, dst, group, "gather", True).wait()


def _scatter(tensor: torch.Tensor, chunks: Any, src: int, group: GroupBase | None, what: str,
             inline: bool) -> Handle:
    tg = target(group, what)
    t = _checks.check_tensor(tensor, what, tg)
    src = _checks.check_rank(src, "src", what, tg)
    kw: dict[str, Any] = {}
    if tg.rank == src:
        if chunks is None:
            raise ValueError(f"{tg.where(what)}: this rank is src={src} and must pass chunks, a "
                             f"list of {tg.size} tensors like tensor {describe(t)}")
        parts = _tensor_list(chunks, tg.size, "chunks", what, tg)
        _like(t, parts, "chunks", what, tg)
        parts = [p.detach().cpu() for p in parts]
        kw["tensors"] = [torch.stack(parts) if t.dim() == 0 else torch.cat(parts)]
    return _run(OpKind.SCATTER, t, 0, src, inline, what, tg, **kw)


@profiled
def scatter_async(tensor: torch.Tensor, chunks: Sequence[torch.Tensor] | None = None, src: int = 0,
                  group: GroupBase | None = None) -> Handle:
    """Starts a scatter of `src`'s `chunks` into every rank's `tensor`; wait() returns `tensor`."""
    return _scatter(tensor, chunks, src, group, "scatter_async", False)


@profiled
def scatter(tensor: torch.Tensor, chunks: Sequence[torch.Tensor] | None = None, src: int = 0,
            group: GroupBase | None = None) -> torch.Tensor:
    """Copies rank `src`'s chunks[r] into rank r's `tensor` and returns it (chunks ignored elsewhere)."""
    return _scatter(tensor, chunks, src, group, "scatter", True).wait()


def _allgather_into(tensor_list: Any, tensor: torch.Tensor, group: GroupBase | None, what: str,
                    inline: bool) -> Handle:
    tg = target(group, what)
    t = _checks.check_tensor(tensor, what, tg)
    outs = _tensor_list(tensor_list, tg.size, "tensor_list", what, tg)
    _like(t, outs, "tensor_list", what, tg)
    one = t.reshape(1) if t.dim() == 0 else t  # a scalar is one row
    rows, size, where = one.shape[0], tg.size, tg.where(what)

    def finish(out: torch.Tensor) -> list[torch.Tensor]:
        if out.shape[0] != rows * size:
            raise CollectiveMismatchError(
                f"{where}: the group's tensors have {out.shape[0]} rows in all, but {size} ranks "
                f"with tensor {describe(t)} like this rank's make {rows * size}; every rank must "
                "pass a tensor of the same shape")
        for dst, part in zip(outs, split_rows(out, t.shape, size)):
            dst.copy_(part)
        return outs

    return Handle(_submit(OpKind.ALLGATHER, _host(one), 0, -1, inline, what, tg), finish)


@profiled
def allgather_into_async(tensor_list: list[torch.Tensor], tensor: torch.Tensor,
                         group: GroupBase | None = None) -> Handle:
    """Starts an allgather into `tensor_list`; wait() returns `tensor_list`."""
    return _allgather_into(tensor_list, tensor, group, "allgather_into_async", False)


@profiled
def allgather_into(tensor_list: list[torch.Tensor], tensor: torch.Tensor,
                   group: GroupBase | None = None) -> list[torch.Tensor]:
    """Copies rank r's `tensor` into tensor_list[r] on every rank and returns `tensor_list`."""
    return _allgather_into(tensor_list, tensor, group, "allgather_into", True).wait()


def _reduce_scatter_into(out: torch.Tensor, tensor: torch.Tensor, op: ReduceOp, prescale: float,
                         postscale: float, group: GroupBase | None, what: str,
                         inline: bool) -> Handle:
    tg = target(group, what)
    t = _checks.check_tensor(tensor, what, tg)
    o = _checks.check_tensor(out, what, tg, "out")
    op = _checks.check_op(OpKind.REDUCE_SCATTER, t, op, what, tg)
    _checks.check_rows(t, what, tg)
    kw = _checks.scale_kwargs(OpKind.REDUCE_SCATTER, t, prescale, postscale, what, tg)
    first, n = rows_of(t.shape[0], tg.size, tg.rank)
    want = (n, *t.shape[1:])
    if o.dtype != t.dtype or tuple(o.shape) != want:
        raise ValueError(f"{tg.where(what)}: out is {describe(o)}, expected {dtype_name(t.dtype)}{list(want)}: "
                         f"this rank's rows [{first}, {first + n}) of tensor {describe(t)} split over "
                         f"{tg.size} ranks (the first {t.shape[0] % tg.size} get one row more)")
    if not t.is_cuda and not o.is_cuda and not _checks.overlap(o, t):
        return Handle(_submit(OpKind.REDUCE_SCATTER, t, op, -1, inline, what, tg, out=o, **kw),
                      lambda _: o)
    work = _submit(OpKind.REDUCE_SCATTER, _host(t), op, -1, inline, what, tg, **kw)
    return Handle(work, o.copy_)


@profiled
def reduce_scatter_into_async(out: torch.Tensor, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                              group: GroupBase | None = None) -> Handle:
    """Starts a reduce_scatter into `out`; wait() returns `out`."""
    return _reduce_scatter_into(out, tensor, op, prescale_factor, postscale_factor, group,
                                "reduce_scatter_into_async", False)


@profiled
def reduce_scatter_into(out: torch.Tensor, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        group: GroupBase | None = None) -> torch.Tensor:
    """Like reduce_scatter, but writes this rank's rows into `out` and returns it."""
    return _reduce_scatter_into(out, tensor, op, prescale_factor, postscale_factor, group,
                                "reduce_scatter_into", True).wait()


def by_dtype(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of `tensors` grouped by dtype, dtypes in order of first appearance."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return list(groups.values())


def _allreduce_many(tensors: Any, op: ReduceOp, prescale: float, postscale: float,
                    group: GroupBase | None, what: str, inline: bool) -> Handle:
    tg = target(group, what)
    ts = [_checks.check_tensor(x, what, tg, f"tensors[{i}]")
          for i, x in enumerate(_tensor_list(tensors, None, "tensors", what, tg))]
    seen: dict[tuple[torch.device, int], int] = {}
    for i, t in enumerate(ts):
        _checks.check_op(OpKind.ALLREDUCE_MANY, t, op, what, tg)
        if t.numel():
            j = seen.setdefault((t.device, t.data_ptr()), i)
            if j != i:
                raise ValueError(f"{tg.where(what)}: tensors[{i}] and tensors[{j}] are the same "
                                 f"memory ({describe(t)}); pass each tensor once")
    works, copies = [], []
    for idx in by_dtype(ts):
        kw = _checks.scale_kwargs(OpKind.ALLREDUCE_MANY, ts[idx[0]], prescale, postscale, what, tg)
        hosts = [_host(ts[i]) for i in idx]
        copies += [(ts[i], h) for i, h in zip(idx, hosts) if h is not ts[i]]
        works.append(_submit(OpKind.ALLREDUCE_MANY, None, op, -1, inline, what, tg, tensors=hosts, **kw))

    def finish(_: Any) -> list[torch.Tensor]:
        for t, h in copies:
            t.copy_(h)
        return ts

    return Handle(Works(works), finish)


@profiled
def allreduce_many_async(tensors: Sequence[torch.Tensor], op: ReduceOp = ReduceOp.SUM,
                         prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                         group: GroupBase | None = None) -> Handle:
    """Starts a fused in-place allreduce of `tensors`; wait() returns them as a list."""
    return _allreduce_many(tensors, op, prescale_factor, postscale_factor, group,
                           "allreduce_many_async", False)


@profiled
def allreduce_many(tensors: Sequence[torch.Tensor], op: ReduceOp = ReduceOp.SUM,
                   prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                   group: GroupBase | None = None) -> list[torch.Tensor]:
    """Allreduces every tensor of `tensors` in place as one operation per dtype; returns them."""
    return _allreduce_many(tensors, op, prescale_factor, postscale_factor, group,
                           "allreduce_many", True).wait()
