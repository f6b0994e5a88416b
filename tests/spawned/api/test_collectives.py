"""broadcast, allgather, reduce_scatter, barrier and the object collectives on worlds 1-4.

One spawned job per (world, transport) runs every case in :func:`_collective_cases`; results are
compared with single-process torch references built from every rank's deterministic input.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from _checks import Checker, assert_no_failures, check_transport, expected_allreduce, rank_input
from _dist import hybrid_env, session, spawn

ROWS = [0, 3, 1, 2]  # allgather rows per rank: dim 0 differs, rank 0 contributes nothing
BIG = 2**18 + 1


def _rows_input(rank: int, world: int, rows: int, dtype: torch.dtype, inner: tuple[int, ...]) -> torch.Tensor:
    numel = rows * (inner[0] * inner[1] if inner else 1)
    return rank_input(rank, world, numel, dtype, "SUM", (rows, *inner))


def _check_topology(chk: Checker) -> None:
    import torchring

    env = os.environ
    got = (torchring.is_initialized(), torchring.rank(), torchring.size(), torchring.local_rank(),
           torchring.local_size())
    want = (True, *(int(env[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")))
    chk.true("(is_initialized, rank, size, local_rank, local_size)", got == want,
             f"got {got}, expected {want}")


def _check_broadcast(chk: Checker, rank: int, world: int) -> None:
    import torchring

    specs = [(torch.float32, 1000), (torch.int64, 7), (torch.bfloat16, 1), (torch.uint8, 0),
             (torch.float16, 33)]
    for src in range(world):
        for dtype, n in specs:
            t = rank_input(rank, world, n, dtype)
            out = torchring.broadcast(t, src=src)
            what = f"broadcast({dtype}[{n}], src={src})"
            chk.true(what, out is t, "did not return its input tensor")
            chk.equal(what, t, rank_input(src, world, n, dtype))
    t = rank_input(rank, world, BIG, torch.float32, shape=(BIG, 1))
    torchring.broadcast(t, world - 1)
    want = rank_input(world - 1, world, BIG, torch.float32, shape=(BIG, 1))
    chk.equal(f"broadcast(float32[{BIG}, 1], src={world - 1})", t, want)
    t = rank_input(rank, world, 10, torch.int32)
    torchring.broadcast(t)
    chk.equal("broadcast with the default src", t, rank_input(0, world, 10, torch.int32))


def _check_allgather(chk: Checker, rank: int, world: int) -> None:
    import torchring

    cases = [(torch.float32, (2, 3), ROWS), (torch.int8, (), ROWS), (torch.bfloat16, (1, 5), ROWS),
             (torch.float64, (), [1000] * 4), (torch.int64, (4, 1), [0] * 4), (torch.float32, (), [BIG] * 4)]
    for dtype, inner, rows in cases:
        t = _rows_input(rank, world, rows[rank], dtype, inner)
        before = t.clone()
        out = torchring.allgather(t)
        want = torch.cat([_rows_input(r, world, rows[r], dtype, inner) for r in range(world)])
        what = f"allgather({dtype}{[rows[rank], *inner]}) rows per rank {rows[:world]}"
        chk.equal(what, out, want)
        chk.equal(what + " leaves its input alone", t, before)


def _check_reduce_scatter(chk: Checker, rank: int, world: int) -> None:
    import torchring
    from torchring import ReduceOp

    cases = [(torch.float32, "SUM", m, 3) for m in (0, 1, 3)] + [
        (torch.int32, "MAX", 2, 1), (torch.bfloat16, "AVG", 5, 2), (torch.uint8, "PRODUCT", 4, 1),
        (torch.float64, "MIN", 1, 7), (torch.float32, "SUM", BIG, 1)]
    for dtype, op, m, k in cases:
        shape = (world * m, k) if k > 1 else (world * m,)
        t = rank_input(rank, world, world * m * k, dtype, op, shape)
        before = t.clone()
        out = torchring.reduce_scatter(t, getattr(ReduceOp, op))
        want = expected_allreduce(world, world * m * k, dtype, op, shape)[rank * m:(rank + 1) * m]
        what = f"reduce_scatter({dtype}{list(shape)}, {op})"
        chk.equal(what, out, want, exact=op != "AVG")
        chk.equal(what + " leaves its input alone", t, before)
    t = rank_input(rank, world, world * 6, torch.float32)
    want = expected_allreduce(world, world * 6, torch.float32, "SUM")[rank * 6:(rank + 1) * 6]
    chk.equal("reduce_scatter with the default op", torchring.reduce_scatter(t), want)


def _check_async(chk: Checker, rank: int, world: int) -> None:
    """Several outstanding async collectives of different kinds, waited for in issue order."""
    import torchring
    from torchring import ReduceOp

    src = world - 1
    b = rank_input(rank, world, 500, torch.float32)
    g = _rows_input(rank, world, ROWS[rank], torch.int32, (2, 2))
    s = rank_input(rank, world, world * 4, torch.float64, "MAX")
    a = rank_input(rank, world, 300, torch.bfloat16)
    handles = [torchring.broadcast_async(b, src), torchring.allgather_async(g),
               torchring.reduce_scatter_async(s, ReduceOp.MAX), torchring.allreduce_async(a, ReduceOp.SUM)]
    wants = [rank_input(src, world, 500, torch.float32),
             torch.cat([_rows_input(r, world, ROWS[r], torch.int32, (2, 2)) for r in range(world)]),
             expected_allreduce(world, world * 4, torch.float64, "MAX")[rank * 4:(rank + 1) * 4],
             expected_allreduce(world, 300, torch.bfloat16, "SUM")]
    names = ["broadcast_async", "allgather_async", "reduce_scatter_async", "allreduce_async"]
    for name, handle, want in zip(names, handles, wants):
        out = handle.wait(timeout=60)
        chk.equal(name, out, want)
        chk.true(name, handle.is_completed() is True, "is_completed() is not True after wait()")
    chk.true("broadcast_async", handles[0].wait() is b, "wait() did not return the input tensor")


def _check_barrier(chk: Checker, rank: int, world: int) -> None:
    """No rank may leave a barrier before the last one (which arrives 0.2 s per rank later) entered."""
    import torchring

    for _ in range(3):
        torchring.barrier()
    time.sleep(0.2 * rank)
    enter = time.time()
    torchring.barrier()
    leave = time.time()
    times = torchring.allgather_object((enter, leave))
    last_enter = max(e for e, _ in times)
    chk.true("barrier", all(l >= last_enter - 0.005 for _, l in times),
             f"a rank left before rank {max(range(world), key=lambda r: times[r][0])} entered: {times}")


def _check_objects(chk: Checker, rank: int, world: int) -> None:
    import torchring

    def obj(r: int) -> dict:
        return {"rank": r, "blob": bytes([r % 256]) * (50_000 * r), "list": list(range(r)), "none": None,
                "nested": {"t": (r, str(r))}}

    for src in range(world):
        mine = obj(rank) if rank == src or src % 2 == 0 else None
        got = torchring.broadcast_object(mine, src=src)
        chk.true(f"broadcast_object(src={src})", got == obj(src), f"got {str(got)[:200]}")
    got = torchring.allgather_object(obj(rank))
    chk.true("allgather_object", got == [obj(r) for r in range(world)], f"got {str(got)[:200]}")
    t = rank_input(rank, world, 5, torch.float16)
    got = torchring.allgather_object(t)
    chk.true("allgather_object(tensor)", isinstance(got, list) and len(got) == world and all(
        torch.equal(g, rank_input(r, world, 5, torch.float16)) for r, g in enumerate(got)), f"got {got}")


def _check_scaled_arena(chk: Checker, rank: int, world: int) -> None:
    """A prescale on tensors in the shared-memory arena (the zero-copy path reads peers' tensors
    directly, so each rank must have scaled its own before any peer reads it)."""
    import torchring
    from torchring import ReduceOp

    for n in (37, 1000, 70_000):
        for op, pre, post in ((ReduceOp.SUM, 0.5, 1.0), (ReduceOp.AVG, 0.25, 4.0), (ReduceOp.SUM, 2.0, 0.5)):
            x = torchring.empty(n)
            x.copy_(torch.arange(n, dtype=torch.float32) * (rank + 1))
            torchring.allreduce(x, op, pre, post)
            total = sum(torch.arange(n, dtype=torch.float32) * (r + 1) * pre for r in range(world))
            want = total * post / (world if op == ReduceOp.AVG else 1)
            chk.equal(f"allreduce(torchring.empty({n}), {op.name}, prescale={pre}, postscale={post})", x, want)


def _collective_cases(rank: int) -> list[str]:
    """Run every collective check inside one torchring session; return the mismatches."""
    import torchring

    with session():
        world = torchring.size()
        chk = Checker(rank)
        _check_topology(chk)
        check_transport(chk)
        for check in (_check_broadcast, _check_allgather, _check_reduce_scatter, _check_async,
                      _check_barrier, _check_objects, _check_scaled_arena):
            check(chk, rank, world)
        return chk.failures


def test_world1() -> None:
    assert_no_failures(spawn(1, _collective_cases))


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_collectives(transport: str, world: int) -> None:
    assert_no_failures(spawn(world, _collective_cases, env={"TORCHRING_TRANSPORT": transport}))


def test_hybrid() -> None:
    assert_no_failures(spawn(4, _collective_cases, rank_env=hybrid_env("aabb")))


def test_rank0_hosts_store() -> None:
    assert_no_failures(spawn(3, _collective_cases, env={"TORCHRING_TRANSPORT": "tcp"}, host_store=False))
