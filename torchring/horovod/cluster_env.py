"""The torchrun environment for ranks that a cluster engine placed (torchring.horovod.ray's actors,
torchring.horovod.spark's barrier tasks): what torchring.init() and hvd.init() read.

Rank r runs on node nodes[r] (any key that is equal for ranks of one host). LOCAL_RANK counts the
ranks of rank r's node that come before it, LOCAL_WORLD_SIZE is how many that node runs, and the
job's store listens at master_addr:master_port (rank 0's node).
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

__all__ = ["rank_environments"]


def rank_environments(nodes: Sequence[str], master_addr: str, master_port: int,
                      extra: dict[str, str]) -> list[dict[str, str]]:
    """Each rank's environment, in rank order: `extra`, then the torchrun variables over it."""
    per_node, before = Counter(nodes), Counter()
    envs = []
    for rank, node in enumerate(nodes):
        envs.append({**extra, "RANK": str(rank), "WORLD_SIZE": str(len(nodes)), "LOCAL_RANK": str(before[node]),
                     "LOCAL_WORLD_SIZE": str(per_node[node]), "MASTER_ADDR": master_addr,
                     "MASTER_PORT": str(master_port)})
        before[node] += 1
    return envs
