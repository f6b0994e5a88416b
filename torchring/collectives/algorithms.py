"""Which algorithm runs among hosts, and the cost model that chose it.

    torchring.algorithm(torch.empty(2048))   # "doubling" on 16 hosts, "" on one host
    torchring.link_cost()                    # {"alpha": 2.1e-4, "beta": 8.1e-9, "gamma": 2e-10, "alpha_group": 3e-4}

The leaders measure their links when they connect (alpha: seconds per step, beta: seconds per
byte, gamma: seconds per byte reduced; the job takes the largest of each), and every allreduce
across hosts runs the algorithm its cost model predicts fastest for its size, unless
TORCHRING_ALGO forces one (docs/algorithms.md).
"""

from __future__ import annotations

import torch

from .._core.group_wiring import GroupBase, target

__all__ = ["algorithm", "link_cost"]


def algorithm(tensor: torch.Tensor, group: GroupBase | None = None) -> str:
    """The algorithm among hosts an allreduce of `tensor` runs ("ring", "doubling", "rabenseifner[:K]", "radix4", "multiplying"; "" on one host)."""
    return target(group, "algorithm").comm.allreduce_algorithm(tensor)


def link_cost(group: GroupBase | None = None) -> dict[str, float]:
    """The cost model's agreed figures: alpha (s/step), beta (s/byte), gamma (s/byte reduced), alpha_group."""
    alpha, beta, gamma, alpha_group = target(group, "link_cost").comm.link_cost
    return {"alpha": alpha, "beta": beta, "gamma": gamma, "alpha_group": alpha_group}
