"""Collective mismatches: every rank raises CollectiveMismatchError, and the job goes on.

Ranks that issue different collectives as one operation (another count, shape, dtype, op, root
or kind) are found by the header exchange before any data moves. Each case below is followed
by an exact collective in the same session, on shared memory, TCP and both (faked hosts), at
worlds 2-4, with the odd rank first, last or in the middle; async handles too. Every rank's
error must name exactly rank 0's call and the first differing rank's call.
(tests/engine/test_engine_mismatch.py runs the same cases in process, with heavier follow-ups.)
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
import torch

from _checks import Checker, expected_allreduce, rank_input
from _dist import hybrid_env, session, spawn
from torchring._core.types import dtype_name

# One collective call: (kind, dtype, shape, op, src).
Call = tuple[str, torch.dtype, tuple[int, ...], str, int]
_AR: Call = ("allreduce", torch.float32, (1000,), "SUM", 0)
_AG: Call = ("allgather", torch.float32, (2, 3), "SUM", 0)
# case -> (calls of the ranks that agree, calls of the odd rank, words the error must contain)
MISMATCHES: dict[str, tuple[list[Call], list[Call], list[str]]] = {
    "count": ([_AR], [("allreduce", torch.float32, (999,), "SUM", 0)], ["float32[1000]", "float32[999]"]),
    "shape": ([("allreduce", torch.float32, (10, 100), "SUM", 0)],
              [("allreduce", torch.float32, (100, 10), "SUM", 0)], ["[10, 100]", "[100, 10]"]),
    "dtype": ([_AR], [("allreduce", torch.float64, (1000,), "SUM", 0)], ["float32", "float64"]),
    "op": ([_AR], [("allreduce", torch.float32, (1000,), "MAX", 0)], ["SUM", "MAX"]),
    "root": ([("broadcast", torch.float32, (10,), "SUM", 0)],
             [("broadcast", torch.float32, (10,), "SUM", 1)], ["root=0", "root=1"]),
    "broadcast_shape": ([("broadcast", torch.int64, (4, 6), "SUM", 0)],
                        [("broadcast", torch.int64, (6, 4), "SUM", 0)], ["int64[4, 6]", "int64[6, 4]"]),
    "kind": ([_AR], [("broadcast", torch.float32, (1000,), "SUM", 0)], ["allreduce", "broadcast"]),
    "order": ([_AR, _AG], [_AG, _AR], ["allreduce", "allgather"]),
    "allgather_rows": ([_AG], [("allgather", torch.float32, (2, 4), "SUM", 0)],
                       ["float32[2, 3]", "float32[2, 4]"]),
    # dim 0 of 12 and 24 rows divides every world size used here
    "reduce_scatter_shape": ([("reduce_scatter", torch.int32, (12, 2), "SUM", 0)],
                             [("reduce_scatter", torch.int32, (24, 1), "SUM", 0)],
                             ["int32[12, 2]", "int32[24, 1]"]),
    "barrier": ([("barrier", torch.float32, (), "SUM", 0)], [_AR], ["barrier", "allreduce"]),
}
# The async case: a 7-element allreduce on the odd rank, 8 elements on the others.
ASYNC_CASE: tuple[list[Call], list[Call]] = ([("allreduce", torch.float32, (8,), "SUM", 0)],
                                             [("allreduce", torch.float32, (7,), "SUM", 0)])


def call_text(call: Call, world: int) -> str:
    """How a mismatch error names one call: kind, dtype[shape], then the op or the root."""
    kind, dtype, shape, op, src = call
    if kind == "barrier":
        return "barrier"
    text = f"{kind} {dtype_name(dtype)}{list(shape)}"
    if kind in ("allreduce", "reduce_scatter"):
        text += f" {op}"
    elif kind == "broadcast":
        text += f" root={min(src, world - 1)}"
    return text


def expected_pair(agree: list[Call], differ: list[Call], odd: int, world: int,
                  i: int) -> tuple[int, str, str]:
    """(first differing rank, rank 0's call, that rank's call) for the i-th call of a case."""
    first = odd if odd != 0 else 1  # the lowest rank whose header differs from rank 0's
    mine = differ if odd == 0 else agree
    theirs = differ if odd != 0 else agree
    return first, call_text(mine[i], world), call_text(theirs[i], world)


_SENT = re.compile(r"rank (\d+) sent ")


def message_problem(err: str | None, rank: int, pair: tuple[int, str, str]) -> str | None:
    """What is wrong with rank `rank`'s mismatch message, or None if it names exactly `pair`."""
    if err is None:
        return "no CollectiveMismatchError"
    first, mine, theirs = pair
    if not err.startswith(f"rank {rank}: "):
        return f"the message does not start with 'rank {rank}: ': {err!r}"
    want = f"rank 0 sent {mine}, rank {first} sent {theirs}; "
    if want not in err:
        return f"expected it to contain {want!r}: {err!r}"
    named = _SENT.findall(err)
    if named != ["0", str(first)]:
        return f"it names ranks {named} as senders, expected ['0', '{first}']: {err!r}"
    return None


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
