"""Engine-tier regressions for defects a review of issue #12's engine found (each failed before
its fix): alltoall with a rank that sends no rows but receives some; splits whose sum overflows
int64; a recv whose ACK cannot be sent because the sender left must still finish (and every
recv posted after it too, with an error); a send to a peer whose listener is gone fails at once
(a refused connection) instead of retrying until the timeout."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from _world import run_world, submit_op
from torchring._core.types import OpKind


@pytest.mark.parametrize("transport,hosts", [("shm", "aa"), ("tcp", "ab")])
def test_alltoall_from_a_rank_without_rows(transport: str, hosts: str) -> None:
    def job(rank: int, comm: Any) -> tuple[list, list]:
        t = torch.empty(0, 4) if rank == 0 else torch.arange(12, dtype=torch.float32).reshape(3, 4)
        send = [0, 0] if rank == 0 else [3, 0]
        recv = torch.zeros(2, dtype=torch.int64)
        out = submit_op(comm, OpKind.ALLTOALL, t, send_splits=torch.tensor(send), recv_splits=recv).wait()
        return out.tolist(), recv.tolist()

    first, second = run_world(2, job, hosts=hosts, transport=transport, timeout=5)
    assert first == (torch.arange(12, dtype=torch.float32).reshape(3, 4).tolist(), [0, 3])
    assert second == ([], [0, 0])


def test_alltoall_splits_whose_sum_overflows_fail_every_rank() -> None:
    big = 2**63 - 1

    def job(rank: int, comm: Any) -> str:
        t = torch.zeros(4, 2) if rank == 0 else torch.zeros(3, 2)
        send = [1, big, big] if rank == 0 else [1, 1, 1]
        with pytest.raises(Exception) as caught:
            submit_op(comm, OpKind.ALLTOALL, t, send_splits=torch.tensor(send),
                      recv_splits=torch.zeros(3, dtype=torch.int64)).wait()
        assert type(caught.value).__name__ == "CollectiveMismatchError", caught.value
        after = torch.ones(2)
        submit_op(comm, OpKind.ALLREDUCE, after).wait()
        return str(caught.value) + f" | after {after.tolist()}"

    for text in run_world(3, job, timeout=5):
        assert "rank 0's send splits" in text and "after [3.0, 3.0]" in text, text


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
