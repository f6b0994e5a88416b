"""What the training-step benchmarks share: DDP with no communication (the floor), the flat
parameters and their cross-rank check, and the median of per-round step ratios."""

from __future__ import annotations

import statistics
from typing import Any

import torch
from torch import nn

__all__ = ["no_comm", "flat_params", "differing_between_ranks", "ratio"]


def no_comm(model: Any) -> Any:
    """DDP whose communication hook returns each bucket untouched (dense or sparse): DDP's own
    cost with no allreduce, the floor of any DDP backend."""
    def hook(_state, bucket):  # no annotations: DDP checks them against the real classes, not strings
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    model.register_comm_hook(None, hook)
    return model


def flat_params(model: nn.Module) -> torch.Tensor:
    """The model's full parameters (a DTensor's gathered), in order, as one flat tensor (a copy)."""
    from torch.distributed.tensor import DTensor

    return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach().reshape(-1)
                      for p in model.parameters()])


def differing_between_ranks(flat: torch.Tensor, group: Any) -> int:
    """Elements of `flat` not bitwise equal on every rank of `group` (the same on every rank)."""
    import torch.distributed as dist

    low, high = flat.clone(), flat.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    return int((low != high).sum())


def ratio(rows: list[dict], a: str, b: str, key: str = "step_s") -> float | None:
    """Median over rounds of time a / time b in rows[i][key] (None when either did not run)."""
    pairs = [(r[key][a], r[key][b]) for r in rows if a in r[key] and b in r[key]]
    return statistics.median(x / y for x, y in pairs) if pairs else None
