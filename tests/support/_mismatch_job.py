"""The mismatch job through torchring's API, on any device: tests/spawned/api/test_mismatch.py
runs it on CPU tensors, tests/gpu/test_cuda_failures.py on CUDA tensors (the staged path).

Every case of _mismatches.MISMATCHES in turn, each followed by an exact allreduce, then async
handles queued behind a mismatched one; check_results() then checks every rank's messages."""

from __future__ import annotations

import time
from typing import Any

import torch

from _checks import Checker, expected_allreduce, rank_input
from _mismatches import ASYNC_CASE, MISMATCHES, Call, expected_pair, message_problem

# Every case with the async one, as (calls that agree, the odd rank's calls, words the error names).
CASES = {**MISMATCHES, "async": (*ASYNC_CASE, ["float32[8]", "float32[7]"])}


def issue(call: Call, rank: int, world: int, dev: torch.device) -> Any:
    """One call of a mismatch case, its tensor on `dev`."""
    import torchring

    kind, dtype, shape, op, src = call
    numel = 1
    for d in shape:
        numel *= d
    t = rank_input(rank, world, numel, dtype, "SUM", shape).to(dev)
    if kind == "allreduce":
        return torchring.allreduce(t, getattr(torchring.ReduceOp, op))
    if kind == "broadcast":
        return torchring.broadcast(t, min(src, world - 1))
    if kind == "reduce_scatter":
        return torchring.reduce_scatter(t)
    if kind == "barrier":
        return torchring.barrier()
    return torchring.allgather(t)


def exact_allreduce(chk: Checker, rank: int, world: int, dev: torch.device, what: str) -> None:
    """An allreduce on `dev` that must be exact (the communicator is still usable)."""
    import torchring

    t = rank_input(rank, world, 300, torch.float32).to(dev)
    torchring.allreduce(t)
    chk.equal(what, t.cpu(), expected_allreduce(world, 300, torch.float32, "SUM"))


def run_cases(chk: Checker, rank: int, world: int, odd: int,
              dev: torch.device) -> tuple[dict[str, list[str | None]], dict[str, float]]:
    """Every case (rank `odd` issues the differing calls), each followed by an exact allreduce,
    then the async case; returns each case's error texts (None: no error) and seconds."""
    import torchring

    errors: dict[str, list[str | None]] = {}
    elapsed: dict[str, float] = {}
    for case, (agree, differ, _) in MISMATCHES.items():
        start, errors[case] = time.monotonic(), []
        for call in differ if rank == odd else agree:  # every call of the case mismatches
            try:
                issue(call, rank, world, dev)
                errors[case].append(None)
            except torchring.CollectiveMismatchError as e:
                errors[case].append(str(e))
        elapsed[case] = time.monotonic() - start
        exact_allreduce(chk, rank, world, dev, f"allreduce after the {case} mismatch")

    # Async: a mismatched handle raises from wait(); the handles queued after it are exact.
    bad = torch.zeros((ASYNC_CASE[1] if rank == odd else ASYNC_CASE[0])[0][2], device=dev)
    first = torchring.allreduce_async(bad)
    second = torchring.allreduce_async(rank_input(rank, world, 500, torch.int64).to(dev))
    third = torchring.allgather_async(torch.full((rank + 1, 2), rank, dtype=torch.int32, device=dev))
    try:
        first.wait()
        errors["async"] = [None]
    except torchring.CollectiveMismatchError as e:
        errors["async"] = [str(e)]
    chk.equal("async allreduce after a mismatched one", second.wait().cpu(),
              expected_allreduce(world, 500, torch.int64, "SUM"))
    want = torch.cat([torch.full((r + 1, 2), r, dtype=torch.int32) for r in range(world)])
    chk.equal("async allgather after a mismatched one", third.wait().cpu(), want)
    return errors, elapsed


def check_results(results: list[dict[str, Any]], odd: int, world: int, slow_s: float, slow_what: str) -> None:
    """Every rank raised for every call of every case, naming rank 0's call and the first
    differing rank's, each case within `slow_s` seconds (else `slow_what` says why it fails);
    and every rank words each verdict alike."""
    for rank, r in enumerate(results):
        assert not r["failures"], "\n".join(r["failures"])
        assert set(r["errors"]) == set(CASES), f"rank {rank}: cases run: {sorted(r['errors'])}"
        for case, (agree, differ, words) in CASES.items():
            errs = r["errors"][case]
            assert len(errs) == len(agree), f"rank {rank}: {case}: {len(errs)} calls recorded"
            for i, err in enumerate(errs):
                problem = message_problem(err, rank, expected_pair(agree, differ, odd, world, i))
                assert problem is None, f"rank {rank}, {case} mismatch, call {i}: {problem}"
                for word in words:
                    assert word in err, f"rank {rank}: {word!r} missing from the {case} error: {err!r}"
        slow = {c: round(t, 1) for c, t in r["elapsed"].items() if t > slow_s}
        assert not slow, f"rank {rank}: {slow_what}: {slow}"
    # Every rank holds the same table of headers, so every rank words the verdict the same way.
    for case in CASES:
        for i in range(len(CASES[case][0])):
            bodies = {r["errors"][case][i].split(": ", 1)[1] for r in results}
            assert len(bodies) == 1, f"{case} call {i}: the ranks disagree: {sorted(bodies)}"
