"""Exact evaluation numbers across ranks: gather per-sample results in dataset order, or
sum metric counts. Call these after the evaluation loop, on every rank."""

from __future__ import annotations

import torch

from ..collectives import basic as collectives
from .sampler import DistributedSampler

__all__ = ["gather_ordered", "all_reduce_metrics"]


def gather_ordered(values: torch.Tensor, sampler: DistributedSampler) -> torch.Tensor:
    """Every rank's per-sample `values` (rows in this rank's sampler order), one row per dataset index."""
    indices = torch.tensor(sampler.indices(), dtype=torch.int64)
    if values.shape[0] != indices.numel():
        raise ValueError(f"rank {sampler.rank}: values has {values.shape[0]} rows but the sampler gave "
                         f"this rank {indices.numel()} samples; pass one row per sample, in order")
    if sampler.drop_last:
        raise ValueError(f"rank {sampler.rank}: the sampler drops samples (drop_last=True), so some "
                         "dataset rows would have no value; evaluate with DistributedSampler(exact=True)")
    all_values = collectives.allgather(values.contiguous())
    all_indices = collectives.allgather(indices).to(all_values.device)
    out = torch.empty((len(sampler.dataset), *values.shape[1:]), dtype=values.dtype, device=values.device)
    out[all_indices] = all_values  # padded duplicates write the same sample twice
    return out


def all_reduce_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Sums each metric (counts, loss totals) over ranks; returns the job-wide totals."""
    names = sorted(metrics)
    everyone = collectives.allgather_object(names)
    for rank, theirs in enumerate(everyone):
        if theirs != names:
            raise ValueError(f"all_reduce_metrics: this rank has metrics {names}, rank {rank} has "
                             f"{theirs}; every rank must report the same names (use 0 for none)")
    totals = torch.tensor([float(metrics[k]) for k in names], dtype=torch.float64)
    collectives.allreduce(totals)
    return dict(zip(names, totals.tolist()))
