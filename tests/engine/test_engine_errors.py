"""The engine's error contract, in process: a mismatch fails that operation on every rank with
CollectiveMismatchError and the next one is exact; an expired wait(timeout) is a
WaitTimeoutError and the operation still completes; a rank that stops fails the others with
CommunicatorFailedError within the timeout, and every later operation says so."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import torchring
from _checks import expected_allreduce, rank_input
from _world import ENGINE, allreduce, run_world, submit, submit_op
from torchring._core.types import OpKind, ReduceOp


@pytest.mark.parametrize("hosts,transport", [("aaa", "shm"), ("abc", "tcp"), ("aab", "shm")])
def test_shape_mismatch_then_exact(hosts: str, transport: str) -> None:
    world = len(hosts)

    def job(rank: int, comm: Any) -> tuple[str, bool]:
        shape = (100, 10) if rank == 1 else (10, 100)
        try:
            allreduce(comm, torch.zeros(shape))
            error = "no error"
        except torchring.CollectiveMismatchError as e:
            error = str(e)
        t = rank_input(rank, world, 2000, torch.float32)
        return error, torch.equal(allreduce(comm, t), expected_allreduce(world, 2000, torch.float32, "SUM"))

    for rank, (error, exact) in enumerate(run_world(world, job, hosts, transport)):
        assert "rank 0 sent allreduce float32[10, 100] SUM, rank 1 sent allreduce float32[100, 10]" \
            in error, f"rank {rank}: {error}"
        assert exact, f"rank {rank}: the allreduce after the mismatch is wrong"


def test_wait_timeout_leaves_the_operation_running() -> None:
    late = threading.Event()

    def job(rank: int, comm: Any) -> Any:
        if rank == 1:
            late.wait(10)  # rank 0's wait(timeout) must expire first
            return allreduce(comm, torch.ones(4))
        work = submit(comm, OpKind.ALLREDUCE, torch.ones(4), inline=False)
        try:
            work.wait(0.2)
            expired = "no error"
        except torchring.WaitTimeoutError as e:
            expired = str(e)
        late.set()
        return expired, work.wait().tolist()

    (expired, result), other = run_world(2, job)
    assert expired.startswith("rank 0: allreduce #0: Handle.wait(timeout=0.2) expired"), expired
    assert result == [2.0] * 4 and other.tolist() == [2.0] * 4


@pytest.mark.parametrize("hosts,transport", [("aa", "shm"), ("ab", "tcp")])
def test_a_silent_rank_fails_the_communicator_within_the_timeout(hosts: str, transport: str) -> None:
    release = threading.Event()

    def job(rank: int, comm: Any) -> Any:
        if rank == 1:
            release.wait(30)  # silent: issues nothing until rank 0 gave up
            return None
        start = time.monotonic()
        with pytest.raises(torchring.CommunicatorFailedError) as first:
            allreduce(comm, torch.ones(8))
        elapsed = time.monotonic() - start
        with pytest.raises(torchring.CommunicatorFailedError) as later:
            allreduce(comm, torch.ones(8))
        release.set()
        return str(first.value), elapsed, str(later.value)

    (first, elapsed, later), _ = run_world(2, job, hosts, transport, timeout=1.0)
    assert "rank 1" in first and "torchring.shutdown() and torchring.init()" in first, first
    if transport == "tcp":  # the peer right after the words, the advice after the peer
        assert re.search(r"no progress (receiving from|sending to) rank 1 \(.*\); it is stuck, "
                         r"stopped, or issued different collectives", first), first
    assert elapsed < 1.0 + 3.0, f"took {elapsed:.1f} s with a 1 s timeout"
    assert "failed earlier" in later and "allreduce #1" in later, later


@pytest.mark.parametrize("rank,size,hosts,words", [
    (2, 2, [[0, 1]], "rank 2 must be in [0, size)"),
    (0, 3, [[0, 1]], "CommOptions.hosts misses rank 2"),
    (0, 2, [[0, 1], [1]], "CommOptions.hosts lists rank 1 twice"),
])
def test_bad_options_are_a_value_error(rank: int, size: int, hosts: list[list[int]], words: str) -> None:
    options = ENGINE.CommOptions()
    options.rank, options.size, options.hosts = rank, size, hosts
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        ENGINE.Communicator(options)


def test_the_engine_checks_what_its_direct_callers_pass() -> None:
    def job(rank: int, comm: Any) -> list[str]:
        errors = []
        for kind, t, op, root in [(OpKind.BROADCAST, torch.ones(3), 0, 2),
                                  (OpKind.BROADCAST, torch.ones(3), 0, -1),
                                  (OpKind.REDUCE_SCATTER, torch.tensor(1.0), 0, -1),
                                  (OpKind.ALLREDUCE, None, 0, -1),
                                  (12, torch.ones(3), 0, -1),
                                  (OpKind.ALLREDUCE, torch.ones(3), 8, -1)]:
            with pytest.raises(ValueError) as caught:
                comm.submit(int(kind), t, op, root, True)
            errors.append(str(caught.value).splitlines()[0])
        # Nothing was queued or sent: the next collective is exact.
        errors.append(str(allreduce(comm, torch.ones(5)).tolist()))
        return errors

    for rank, errors in enumerate(run_world(2, job)):
        assert "broadcast: the root must be a rank in [0, 2), got 2" in errors[0], errors
        assert "got -1" in errors[1] and "float32[]: the tensor needs a dim 0" in errors[2], errors
        assert "allreduce needs a tensor" in errors[3] and "unknown collective kind 12" in errors[4], errors
        assert "unknown reduce op 8" in errors[5] and errors[6] == str([2.0] * 5), errors
        assert all(e.startswith(f"rank {rank}:") for e in errors[:4]), errors


def test_the_engine_applies_the_dtype_op_rule_of_every_reduction() -> None:
    def job(rank: int, comm: Any) -> list[str]:
        errors = []
        for kind, dtype, op, scale in [(OpKind.ALLREDUCE, torch.int32, ReduceOp.AVG, 1.0),
                                       (OpKind.REDUCE, torch.bool, ReduceOp.SUM, 1.0),
                                       (OpKind.ALLREDUCE, torch.int64, ReduceOp.SUM, 0.5),
                                       (OpKind.REDUCE_SCATTER, torch.float32, ReduceOp.BAND, 1.0)]:
            with pytest.raises(ValueError) as caught:
                submit_op(comm, kind, torch.ones(3, dtype=dtype), op, root=0 if kind.rooted else -1,
                          prescale=scale)
            errors.append(str(caught.value).splitlines()[0])
        # The fast path declines what the rule refuses (the checked path then words it) and
        # takes the rest.
        now = ENGINE.allreduce_now_function(comm)
        declined = [now(torch.ones(3, dtype=torch.bool), int(ReduceOp.SUM)),
                    now(torch.ones(3, dtype=torch.int8), int(ReduceOp.AVG))]
        taken = now(torch.ones(3, dtype=torch.bool), int(ReduceOp.MAX))
        errors.append(f"{declined} {taken}")
        return errors

    for rank, errors in enumerate(run_world(2, job)):
        assert errors[0].startswith(f"rank {rank}: allreduce of int32[3]: AVG needs a floating-point"), errors
        assert "reduce of bool[3]: bool tensors reduce with MIN, MAX, BAND, BOR and BXOR only" in errors[1], errors
        assert "allreduce of int64[3]: prescale and postscale factors need a floating-point" in errors[2], errors
        assert "reduce_scatter of float32[3]: BAND, BOR and BXOR need an integer or bool tensor" in errors[3], errors
        assert errors[4] == "[False, False] True", errors


class _UnreachableStore(dist.Store):
    """A rendezvous store whose host is gone: every request blocks (without the GIL)."""

    def __init__(self) -> None:
        super().__init__()
        self.requests = 0

    def _block(self) -> None:
        self.requests += 1
        threading.Event().wait()

    def set(self, key: str, value: Any) -> None:
        self._block()

    def get(self, key: str) -> bytes:
        self._block()
        return b""

    def check(self, keys: list[str]) -> bool:
        self._block()
        return False


def test_an_unreachable_store_does_not_hold_up_a_failure() -> None:
    """The failure path asks the store why the peer failed; a store that never answers must
    not turn a timeout into a hang (the store's host lost its link)."""
    store = _UnreachableStore()
    release = threading.Event()

    def job(rank: int, comm: Any) -> Any:
        if rank == 1:
            release.wait(30)  # silent
            return None
        comm.set_failure_board(store)
        start = time.monotonic()
        with pytest.raises(torchring.CommunicatorFailedError) as failed:
            allreduce(comm, torch.ones(8))
        release.set()
        return str(failed.value), time.monotonic() - start

    (error, elapsed), _ = run_world(2, job, "ab", "tcp", timeout=1.0)
    assert store.requests >= 1, "the failure path never asked the store"
    assert "the rendezvous store did not answer" in error and "rank 1" in error, error
    assert elapsed < 1.0 + 2.0 + 1.0 + 1.5 + 1.0, f"raised after {elapsed:.1f} s"
