"""torchft's process group on torchring (torchring.elastic.torchft.ProcessGroupTorchring): sums
against a single-process reference, a replica that shuts down or is killed, abort() from
another thread, and configure() forming the next quorum's group under a fresh prefix. torchft's
own tests on it: test_torchft_suite.py."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch._C._distributed_c10d import AllreduceOptions
from torch.distributed import TCPStore

from _dist import spawn
from torchring.elastic.torchft import ProcessGroupTorchring

COUNT = 1000  # elements per allreduce


def _values(rank: int, step: int) -> torch.Tensor:
    """Integer-valued float tensor of rank `rank` at `step` (sums are exact)."""
    return (torch.arange(COUNT, dtype=torch.float64) % 97 + rank * 3 + step).float()


def _reference(ranks: list[int], step: int) -> torch.Tensor:
    return sum(_values(r, step).double() for r in ranks).float()


def _allreduce(pg: ProcessGroupTorchring, tensor: torch.Tensor) -> torch.Tensor:
    pg.allreduce([tensor], AllreduceOptions()).wait()
    return tensor


def _in_threads(world: int, fn: Any) -> list[Any]:
    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(fn, range(world)))


def test_shutdown_replica_fails_survivors_at_once_then_reconfigure() -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pgs = [ProcessGroupTorchring(timeout=timedelta(seconds=30)) for _ in range(3)]

    def first_quorum(rank: int) -> Any:
        pgs[rank].configure(f"127.0.0.1:{store.port}/quorum-1", "0", rank, 3, quorum_id=1)
        assert pgs[rank].size() == 3 and pgs[rank].errored() is None
        got = _allreduce(pgs[rank], _values(rank, 1))
        assert torch.equal(got, _reference([0, 1, 2], 1))
        if rank == 2:
            pgs[rank].shutdown()
            return None
        start = time.monotonic()
        with pytest.raises(RuntimeError) as failure:
            _allreduce(pgs[rank], _values(rank, 2))
        return time.monotonic() - start, str(failure.value), str(pgs[rank].errored())

    results = _in_threads(3, first_quorum)
    for rank, (seconds, message, errored) in enumerate(results[:2]):
        assert seconds < 1.0, f"rank {rank} raised after {seconds:.2f} s, not at once"
        assert f"rank {rank}" in message and "rank 2" in message and "allreduce" in message, message
        assert "Connection closed by peer" in message and "shut its communicator down" in message, message
        assert "aborted" in errored and "rank 2" in errored, errored

    def second_quorum(rank: int) -> Any:
        pgs[rank].configure(f"127.0.0.1:{store.port}/quorum-2", "0", rank, 2, quorum_id=2)
        assert pgs[rank].errored() is None and pgs[rank].size() == 2
        return _allreduce(pgs[rank], _values(rank, 3))

    for got in _in_threads(2, second_quorum):
        assert torch.equal(got, _reference([0, 1], 3))
    for pg in pgs[:2]:
        pg.shutdown()


def test_abort_from_another_thread_unblocks_in_flight_allreduce() -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pgs = [ProcessGroupTorchring(timeout=timedelta(seconds=30)) for _ in range(2)]
    _in_threads(2, lambda r: pgs[r].configure(f"127.0.0.1:{store.port}/q", "7", r, 2, quorum_id=4))
    # Rank 1 issues nothing: rank 0's allreduce waits for it until another thread aborts.
    work = pgs[0].allreduce([_values(0, 0)], AllreduceOptions())
    aborter = threading.Timer(0.3, pgs[0].abort)
    start = time.monotonic()
    aborter.start()
    with pytest.raises(RuntimeError, match="rank 0 aborted its torchring process group"):
        work.wait()
    seconds = time.monotonic() - start
    assert seconds < 2.0, f"abort() took {seconds:.2f} s to unblock the allreduce"
    errored = str(pgs[0].errored())
    assert "was aborted" in errored and "quorum 4" in errored and "replica 7" in errored, errored
    # The peer learns it at its next operation, at once, with the reason.
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0 aborted its torchring process group"):
        _allreduce(pgs[1], _values(1, 0))
    assert time.monotonic() - start < 1.0
    assert "rank 0 aborted" in str(pgs[1].errored())
    pgs[1].shutdown()


def _killed_replica_job(rank: int) -> Any:
    store_addr = f"127.0.0.1:{os.environ['MASTER_PORT']}"
    pg = ProcessGroupTorchring(timeout=timedelta(seconds=20))
    pg.configure(f"{store_addr}/quorum-1", str(rank), rank, 3, quorum_id=1)
    first = _allreduce(pg, _values(rank, 1))
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        _allreduce(pg, _values(rank, 2))
        raise AssertionError(f"rank {rank}: the allreduce with a killed replica succeeded")
    except RuntimeError as e:
        message, seconds = str(e), time.monotonic() - start
    errored = str(pg.errored())
    pg.configure(f"{store_addr}/quorum-2", str(rank), rank, 2, quorum_id=2)
    second = _allreduce(pg, _values(rank, 3))
    pg.shutdown()
    return first.tolist(), message, seconds, errored, second.tolist()  # plain lists cross the pipe


def test_killed_replica_process_then_quorum_of_survivors() -> None:
    outcomes = spawn(3, _killed_replica_job, expect_fail=True, timeout=90)
    assert outcomes[2].exitcode == -signal.SIGKILL, outcomes[2]
    for rank in (0, 1):
        assert outcomes[rank].ok, outcomes[rank]
        first, message, seconds, errored, second = outcomes[rank].value
        assert first == _reference([0, 1, 2], 1).tolist()
        assert seconds < 5.0, f"rank {rank} raised {seconds:.2f} s after the kill"
        assert f"rank {rank}" in message and "rank 2" in message and "died" in message, message
        assert "aborted" in errored, errored
        assert second == _reference([0, 1], 3).tolist()
