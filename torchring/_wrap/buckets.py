"""Gradient buckets: which parameters share a flat buffer, and the views that make each
parameter's ``.grad`` a slice of it.

Assignment walks the parameters in launch order (reverse registration order at first,
the order gradients became ready after the first step) and keeps one open bucket per
(device, dtype). A bucket closes once it holds at least its cap; the first bucket of each
kind gets the small first cap so communication starts early in backward, the rest get
``bucket_cap``. Buckets are numbered by the position of their first parameter, which is
also the order they are launched in on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import memory

__all__ = ["Bucket", "assign", "build", "grad_view", "adopt_grad"]


@dataclass
class Bucket:
    """One flat gradient buffer and the parameters whose gradients live in it."""

    index: int
    params: list[torch.nn.Parameter]
    names: list[str]
    slots: list[int]                 # positions of the params in the Reducer's param list
    buffer: torch.Tensor             # flat gradients; shared memory when on CPU
    views: list[torch.Tensor]        # per param: shaped and strided like the param
    wire: torch.Tensor | None = None  # compressed copy sent instead of `buffer`
    pending: int = 0                 # gradients still to arrive in this backward
    handle: Any = None               # in-flight allreduce
    launched_at: float = 0.0
    waited: float = 0.0
    fired: list[bool] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes that travel for this bucket."""
        t = self.wire if self.wire is not None else self.buffer
        return t.numel() * t.element_size()


def assign(sizes: list[tuple[int, torch.device, torch.dtype]], order: list[int],
           first_cap: int, cap: int) -> list[list[int]]:
    """Groups parameter indices (taken in `order`) into buckets; see the module docstring."""
    open_: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    filled: dict[tuple[torch.device, torch.dtype], int] = {}
    closed_count: dict[tuple[torch.device, torch.dtype], int] = {}
    buckets: list[list[int]] = []
    for i in order:
        nbytes, device, dtype = sizes[i]
        key = (device, dtype)
        open_.setdefault(key, []).append(i)
        filled[key] = filled.get(key, 0) + nbytes
        limit = first_cap if closed_count.get(key, 0) == 0 else cap
        if filled[key] >= limit:
            buckets.append(open_.pop(key))
            filled[key] = 0
            closed_count[key] = closed_count.get(key, 0) + 1
    buckets.extend(group for group in open_.values() if group)
    position = {i: n for n, i in enumerate(order)}
    buckets.sort(key=lambda group: position[group[0]])
    return buckets


def _dense(p: torch.Tensor) -> bool:
    """True when p's strides cover exactly numel elements (contiguous in some dim order)."""
    expected = 1
    for size, stride in sorted(zip(p.shape, p.stride()), key=lambda s: s[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def grad_view(buffer: torch.Tensor, offset: int, p: torch.Tensor) -> torch.Tensor:
    """A view of buffer[offset:offset+numel] laid out like `p` (channels_last stays so)."""
    if _dense(p):
        return buffer.as_strided(p.shape, p.stride(), buffer.storage_offset() + offset)
    return buffer[offset:offset + p.numel()].view(p.shape)


def _flat(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer: in shared memory on the CPU (zero-copy transport), on the GPU otherwise."""
    if device.type == "cpu":
        return memory.empty(numel, dtype)
    return torch.empty(numel, dtype=dtype, device=device)


def adopt_grad(p: torch.Tensor, view: torch.Tensor) -> None:
    """Makes `view` p's gradient, copying the gradient in if it lives in another tensor."""
    if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
        with torch.no_grad():
            view.copy_(p.grad)
        p.grad = view


def build(params: list[torch.nn.Parameter], names: list[str], order: list[int],
          first_cap: int, cap: int, compression: torch.dtype | None,
          allocate: Callable[[int, torch.dtype, torch.device], torch.Tensor] | None = None,
          assignment: list[list[int]] | None = None) -> list[Bucket]:
    """Allocates the buckets for `params` (with `allocate`, default: shared memory on the CPU)
    and moves existing gradients into them; `assignment` (index lists, in launch order) replaces
    assign()'s grouping."""
    allocate = allocate or _flat
    sizes = [(p.numel() * p.element_size(), p.device, p.dtype) for p in params]
    buckets = []
    for index, group in enumerate(assignment if assignment is not None
                                  else assign(sizes, order, first_cap, cap)):
        dtype, device = params[group[0]].dtype, params[group[0]].device
        if any((params[i].dtype, params[i].device) != (dtype, device) for i in group):
            raise ValueError(f"bucket {index} mixes dtypes or devices; one bucket holds one kind")
        total = sum(params[i].numel() for i in group)
        buffer = allocate(total, dtype, device)
        buffer.zero_()
        views, offset = [], 0
        for i in group:
            p = params[i]
            view = grad_view(buffer, offset, p)
            adopt_grad(p, view)
            views.append(view)
            offset += p.numel()
        wire = None
        if compression is not None and dtype.is_floating_point and dtype != compression:
            wire = allocate(total, compression, device)
        buckets.append(Bucket(index, [params[i] for i in group], [names[i] for i in group],
                              list(group), buffer, views, wire, pending=len(group),
                              fired=[False] * len(group)))
    return buckets
