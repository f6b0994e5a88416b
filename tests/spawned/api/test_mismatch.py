"""Collective mismatches: every rank raises CollectiveMismatchError, and the job goes on.

Ranks that issue different collectives as one operation (another count, shape, dtype, op, root
or kind) are found by the header exchange before any data moves. Each case below is followed
by an exact collective in the same session, on shared memory, TCP and both (faked hosts), at
worlds 2-4, with the odd rank first, last or in the middle; async handles too. Every rank's
error must name exactly rank 0's call and the first differing rank's call.
(tests/engine/test_engine_mismatch.py runs the same cases in process, with heavier follow-ups.)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _checks import Checker
from _dist import hybrid_env, session, spawn
from _mismatch_job import check_results, exact_allreduce, run_cases

def _mismatch_job(rank: int, odd: int) -> dict[str, Any]:
    """An exact allreduce, then every case in turn, each followed by an exact allreduce; then
    async handles (_mismatch_job.run_cases)."""
    import torchring

    chk = Checker(rank)
    with session():
        world = torchring.size()
        cpu = torch.device("cpu")
        exact_allreduce(chk, rank, world, cpu, "before any mismatch")
        errors, elapsed = run_cases(chk, rank, world, odd, cpu)
    return {"errors": errors, "elapsed": elapsed, "failures": chk.failures}


CONFIGS = {  # name -> (world, env for every rank, per-rank env)
    "shm-2": (2, {"TORCHRING_TRANSPORT": "shm"}, None),
    "shm-3": (3, {"TORCHRING_TRANSPORT": "shm"}, None),
    "shm-4": (4, {"TORCHRING_TRANSPORT": "shm"}, None),
    "tcp-2": (2, {"TORCHRING_TRANSPORT": "tcp"}, None),
    "tcp-3": (3, {"TORCHRING_TRANSPORT": "tcp"}, None),
    "tcp-4": (4, {"TORCHRING_TRANSPORT": "tcp"}, None),
    "hybrid-abb": (3, {}, hybrid_env("abb")),
    "hybrid-aabb": (4, {}, hybrid_env("aabb")),
}


@pytest.mark.parametrize("config,odd", [("shm-2", 1), ("shm-3", 0), ("shm-4", 2), ("tcp-2", 0),
                                        ("tcp-3", 2), ("tcp-4", 1), ("hybrid-abb", 0),
                                        ("hybrid-aabb", 3)])
def test_mismatch_raises_everywhere_and_job_goes_on(config: str, odd: int) -> None:
    world, env, rank_env = CONFIGS[config]
    results = spawn(world, _mismatch_job, odd, env={**env, "TORCHRING_TIMEOUT": "20"},
                    rank_env=rank_env)
    check_results(results, odd, world, 5, "mismatches took seconds to detect")
