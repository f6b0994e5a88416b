"""Failures on the "torchring" torch.distributed backend: loud, on every rank, and never a hang.

A mismatched collective raises on every rank (through ``wait()``, the blocking call and the
Work's future), naming ranks and the operation, and the next collective works; a killed rank or
one that stops calling collectives makes the others raise within the process group's timeout;
``destroy_process_group()`` returns at once, also with an operation in flight, and a new group
can be made after it.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from _c10d import finish, init_pg
from _checks import Checker, assert_no_failures, rank_input
from _dist import spawn

PG_TIMEOUT_S = 10.0
SLACK_S = 8.0  # a busy 2-core machine may take this long on top of the timeout


def _expect_raise(chk: Checker, what: str, call, words: list[str]) -> str:
    """Run ``call``; record a failure unless it raises an error that mentions every one of ``words``."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - any exception type is fine, its message is checked
        msg = str(e)
        for w in words:
            chk.true(f"{what}: the error names {w!r}", w in msg, f"it says: {msg[:600]}")
        return msg
    chk.fail(what, "did not raise")
    return ""


def _mismatches(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    init_pg(timeout_s=PG_TIMEOUT_S)
    chk = Checker(rank)
    tail = dist.new_group(list(range(1, world)))

    def next_op_works(after: str) -> None:
        t = rank_input(rank, world, 6, torch.int64)
        dist.all_reduce(t)
        want = sum(rank_input(r, world, 6, torch.int64) for r in range(world))
        chk.equal(f"all_reduce after {after}", t, want)

    try:
        # One rank's tensor has another shape: every rank raises, naming the odd rank.
        _expect_raise(chk, "all_reduce, rank 1 has 5 elements",
                      lambda: dist.all_reduce(torch.ones(5 if rank == 1 else 4)), ["allreduce", "rank 1", "[5]"])
        next_op_works("a shape mismatch")
        # Another dtype, asynchronously: wait() raises, and so does the Work's future.
        t = torch.ones(4, dtype=torch.float64 if rank == 0 else torch.float32)
        work = dist.all_reduce(t, async_op=True)
        _expect_raise(chk, "all_reduce(async_op=True).wait(), rank 0 has float64", work.wait, ["allreduce", "rank 0"])
        _expect_raise(chk, "the future of that all_reduce", lambda: work.get_future().wait(), ["allreduce"])
        next_op_works("a dtype mismatch")
        # Another reduce op.
        op = dist.ReduceOp.MAX if rank == world - 1 else dist.ReduceOp.SUM
        _expect_raise(chk, "all_reduce with MAX on the last rank", lambda: dist.all_reduce(torch.ones(3), op=op),
                      ["allreduce", f"rank {world - 1}"])
        next_op_works("a reduce-op mismatch")
        # Another root.
        _expect_raise(chk, "broadcast from rank 1 on rank 0 only",
                      lambda: dist.broadcast(torch.ones(3), src=1 if rank == 0 else 0), ["broadcast", "rank 0"])
        next_op_works("a broadcast root mismatch")
        # all_gather_into_tensor with a longer input on rank 1.
        n = 3 if rank == 1 else 2
        _expect_raise(chk, "all_gather_into_tensor, rank 1 gives 3 elements",
                      lambda: dist.all_gather_into_tensor(torch.zeros(world * n), torch.ones(n)),
                      ["allgather", "rank 1"])
        next_op_works("an all_gather_into_tensor mismatch")
        # Different operations: rank 0 broadcasts while the others all-reduce.
        call = (lambda: dist.broadcast(torch.ones(4), src=0)) if rank == 0 else (lambda: dist.all_reduce(torch.ones(4)))
        _expect_raise(chk, "broadcast on rank 0, all_reduce elsewhere", call, ["broadcast", "allreduce"])
        next_op_works("an operation mismatch")
        # In a sub-group of world ranks 1..world-1: its error says which group, and the default
        # group is unaffected.
        if rank >= 1:
            _expect_raise(chk, "all_reduce in a sub-group, its rank 0 has 2 elements",
                          lambda: dist.all_reduce(torch.ones(2 if rank == 1 else 3), group=tail),
                          ["allreduce", str(list(range(1, world)))])
            t = torch.ones(2)
            dist.all_reduce(t, group=tail)
            chk.equal("sub-group all_reduce after its mismatch", t, torch.full((2,), float(world - 1)))
        next_op_works("a sub-group's mismatch")
        start = time.monotonic()
        dist.destroy_process_group()
        took = time.monotonic() - start
        chk.true("destroy_process_group() returns promptly", took < 5, f"took {took:.1f} s")
    finally:
        finish()
    return chk.failures


def test_mismatch_raises_on_every_rank_and_next_op_works() -> None:
    """Shape, dtype, op, root, size and operation mismatches at world 3, and one in a sub-group."""
    assert_no_failures(spawn(3, _mismatches, 3, timeout=120))


def _lost_peer(rank: int, world: int, how: str) -> dict:
    import torch.distributed as dist

    init_pg(timeout_s=PG_TIMEOUT_S)
    t = torch.ones(4)
    dist.all_reduce(t)  # every rank connected and working
    if rank == world - 1:
        time.sleep(1.0)  # the others are waiting in their next all_reduce by now
        if how == "killed":
            os._exit(3)
        time.sleep(PG_TIMEOUT_S + 4)  # stalled: alive, but calls nothing
        os._exit(0)
    start = time.monotonic()
    out: dict = {"first": None, "second": None}
    for key in ("first", "second"):
        try:
            dist.all_reduce(torch.ones(1000))
        except Exception as e:  # noqa: BLE001
            out[key] = str(e)
        out[f"{key}_s"] = time.monotonic() - start
    start = time.monotonic()
    dist.destroy_process_group()
    out["destroy_s"] = time.monotonic() - start
    return out


@pytest.mark.parametrize("how", ["killed", "stalled"])
def test_lost_peer_raises_within_the_pg_timeout(how: str) -> None:
    """A rank that dies (or stops calling collectives) fails the others' next op within the timeout."""
    world = 3
    outcomes = spawn(world, _lost_peer, world, how, timeout=60, expect_fail=True)
    chk = Checker(-1)
    lost = outcomes[-1]
    chk.true(f"rank {world - 1} exited as told", lost.exitcode == (3 if how == "killed" else 0),
             lost.describe())
    for o in outcomes[:-1]:
        if not o.ok:
            chk.fail(f"rank {o.rank}", o.describe())
            continue
        r = o.value
        for key in ("first", "second"):
            msg = r[key] or ""
            chk.true(f"rank {o.rank}: the {key} all_reduce raised", r[key] is not None, "it returned")
            chk.true(f"rank {o.rank}: the {key} error names the lost rank and the op",
                     f"rank {world - 1}" in msg and "allreduce" in msg, f"it says: {msg[:600]}")
        limit = PG_TIMEOUT_S + SLACK_S
        chk.true(f"rank {o.rank}: raised within the PG timeout", r["first_s"] < limit,
                 f"after {r['first_s']:.1f} s (limit {limit} s)")
        chk.true(f"rank {o.rank}: the next op fails at once", r["second_s"] - r["first_s"] < 2,
                 f"after {r['second_s'] - r['first_s']:.1f} s more")
        if how == "stalled":
            chk.true(f"rank {o.rank}: it waited for the timeout", r["first_s"] > PG_TIMEOUT_S - 1,
                     f"after only {r['first_s']:.1f} s")
        chk.true(f"rank {o.rank}: destroy_process_group() after the failure", r["destroy_s"] < 5,
                 f"took {r['destroy_s']:.1f} s")
    assert_no_failures([chk.failures])


def _destroy_in_flight(rank: int, world: int, path: str) -> list[str]:
    import torch.distributed as dist

    chk = Checker(rank)
    for i in range(2):  # a new group on a fresh file:// store after each destroy
        init_pg(timeout_s=PG_TIMEOUT_S, init_method=f"file://{path}.{i}")
        t = rank_input(rank, world, 5, torch.int32)
        dist.all_reduce(t)
        chk.equal(f"all_reduce in process group #{i}", t,
                  sum(rank_input(r, world, 5, torch.int32) for r in range(world)).to(torch.int32))
        work = dist.all_reduce(torch.ones(3), async_op=True) if rank == 0 else None  # no peer joins it
        start = time.monotonic()
        dist.destroy_process_group()
        took = time.monotonic() - start
        chk.true(f"#{i}: destroy_process_group() with an op in flight on rank 0", took < 5, f"took {took:.1f} s")
        if work is not None:
            start = time.monotonic()
            _expect_raise(chk, f"#{i}: wait() on the op cut off by destroy", work.wait, ["allreduce"])
            chk.true(f"#{i}: that wait() returns promptly", time.monotonic() - start < 5)
    finish()
    return chk.failures


def test_destroy_with_an_op_in_flight_then_a_new_group(tmp_path) -> None:
    """destroy_process_group() never hangs on an unmatched op, which then fails; init works again."""
    assert_no_failures(spawn(2, _destroy_in_flight, 2, str(tmp_path / "store"), timeout=60))


def _timeout_advice(rank: int) -> str:
    import torch.distributed as dist

    init_pg(timeout_s=2)
    if rank == 1:
        time.sleep(4)
        return ""
    try:
        dist.all_reduce(torch.ones(2))
    except Exception as e:  # noqa: BLE001
        return str(e)
    finally:
        finish()
    return "did not raise"


def test_timeout_error_gives_torch_distributed_advice() -> None:
    """The fix a torch.distributed user can apply: no TORCHRING_TIMEOUT, no torchring.init()."""
    msg = spawn(2, _timeout_advice, timeout=60)[0]
    assert "allreduce" in msg and " timeout " in msg, msg
    assert "TORCHRING_TIMEOUT" not in msg and "torchring.init()" not in msg, msg


def _barrier_alone(rank: int) -> dict:
    import re

    import torch.distributed as dist

    init_pg(timeout_s=2)
    out = {"rank": rank}
    try:
        if rank == 0:  # the only rank at the barrier, as in torch's own barrier-timeout test
            start = time.monotonic()
            try:
                dist.barrier()
                out["error"] = "did not raise"
            except Exception as e:  # noqa: BLE001
                out["error"] = str(e)
            out["took"] = time.monotonic() - start
            out["torch_regex"] = bool(re.search(" (Timed out|closed|timeout) ", out["error"]))
        else:
            time.sleep(4)
    finally:
        finish()
    return out


def test_a_barrier_alone_times_out_as_torch_expects() -> None:
    """Rank 0 alone at a barrier raises after the group's timeout (not before), in words torch's suite matches."""
    r = spawn(3, _barrier_alone, timeout=60)[0]
    assert r["torch_regex"] and "barrier #0" in r["error"] and "barrier #0 barrier" not in r["error"], r
    assert 2 - 0.1 <= r["took"] < 2 + SLACK_S, r


def _detail_debug(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()
    init_pg(timeout_s=PG_TIMEOUT_S)
    chk = Checker(rank)
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        before = backend._get_sequence_number_for_group()
        t = rank_input(rank, world, 7, torch.int64)
        dist.all_reduce(t)
        chk.equal("all_reduce under DETAIL", t, sum(rank_input(r, world, 7, torch.int64) for r in range(world)))
        chk.true("the sequence number counts collectives", backend._get_sequence_number_for_group() > before,
                 f"{before} then {backend._get_sequence_number_for_group()}")
        sub = dist.new_group(list(range(world)))
        got = [None] * world
        dist.all_gather_object(got, {"rank": rank}, group=sub)
        chk.true("all_gather_object on a new group under DETAIL", got == [{"rank": r} for r in range(world)], str(got))
        # The debug wrapper's own check names the shape mismatch before the engine sees it.
        _expect_raise(chk, "DETAIL: all_reduce with rank 1's tensor of another shape",
                      lambda: dist.all_reduce(torch.ones(3 if rank == 1 else 2)), ["3", "2"])
    finally:
        finish()
    return chk.failures


def test_detail_debug_wrapper_runs_on_torchring() -> None:
    """TORCH_DISTRIBUTED_DEBUG=DETAIL: sequence numbers agree, collectives and subgroups work, mismatches raise."""
    assert_no_failures(spawn(3, _detail_debug, 3, timeout=120))
