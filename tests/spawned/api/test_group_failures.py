"""Failures are per group: a mismatch in one group leaves the others untouched, and a dead rank
fails every group it belongs to (naming it, within the timeout) while groups without it go on.

World 3 with groups A = [0, 1], B = [1, 2], C = [0, 2]. First ranks 0 and 1 mismatch on A, and
A, C and the world are still exact. Then rank 2 is killed (SIGKILL, no shutdown): rank 0's
collective on C and its recv from rank 2 on C fail, rank 1's collective on B fails, and A still
gives exact sums on ranks 0 and 1. Failures in a group are named with the group (its messages
count group ranks, so rank 2 is "rank 1" of C and of B).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from _dist import hybrid_env, spawn

TIMEOUT = 6.0


def _job(rank: int) -> dict:
    import torchring

    torchring.init()
    a, b, c = torchring.new_group([0, 1]), torchring.new_group([1, 2]), torchring.new_group([0, 2])
    out: dict = {}
    if rank < 2:  # a mismatch on A: different shapes
        try:
            a.allreduce(torch.ones(3 + rank))
            out["mismatch"] = "no error"
        except torchring.CollectiveMismatchError as e:
            out["mismatch"] = str(e)
        out["a_after_mismatch"] = a.allreduce(torch.full((5,), rank + 1)).tolist()
    if rank in (0, 2):
        out["c"] = c.allreduce(torch.full((4,), 10 * (rank + 1))).tolist()
    out["world"] = torchring.allreduce(torch.tensor([rank])).tolist()
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)  # rank 2 is gone now
    group, peer = (c, 1) if rank == 0 else (b, 1)
    start = time.monotonic()
    try:
        group.allreduce(torch.ones(6))
        out["dead"] = "no error"
    except torchring.TorchringError as e:
        out["dead"] = f"{type(e).__name__}: {e}"
    out["dead_s"] = time.monotonic() - start
    if rank == 0:
        try:
            c.recv(torch.empty(2), peer)
            out["recv"] = "no error"
        except torchring.TorchringError as e:
            out["recv"] = f"{type(e).__name__}: {e}"
    out["a_after_death"] = a.allreduce(torch.full((5,), 7 * (rank + 1))).tolist()
    torchring.shutdown()
    return out


@pytest.mark.parametrize("layout", ["shm", "tcp", "hybrid"])
def test_failures_stay_in_their_groups(layout: str) -> None:
    env = {"TORCHRING_TIMEOUT": str(TIMEOUT)}
    rank_env = None
    if layout == "tcp":
        env["TORCHRING_TRANSPORT"] = "tcp"
    elif layout == "hybrid":
        rank_env = hybrid_env("aab")  # rank 2 on another fake host: C and B span hosts
    outcomes = spawn(3, _job, env=env, rank_env=rank_env, timeout=90, expect_fail=True)
    assert outcomes[2].exitcode == -signal.SIGKILL, outcomes[2].describe()
    for o in outcomes[:2]:
        assert o.ok, o.describe()
        r = o.value
        assert "does not match across ranks" in r["mismatch"] and "group 1 of world ranks [0, 1]" in r["mismatch"], r
        assert r["a_after_mismatch"] == [3] * 5, r
        assert r["world"] == [0 + 1 + 2], r
        assert r["dead"].startswith("CommunicatorFailedError: "), (o.rank, r["dead"])
        name = "group 3 of world ranks [0, 2]" if o.rank == 0 else "group 2 of world ranks [1, 2]"
        assert name in r["dead"] and "rank 1" in r["dead"], (o.rank, r["dead"])
        assert r["dead_s"] < TIMEOUT + 5, (o.rank, r["dead_s"])
        assert r["a_after_death"] == [7 + 14] * 5, r
    assert outcomes[0].value["c"] == [10 + 30] * 4
    assert outcomes[0].value["recv"].startswith("CommunicatorFailedError: "), outcomes[0].value["recv"]
