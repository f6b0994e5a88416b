"""Collective mismatches: every rank raises CollectiveMismatchError, and the job goes on.

Ranks that issue different collectives as one operation (another count, shape, dtype, op, root
or kind) are found by the header exchange before any data moves. Each case below is followed
by an exact collective in the same session, on shared memory, TCP and both (faked hosts), at
worlds 2-4, with the odd rank first, last or in the middle; async handles too. Every rank's
error must name exactly rank 0's call and the first differing rank's call.
(tests/engine/test_engine_mismatch.py runs the same cases in process, with heavier follow-ups.)
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from _checks import Checker, expected_allreduce, rank_input
from _dist import hybrid_env, session, spawn
from _mismatches import ASYNC_CASE, MISMATCHES, Call, expected_pair, message_problem

def _issue(call: Call, rank: int, world: int) -> Any:
    import torchring

    kind, dtype, shape, op, src = call
    numel = 1
    for d in shape:
        numel *= d
    t = rank_input(rank, world, numel, dtype, "SUM", shape)
    if kind == "allreduce":
        return torchring.allreduce(t, getattr(torchring.ReduceOp, op))
    if kind == "broadcast":
        return torchring.broadcast(t, min(src, world - 1))
    if kind == "reduce_scatter":
        return torchring.reduce_scatter(t)
    if kind == "barrier":
        return torchring.barrier()
    return torchring.allgather(t)


def _exact_allreduce(chk: Checker, rank: int, world: int, what: str) -> None:
    import torchring

    t = rank_input(rank, world, 300, torch.float32)
    torchring.allreduce(t)
    chk.equal(what, t, expected_allreduce(world, 300, torch.float32, "SUM"))


def _mismatch_job(rank: int, odd: int) -> dict[str, Any]:
    """Every case in turn, each followed by an exact allreduce; then async handles."""
    import torchring

    chk = Checker(rank)
    with session():
        world = torchring.size()
        errors: dict[str, list[str | None]] = {}
        elapsed: dict[str, float] = {}
        _exact_allreduce(chk, rank, world, "before any mismatch")
        for case, (agree, differ, _) in MISMATCHES.items():
            start, errors[case] = time.monotonic(), []
            for call in differ if rank == odd else agree:  # every call of the case mismatches
                try:
                    _issue(call, rank, world)
                    errors[case].append(None)
                except torchring.CollectiveMismatchError as e:
                    errors[case].append(str(e))
            elapsed[case] = time.monotonic() - start
            _exact_allreduce(chk, rank, world, f"allreduce after the {case} mismatch")

        # Async: a mismatched handle raises from wait(); the handles queued after it are exact.
        bad = torch.zeros((ASYNC_CASE[1] if rank == odd else ASYNC_CASE[0])[0][2])
        first = torchring.allreduce_async(bad)
        good = rank_input(rank, world, 500, torch.int64)
        second = torchring.allreduce_async(good)
        third = torchring.allgather_async(torch.full((rank + 1, 2), rank, dtype=torch.int32))
        try:
            first.wait()
            errors["async"] = [None]
        except torchring.CollectiveMismatchError as e:
            errors["async"] = [str(e)]
        chk.equal("async allreduce after a mismatched one", second.wait(),
                  expected_allreduce(world, 500, torch.int64, "SUM"))
        want = torch.cat([torch.full((r + 1, 2), r, dtype=torch.int32) for r in range(world)])
        chk.equal("async allgather after a mismatched one", third.wait(), want)
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
    cases = {**MISMATCHES, "async": (*ASYNC_CASE, ["float32[8]", "float32[7]"])}
    for rank, r in enumerate(results):
        assert not r["failures"], "\n".join(r["failures"])
        assert set(r["errors"]) == set(cases), f"rank {rank}: cases run: {sorted(r['errors'])}"
        for case, (agree, differ, words) in cases.items():
            errs = r["errors"][case]
            assert len(errs) == len(agree), f"rank {rank}: {case}: {len(errs)} calls recorded"
            for i, err in enumerate(errs):
                problem = message_problem(err, rank, expected_pair(agree, differ, odd, world, i))
                assert problem is None, f"rank {rank}, {case} mismatch, call {i}: {problem}"
                for word in words:
                    assert word in err, f"rank {rank}: {word!r} missing from the {case} error: {err!r}"
        slow = {c: round(t, 1) for c, t in r["elapsed"].items() if t > 5}
        assert not slow, f"rank {rank}: mismatches took seconds to detect: {slow}"
    # Every rank holds the same table of headers, so every rank words the verdict the same way.
    for case in cases:
        for i in range(len(cases[case][0])):
            bodies = {r["errors"][case][i].split(": ", 1)[1] for r in results}
            assert len(bodies) == 1, f"{case} call {i}: the ranks disagree: {sorted(bodies)}"
