"""All-to-all: every rank sends a block of rows of dim 0 to every rank, blocking and ``_async``.

``alltoall(t, splits)`` is Horovod's form (the output is new, the rows received from each rank
come back beside it); ``all_to_all_single(output, input, output_splits, input_splits)`` is
torch.distributed's (the output is the caller's, every split known up front and checked against
what the peers send). CUDA tensors take the staged path (a host copy, copied back at wait()).
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch

from .._core.group_wiring import GroupBase, target
from .._core.types import Handle, OpKind, describe, profiled
from . import _checks
from .basic import _host, _submit

__all__ = ["alltoall", "alltoall_async", "all_to_all_single", "all_to_all_single_async"]

Splits = Sequence[int] | torch.Tensor | None


def split_counts(splits: Any, rows: int, size: int, where: str) -> list[int]:
    """Rows per rank: `splits` as a list (one int per rank), or `rows` split equally for None.
    `where` starts messages."""
    if splits is None:  # rows not divisible by size: the engine fails it on every rank, naming it
        return [rows // size] * size
    if isinstance(splits, torch.Tensor):
        if splits.dtype.is_floating_point or splits.dtype.is_complex or splits.dtype == torch.bool \
                or splits.dim() != 1:
            raise TypeError(f"{where}: a splits tensor must be 1-D of an integer dtype, got "
                            f"{describe(splits)}")
        counts = splits.tolist()
    elif isinstance(splits, (list, tuple)):
        counts = []
        for x in splits:
            if isinstance(x, bool):
                raise TypeError(f"{where}: splits must hold integers, got {x!r} in {list(splits)}")
            try:
                counts.append(operator.index(x))
            except TypeError:
                raise TypeError(f"{where}: splits must hold integers, got {x!r} in {list(splits)}") from None
    else:
        raise TypeError(f"{where}: splits must be a list of ints, an integer tensor or None, got "
                        f"{type(splits).__name__}")
    if len(counts) != size:
        raise ValueError(f"{where}: splits {counts} has {len(counts)} entries; expected {size}, the "
                         "rows for each rank of the group")
    # Negative counts, or counts that do not sum to `rows`, are left to the engine: it compares
    # every rank's splits and fails the operation on every rank alike, naming the rank and the
    # numbers (a ValueError here would leave the other ranks waiting for the timeout).
    return counts


def _alltoall(tensor: torch.Tensor, splits: Splits, group: GroupBase | None, what: str,
              inline: bool) -> Handle:
    tg = target(group, what)
    t = _checks.check_tensor(tensor, what, tg)
    _checks.check_rows(t, what, tg)
    send = split_counts(splits, t.shape[0], tg.size, f"{tg.where(what)} of tensor {describe(t)}")
    send_splits = torch.tensor(send, dtype=torch.int64)
    recv_splits = torch.zeros(tg.size, dtype=torch.int64)
    work = _submit(OpKind.ALLTOALL, _host(t), 0, -1, inline, what, tg, send_splits=send_splits,
                   recv_splits=recv_splits)
    device = t.device
    return Handle(work, lambda out: (out.to(device), recv_splits))


@profiled
def alltoall_async(tensor: torch.Tensor, splits: Splits = None,
                   group: GroupBase | None = None) -> Handle:
    """Starts an alltoall; wait() returns (output, received_splits)."""
    return _alltoall(tensor, splits, group, "alltoall_async", False)


@profiled
def alltoall(tensor: torch.Tensor, splits: Splits = None,
             group: GroupBase | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sends splits[r] rows of dim 0 (in order; equal blocks for None) to rank r; returns the rows
    received, in rank order, and an int64 tensor of how many came from each rank."""
    return _alltoall(tensor, splits, group, "alltoall", True).wait()


def _all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_splits: Splits,
                       input_splits: Splits, group: GroupBase | None, what: str,
                       inline: bool) -> Handle:
    tg = target(group, what)
    i = _checks.check_tensor(input, what, tg, "input")
    o = _checks.check_tensor(output, what, tg, "output")
    _checks.check_rows(i, what, tg)
    _checks.check_rows(o, what, tg)
    if o.dtype != i.dtype or o.shape[1:] != i.shape[1:]:
        raise ValueError(f"{tg.where(what)}: output {describe(o)} and input {describe(i)} must have "
                         "the same dtype and the same sizes beyond dim 0")
    where = tg.where(what)
    send = split_counts(input_splits, i.shape[0], tg.size, f"{where}: input_splits of input {describe(i)}")
    recv = split_counts(output_splits, o.shape[0], tg.size, f"{where}: output_splits of output {describe(o)}")
    kw: dict[str, Any] = {"send_splits": torch.tensor(send, dtype=torch.int64),
                          "recv_splits": torch.tensor(recv, dtype=torch.int64),
                          "recv_splits_known": True}
    if not i.is_cuda and not o.is_cuda and not _checks.overlap(o, i):
        return Handle(_submit(OpKind.ALLTOALL, i, 0, -1, inline, what, tg, out=o, **kw), lambda _: o)
    return Handle(_submit(OpKind.ALLTOALL, _host(i), 0, -1, inline, what, tg, **kw), o.copy_)


@profiled
def all_to_all_single_async(output: torch.Tensor, input: torch.Tensor, output_splits: Splits = None,
                            input_splits: Splits = None, group: GroupBase | None = None) -> Handle:
    """Starts an all_to_all_single; wait() returns `output`."""
    return _all_to_all_single(output, input, output_splits, input_splits, group,
                              "all_to_all_single_async", False)


@profiled
def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_splits: Splits = None,
                      input_splits: Splits = None, group: GroupBase | None = None) -> torch.Tensor:
    """Sends input_splits[r] rows of `input` to rank r, receiving output_splits[r] rows from rank r
    into `output` (equal blocks for None), and returns `output`."""
    return _all_to_all_single(output, input, output_splits, input_splits, group,
                              "all_to_all_single", True).wait()
