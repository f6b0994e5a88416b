"""Point-to-point failures, in process (tests/support/_world.py): a recv from a peer that never
sends (silent or shut down) and a send that is never received raise CommunicatorFailedError
within the timeout naming the peer and the tag, and fail the communicator; shutdown() with
isend/irecv pending returns promptly and fails the pending work, also for a thread blocked
in wait(); a send to a peer whose listener is gone fails at once (a refused connection)
instead of retrying until the timeout. On shared memory and TCP."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import pytest
import torch

import torchring
from _world import allreduce, run_world

TIMEOUT = 1.0
SLACK = 3.0  # seconds past the timeout a failure may take to be raised and explained


def _failed_within(comm: Any, method: str, tensor: torch.Tensor, peer: int,
                   tag: int) -> tuple[str, float, str, float]:
    """(the error, how long it took, the next collective's error, how long that took) for a
    comm.send/recv that must fail."""
    start = time.monotonic()
    with pytest.raises(torchring.CommunicatorFailedError) as first:
        getattr(comm, method)(tensor, peer, tag).wait()
    elapsed = time.monotonic() - start
    start = time.monotonic()
    with pytest.raises(torchring.CommunicatorFailedError) as later:
        allreduce(comm, torch.ones(4))
    return str(first.value), elapsed, str(later.value), time.monotonic() - start


def _check(result: tuple[str, float, str, float], peer: int, tag: int) -> None:
    error, elapsed, later, later_took = result
    assert re.search(rf"\brank {peer}\b", error) and re.search(rf"tag\D{{0,3}}{tag}\b", error), error
    assert elapsed < TIMEOUT + SLACK, f"raised after {elapsed:.1f} s with a {TIMEOUT} s timeout: {error}"
    # The communicator is failed, as after a collective timeout: the next collective says so at once.
    assert later_took < 1.0, f"the next allreduce took {later_took:.1f} s to fail: {later}"
    assert "failed earlier" in later or (f"rank {peer}" in later and f"tag {tag}" in later), later


@pytest.mark.parametrize("hosts,transport,peer_state", [("aa", "shm", "silent"), ("ab", "tcp", "silent"),
                                                        ("ab", "tcp", "shut down")])
def test_recv_from_a_peer_that_never_sends(hosts: str, transport: str, peer_state: str) -> None:
    release = threading.Event()

    def job(rank: int, comm: Any) -> Any:
        if rank == 1:
            if peer_state == "silent":
                release.wait(TIMEOUT * 3 + 10)  # posts nothing until rank 0 gave up
            return None  # "shut down": the harness shuts this communicator down at once
        try:
            return _failed_within(comm, "recv", torch.empty(100), 1, 7)
        finally:
            release.set()

    result, _ = run_world(2, job, hosts, transport, timeout=TIMEOUT)
    _check(result, 1, 7)


@pytest.mark.parametrize("hosts,transport,numel", [("aa", "shm", 4), ("aa", "shm", 300_000), ("ab", "tcp", 4)])
def test_send_that_is_never_received(hosts: str, transport: str, numel: int) -> None:
    """Small messages too: a send is done when the peer's recv took it, not when it was buffered."""
    release = threading.Event()

    def job(rank: int, comm: Any) -> Any:
        if rank == 0:
            release.wait(TIMEOUT * 3 + 10)  # never posts the recv
            return None
        try:
            return _failed_within(comm, "send", torch.ones(numel), 0, 4)
        finally:
            release.set()

    _, result = run_world(2, job, hosts, transport, timeout=TIMEOUT)
    _check(result, 0, 4)


@pytest.mark.parametrize("hosts,transport", [("aa", "shm"), ("ab", "tcp")])
def test_shutdown_with_pending_p2p_fails_it_without_hanging(hosts: str, transport: str) -> None:
    """Each rank has a recv and a large send pending that the other never matches (different
    tags); a thread blocks in the recv's wait(); shutdown() must return and fail all of it."""
    both_posted = threading.Barrier(2)

    def job(rank: int, comm: Any) -> tuple[float, list[str], float]:
        other = 1 - rank
        recv = comm.recv(torch.empty(10), other, 10 + rank)
        send = comm.send(torch.ones(300_000), other, 20 + rank)
        waiter_error: list[str] = []

        def wait_in_thread() -> None:
            try:
                recv.wait()
                waiter_error.append("recv.wait() returned")
            except torchring.TorchringError as e:
                waiter_error.append(f"{type(e).__name__}: {e}")

        waiter = threading.Thread(target=wait_in_thread, daemon=True)
        waiter.start()
        both_posted.wait(10)
        time.sleep(0.2)  # the waiter is blocked in wait()
        start = time.monotonic()
        comm.shutdown()
        took = time.monotonic() - start
        waiter.join(5)
        errors = waiter_error or ["the thread in recv.wait() still blocks 5 s after shutdown()"]
        start = time.monotonic()
        try:
            send.wait()
            errors.append("send.wait() returned")
        except torchring.TorchringError as e:
            errors.append(f"{type(e).__name__}: {e}")
        return took, errors, time.monotonic() - start

    # A long timeout: only shutdown() may end the pending work.
    for rank, (took, errors, send_took) in enumerate(run_world(2, job, hosts, transport, timeout=30.0)):
        assert took < 3.0, f"rank {rank}: shutdown() took {took:.1f} s with p2p pending"
        assert send_took < 3.0, f"rank {rank}: send.wait() took {send_took:.1f} s after shutdown()"
        wrong = [e for e in errors if e.endswith("returned") or "still blocks" in e]
        assert not wrong, f"rank {rank}: {errors}"


def test_a_send_to_a_peer_that_left_fails_at_once() -> None:
    def job(rank: int, comm: Any) -> str:
        if rank == 1:
            comm.shutdown()  # its listener closes: a connection is refused
            return "left"
        time.sleep(0.3)
        start = time.monotonic()
        with pytest.raises(Exception) as caught:
            comm.send(torch.ones(4), 1, 5).wait()
        elapsed = time.monotonic() - start
        assert type(caught.value).__name__ == "CommunicatorFailedError", caught.value
        assert elapsed < 2.0, f"{elapsed:.1f} s: retried instead of failing on a refused connection"
        assert "rank 1" in str(caught.value) and "tag 5" in str(caught.value), caught.value
        return "ok"

    assert run_world(2, job, hosts="ab", transport="tcp", timeout=8) == ["ok", "left"]
