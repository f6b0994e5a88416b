"""allreduce of a sparse COO tensor: the sum of every rank's tensor, as gloo's sparse allreduce.

Every rank coalesces its tensor (one entry per index) and queues three allgathers on the engine,
back to back: its shape (sparse_dim, dense_dim, sizes: one row per rank, checked equal), its
indices as one row per non-zero (int64[nnz, sparse_dim]) and its values along dim 0. The counts
of non-zeros differ per rank; the engine's allgather takes uneven rows. The gathered indices and
values make one COO tensor, coalesced: entries of the same index from several ranks are summed,
in rank order. AVG divides the summed values by the group's size; prescale and postscale
multiply the values. A CUDA tensor is gathered through a host copy and its result moved back.
The c10d backend does the same in C++ (csrc/c10d/backend_sparse.cpp); Horovod's
sparse_allreduce_async reuses pack and unpack here.
"""

from __future__ import annotations

from typing import Any

import torch

from .._core.group_wiring import GroupBase, target
from .._core.types import Handle, OpKind, ReduceOp, Works, describe
from . import _checks

__all__ = ["is_sparse", "pack", "unpack", "allreduce_async"]


def is_sparse(t: Any) -> bool:
    """True for a sparse COO tensor (what this module reduces)."""
    return isinstance(t, torch.Tensor) and t.layout == torch.sparse_coo


def pack(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A COO tensor as the rows an allgather takes: (int64[nnz, sparse_dim] indices, values)."""
    c = t.coalesce()
    return c.indices().t().contiguous(), c.values().contiguous()


def unpack(rows: torch.Tensor, values: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Gathered index rows and values as one coalesced COO tensor (duplicates summed)."""
    return torch.sparse_coo_tensor(rows.t(), values, size=shape).coalesce()


def _shape_row(t: torch.Tensor) -> torch.Tensor:
    return torch.tensor([[t.sparse_dim(), t.dense_dim(), *t.shape]], dtype=torch.int64)


def _shape_text(row: torch.Tensor) -> str:
    sparse_dim, dense_dim, *sizes = row.tolist()
    return f"{sizes} (sparse_dim {sparse_dim}, dense_dim {dense_dim})"


def allreduce_async(tensor: torch.Tensor, op: ReduceOp, prescale: float, postscale: float,
                    group: GroupBase | None, what: str) -> Handle:
    """Starts the sparse allreduce of `tensor`; wait() copies the sum into it and returns it."""
    tg = target(group, what)
    where = tg.where(what)
    if not isinstance(op, ReduceOp):
        raise TypeError(f"{where}: op must be a torchring.ReduceOp, got {op!r}")
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"{where}: a sparse tensor ({describe(tensor)}) is reduced with SUM or AVG only, "
                         f"got {op.name}; convert it with tensor.to_dense() for other ops")
    host = tensor.coalesce().cpu()
    _checks.check_tensor(host.values(), what, tg, "the sparse tensor's values")
    if op == ReduceOp.AVG or prescale != 1 or postscale != 1:
        _checks.check_op(OpKind.ALLREDUCE, host.values(), op, what, tg)
        _checks.scale_kwargs(OpKind.ALLREDUCE, host.values(), prescale, postscale, what, tg)
    mine = _shape_row(host)
    rows, values = pack(host)
    if prescale != 1:
        values = values * prescale
    submit = tg.comm.submit
    works = [submit(int(OpKind.ALLGATHER), t, 0, -1, False) for t in (mine, rows, values)]
    scale = postscale / tg.size if op == ReduceOp.AVG else postscale

    def finish(gathered: list[torch.Tensor]) -> torch.Tensor:
        shapes, all_rows, all_values = gathered
        for r, row in enumerate(shapes):
            if not torch.equal(row, mine[0]):
                raise ValueError(f"{where}: rank {r}'s sparse tensor is {_shape_text(row)} but this rank's is "
                                 f"{_shape_text(mine[0])}; every rank must reduce a sparse tensor of the same sizes")
        total = unpack(all_rows, all_values * scale if scale != 1 else all_values, tensor.shape)
        tensor.copy_(total.to(tensor.device))
        return tensor

    return Handle(Works(works), finish)
