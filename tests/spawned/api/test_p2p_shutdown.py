"""A rank may shut down right after its last recv: the sender's last send still completes.

Regression test for a race the API work found: the receiver completed its recv before its
progress thread wrote the ACK, shut down, and the sender's last send failed (about one run in
three of 50 isend/irecv rounds). Each rank checks every message it received; no barrier ends the
job, so nothing but the ACK tells the sender its message arrived.
"""

from __future__ import annotations

import pytest
import torch

from _dist import session, spawn

ROUNDS = 50


def _exchange(rank: int, n: int) -> str:
    import torchring

    with session():
        peer = 1 - rank
        for i in range(ROUNDS):
            got = torch.empty(n, dtype=torch.int64)
            receiving = torchring.irecv(got, peer, tag=3)
            torchring.isend(torch.full((n,), rank * 1000 + i, dtype=torch.int64), peer, tag=3).wait(timeout=30)
            receiving.wait(timeout=30)
            assert torch.equal(got, torch.full((n,), peer * 1000 + i, dtype=torch.int64)), (i, got[:3])
        return "ok"


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("n", [1, 40_000])  # 40_000 int64: more than one 256 KiB ring
def test_last_send_completes_when_the_receiver_leaves(transport: str, n: int) -> None:
    for _ in range(2):
        assert spawn(2, _exchange, n, env={"TORCHRING_TRANSPORT": transport}) == ["ok", "ok"]
