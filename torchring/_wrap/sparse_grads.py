"""The sparse gradients of torchring.wrap: nn.Embedding / nn.EmbeddingBag with sparse=True.

Their parameters stay out of the Reducer's dense buckets (a sparse gradient has no fixed place
in a flat buffer). At the end of each synchronized backward, after the dense buckets, every rank
averages each sparse gradient across ranks in registration order with torchring's sparse
allreduce (collectives/sparse.py: shape, indices and values allgathered, then coalesced), all
launched before the first is waited for. A rank whose parameter got no gradient (unused in its
forward) contributes an empty sparse tensor, so every rank runs the same collectives; a rank that
joined (Join) does the same, so the average divides by the initial world size, as for the
dense buckets. Gradients accumulated under no_sync() are summed locally by autograd and
averaged with the next synchronized backward.
"""

from __future__ import annotations

import torch
from torch import nn

from ..collectives import basic as collectives
from .._core.types import ReduceOp

__all__ = ["sparse_parameters", "SparseGrads"]


def sparse_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every embedding of `module` built with sparse=True, in registration order."""
    found = []
    for prefix, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse:
            found += [(f"{prefix}.{n}" if prefix else n, p) for n, p in sub.named_parameters(recurse=False)]
    return found


class SparseGrads:
    """Averages the sparse gradients of a fixed list of parameters across ranks."""

    def __init__(self, named: list[tuple[str, nn.Parameter]]) -> None:
        self.params = [p for _, p in named]
        self.ids = {id(p) for p in self.params}

    def sync(self, shadow: bool = False) -> None:
        """Replaces each trainable parameter's .grad by its average over ranks (`shadow`: a
        joined rank's part, an empty gradient each, results dropped)."""
        handles = []
        for p in self.params:
            if not p.requires_grad:
                continue
            g = None if shadow else p.grad
            if g is None:
                g = torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.int64, device=p.device),
                                            torch.empty(0, *p.shape[1:], dtype=p.dtype, device=p.device), p.shape)
            elif not g.is_sparse:  # set by the user, or accumulated densely
                g = g.to_sparse(1)
            handles.append((p, collectives.allreduce_async(g, ReduceOp.AVG)))
        for p, handle in handles:
            result = handle.wait()
            if not shadow:
                p.grad = result
