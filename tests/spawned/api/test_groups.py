"""Groups and issue #12's collectives through the public API, on spawned ranks.

One job per layout creates groups of every shape (each singleton, the evens, the odds, pairs
that overlap, a pair spanning two fake hosts, the whole world) and runs every collective as a
group method with group ranks, p2p within groups, async collectives of overlapping groups
issued in opposite orders on neighbouring ranks, then destroy(). A second pass runs every new
op on the world. Results are checked against plain torch references built from every rank's
deterministic input (tests/support/_checks.py); the engine tier (tests/engine) sweeps dtypes and sizes.
"""

from __future__ import annotations

import time

import pytest
import torch

from _checks import Checker, assert_no_failures, expected_allreduce, rank_input, reference
from _dist import hybrid_env, session, spawn

BIG = 2**18 + 1  # float32 elements: more than one 1 MiB segment


def _shapes(world: int) -> list[list[int]]:
    shapes = [[r] for r in range(world)] + [list(range(0, world, 2)), list(range(1, world, 2))]
    shapes += [[r, r + 1] for r in range(world - 1)] + [list(range(world))]
    shapes += [[world - 1, 0]] if world > 1 else []
    return [s for s in shapes if s]


def _rows(d0: int, size: int) -> list[torch.Tensor]:
    """Each rank's row indices when d0 rows are split as Horovod's reducescatter does."""
    return list(torch.tensor_split(torch.arange(d0), size))


def _check_group(chk: Checker, g, world: int) -> None:
    """Every collective of `g` on its members; references from the members' world ranks."""
    import torchring
    from torchring import ReduceOp

    members, me, n = list(g.ranks), g.rank(), g.size()
    what = f"group {members}"

    def inp(world_rank: int, numel: int, dtype: torch.dtype = torch.float32, op: str = "SUM",
            shape: tuple[int, ...] | None = None) -> torch.Tensor:
        return rank_input(world_rank, world, numel, dtype, op, shape)

    def ref(numel: int, dtype: torch.dtype, op: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        return reference([inp(r, numel, dtype, op, shape) for r in members], op)

    t = inp(members[me], 1001)
    chk.equal(f"{what} allreduce", g.allreduce(t), ref(1001, torch.float32, "SUM"))
    t = inp(members[me], 5, torch.int16, "MAX")
    chk.equal(f"{what} allreduce int16 MAX", g.allreduce(t, ReduceOp.MAX), ref(5, torch.int16, "MAX"))
    src = n - 1
    t = inp(members[me], 33, torch.int64)
    chk.equal(f"{what} broadcast src={src}", g.broadcast(t, src), inp(members[src], 33, torch.int64))
    got = g.allgather(inp(members[me], 6, shape=(3, 2)))
    chk.equal(f"{what} allgather", got, torch.cat([inp(r, 6, shape=(3, 2)) for r in members]))
    d0 = 2 * n + 1
    rows = _rows(d0, n)[me]
    want = ref(d0 * 2, torch.float32, "SUM", (d0, 2))[rows]
    chk.equal(f"{what} reduce_scatter {d0} rows", g.reduce_scatter(inp(members[me], d0 * 2, shape=(d0, 2))), want)
    out = torch.empty(len(rows), 2)
    g.reduce_scatter_into(out, inp(members[me], d0 * 2, shape=(d0, 2)))
    chk.equal(f"{what} reduce_scatter_into", out, want)
    t = inp(members[me], 8)
    g.reduce(t, dst=src)
    chk.equal(f"{what} reduce dst={src}", t, ref(8, torch.float32, "SUM") if me == src else inp(members[me], 8))
    parts = g.gather(inp(members[me], 4, torch.int32), dst=0)
    if me == 0:
        chk.true(f"{what} gather", parts is not None and len(parts) == n and all(
            torch.equal(p, inp(r, 4, torch.int32)) for p, r in zip(parts, members)), f"got {parts}")
    else:
        chk.true(f"{what} gather off dst", parts is None, f"got {parts}")
    chunks = [inp(100 + r, 3) for r in range(n)] if me == src else None
    chk.equal(f"{what} scatter src={src}", g.scatter(torch.zeros(3), chunks, src), inp(100 + me, 3))
    outs = [torch.zeros(2, dtype=torch.int64) for _ in range(n)]
    g.allgather_into(outs, inp(members[me], 2, torch.int64))
    chk.true(f"{what} allgather_into", all(torch.equal(o, inp(r, 2, torch.int64))
                                           for o, r in zip(outs, members)), f"got {outs}")
    splits = [(me + q) % 3 for q in range(n)]
    x = torch.cat([torch.full(((me + q) % 3,), 1000 * members[me] + q, dtype=torch.int32) for q in range(n)])
    out, received = g.alltoall(x, splits)
    chk.equal(f"{what} alltoall", out, torch.cat([torch.full(((r + me) % 3,), 1000 * members[r] + me,
                                                             dtype=torch.int32) for r in range(n)]))
    chk.true(f"{what} alltoall received splits", received.tolist() == [(r + me) % 3 for r in range(n)],
             f"got {received}")
    many = [inp(members[me], 3), inp(members[me], 4, torch.int64), inp(members[me], 0)]
    g.allreduce_many(many)
    chk.true(f"{what} allreduce_many", all(torch.equal(a, b) for a, b in zip(many, [
        ref(3, torch.float32, "SUM"), ref(4, torch.int64, "SUM"), ref(0, torch.float32, "SUM")])))
    g.barrier()
    chk.true(f"{what} allgather_object", g.allgather_object(members[me]) == members)
    chk.true(f"{what} broadcast_object", g.broadcast_object(members[me] if me == src else None, src) == members[src])
    if n > 1:  # a ring pass within the group: group ranks, not world ranks
        right, left = (me + 1) % n, (me - 1) % n
        h = g.isend(inp(members[me], 50), right, tag=3)
        got = g.recv(torch.empty(50), left, tag=3)
        h.wait()
        chk.equal(f"{what} ring pass", got, inp(members[left], 50))


def _groups_job(rank: int) -> list[str]:
    import torchring

    with session():
        world = torchring.size()
        chk = Checker(rank)
        groups = [torchring.new_group(s) for s in _shapes(world)]
        chk.true("ids", [g.id for g in groups] == list(range(1, len(groups) + 1)))
        for g in groups:
            if g.is_member:
                _check_group(chk, g, world)
            else:
                chk.true(f"non-member rank of {g.ranks}", g.rank() == -1)
                try:
                    g.allreduce(torch.ones(1))
                    chk.fail(f"group {list(g.ranks)} on a non-member", "did not raise")
                except ValueError as e:
                    chk.true("non-member message", f"rank {rank} is not a member" in str(e), str(e))
        _check_group(chk, torchring.world_group(), world)
        if world >= 3:  # overlapping groups, async, issued in opposite orders on neighbours
            a, b = torchring.new_group([0, 1, 2]), torchring.new_group([1, 2])
            if a.is_member and b.is_member:
                ta, tb = rank_input(rank, world, 300, torch.float32), rank_input(rank, world, 200, torch.int32)
                first = [(a, ta), (b, tb)] if rank % 2 else [(b, tb), (a, ta)]
                handles = [g.allreduce_async(t) for g, t in first]
                for h in handles:
                    h.wait(timeout=60)
                chk.equal("interleaved a", ta, reference([rank_input(r, world, 300, torch.float32) for r in (0, 1, 2)], "SUM"))
                chk.equal("interleaved b", tb, reference([rank_input(r, world, 200, torch.int32) for r in (1, 2)], "SUM"))
            elif a.is_member:
                t = rank_input(rank, world, 300, torch.float32)
                a.allreduce(t)
        g = next(g for g in groups if g.size() == world and g.size() > 1) if world > 1 else groups[0]
        g.destroy()
        try:
            g.barrier()
            chk.fail("barrier after destroy()", "did not raise")
        except RuntimeError as e:
            chk.true("destroyed message", "destroyed" in str(e), str(e))
        t = rank_input(rank, world, 100, torch.float32)
        torchring.allreduce(t)
        chk.equal("world allreduce after the groups", t, expected_allreduce(world, 100, torch.float32, "SUM"))
        return chk.failures


def test_groups_world1() -> None:
    assert_no_failures(spawn(1, _groups_job))


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_groups(transport: str, world: int) -> None:
    assert_no_failures(spawn(world, _groups_job, env={"TORCHRING_TRANSPORT": transport}))


def test_groups_hybrid() -> None:  # [1, 2] and [3, 0] span the two fake hosts
    assert_no_failures(spawn(4, _groups_job, rank_env=hybrid_env("aabb")))


def _world_ops_job(rank: int) -> list[str]:
    """Every new op on the world through the module functions, multi-segment where it matters."""
    import torchring
    from torchring import ReduceOp

    with session():
        world, chk = torchring.size(), Checker(rank)
        t = rank_input(rank, world, BIG, torch.float32)
        torchring.allreduce(t, prescale_factor=0.5, postscale_factor=4.0)
        want = (expected_allreduce(world, BIG, torch.float32, "SUM").to(torch.float64) * 2).float()
        chk.equal("allreduce with factors", t, want)
        for dst in range(world):
            t = rank_input(rank, world, BIG, torch.float32, "MIN")
            torchring.reduce(t, dst, ReduceOp.MIN)
            chk.equal(f"reduce dst={dst}", t, expected_allreduce(world, BIG, torch.float32, "MIN")
                      if rank == dst else rank_input(rank, world, BIG, torch.float32, "MIN"))
        parts = torchring.gather(torch.tensor(rank * 3), dst=world - 1)
        if rank == world - 1:
            chk.true("gather of scalars", [p.item() for p in parts] == [r * 3 for r in range(world)], f"{parts}")
        d0 = 3 * world + 2
        t = rank_input(rank, world, d0, torch.float16, "SUM", (d0,))
        got = torchring.reduce_scatter(t)
        chk.equal(f"reduce_scatter {d0} rows", got, expected_allreduce(world, d0, torch.float16, "SUM")[_rows(d0, world)[rank]])
        big = torch.full((BIG,), float(rank))
        out, received = torchring.alltoall(big.repeat(world), None)
        chk.true("alltoall equal splits", received.tolist() == [BIG] * world, f"{received}")
        chk.equal("alltoall equal blocks", out, torch.arange(world, dtype=torch.float32).repeat_interleave(BIG))
        inp = torch.arange(world * 2, dtype=torch.int64) + 100 * rank
        outp = torch.empty(world * 2, dtype=torch.int64)
        torchring.all_to_all_single(outp, inp)
        chk.equal("all_to_all_single", outp, torch.cat([torch.arange(2 * rank, 2 * rank + 2) + 100 * r for r in range(world)]))
        if world > 1:
            peer = (rank + 1) % world if rank % 2 == 0 else (rank - 1) % world
            if not (world % 2 and rank == world - 1):
                msg = rank_input(rank, world, BIG, torch.float32)
                recv = torch.empty(BIG)
                h1, h2 = torchring.irecv(recv, peer, tag=9), torchring.isend(msg, peer, tag=9)
                h2.wait(timeout=60)
                chk.equal("isend/irecv pair", h1.wait(timeout=60), rank_input(peer, world, BIG, torch.float32))
            # From any source: rank 0 takes every other rank's message, each naming its sender.
            if rank == 0:
                senders = []
                for _ in range(world - 1):
                    h = torchring.irecv(torch.empty(BIG), tag=11)
                    got = h.wait(timeout=60)
                    senders.append(h.source_rank())
                    chk.equal(f"irecv(src=None) from rank {senders[-1]}", got,
                              rank_input(senders[-1], world, BIG, torch.float32))
                chk.true("irecv(src=None): one message per sender", sorted(senders) == list(range(1, world)),
                         f"{senders}")
            else:
                torchring.send(rank_input(rank, world, BIG, torch.float32), 0, tag=11)
        flags = torch.tensor([rank % 2 == 0, True, False])
        torchring.allreduce(flags, ReduceOp.MAX)
        chk.true("bool MAX after", flags.tolist() == [True, True, False], f"got {flags}")
        return chk.failures


@pytest.mark.parametrize("world", [1, 3, 4])
def test_world_ops(world: int) -> None:
    assert_no_failures(spawn(world, _world_ops_job))


def _shm_mappings() -> int:
    with open("/proc/self/maps") as maps:
        return sum("/dev/shm" in line for line in maps)


def _init_shutdown_cycles_job(rank: int) -> list[int]:
    """Mappings of shared memory left after each init/shutdown with the world group used and
    the garbage collector off: shutdown() must release them without a gc pass."""
    import gc

    import torchring

    gc.disable()
    left = []
    for _ in range(3):
        torchring.init()
        torchring.world_group().allreduce(torch.ones(4))
        torchring.shutdown()
        left.append(_shm_mappings())
    return left


def test_shutdown_releases_shared_memory_without_gc() -> None:
    for rank, left in enumerate(spawn(2, _init_shutdown_cycles_job)):
        assert left == [0, 0, 0], f"rank {rank}: /dev/shm mappings left after each shutdown: {left}"


def _many_groups_job(rank: int, count: int) -> float:
    import torchring

    with session():
        torchring.barrier()
        start = time.perf_counter()
        groups = [torchring.new_group([i % 4, (i + 1) % 4]) for i in range(count)]
        elapsed = time.perf_counter() - start
        for g in groups[:4]:
            if g.is_member:
                g.allreduce(torch.ones(1))
        return elapsed


def test_creating_100_groups_on_4_ranks_is_quick() -> None:
    times = spawn(4, _many_groups_job, 100)
    assert max(times) < 20, f"100 new_group() calls took {max(times):.1f} s"


def _disagree_job(rank: int) -> list[str]:
    """Rank 2 asks for [0, 2] while ranks 0 and 1 ask for [0, 1]: every member raises a
    ValueError naming a rank whose list differs, and the world goes on."""
    import torchring

    with session():
        chk = Checker(rank)
        asked = [0, 2] if rank == 2 else [0, 1]
        try:
            torchring.new_group(asked)
            chk.fail("new_group with differing lists", "did not raise")
        except ValueError as e:
            other = 2 if rank != 2 else 0  # the first rank whose list differs
            chk.true("names the rank", f"rank {other}'s group 1 is new_group({[0, 2] if rank != 2 else [0, 1]})"
                     in str(e), str(e))
        t = rank_input(rank, 3, 10, torch.float32)
        torchring.allreduce(t)
        chk.equal("allreduce after", t, expected_allreduce(3, 10, torch.float32, "SUM"))
        return chk.failures


def test_ranks_asking_for_different_groups_are_named() -> None:
    assert_no_failures(spawn(3, _disagree_job))


def _absent_job(rank: int) -> str:
    import torchring

    with session():
        if rank == 2:
            time.sleep(6)  # never calls new_group, stays alive past the others' timeout
            return ""
        try:
            torchring.new_group([0, 1])
        except torchring.CommunicatorFailedError as e:
            return str(e)
        return "did not raise"


def test_a_rank_that_never_calls_new_group_is_named() -> None:
    got = spawn(3, _absent_job, env={"TORCHRING_TIMEOUT": "2"})
    for rank in (0, 1):
        assert "rank 2 to call torchring.new_group() for group 1" in got[rank], got[rank]
