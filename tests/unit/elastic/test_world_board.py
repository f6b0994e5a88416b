"""What a re-forming reads of the old world's failure board (torchring/elastic/world.py): the ranks
that posted a failure there live, and the next epoch waits for them; a lost store gives nothing."""

from __future__ import annotations

import datetime
import os
import signal

import torch.distributed as dist

from _store_server import store_server
from torchring._core import rendezvous
from torchring.elastic import world


def test_the_ranks_that_posted_on_the_board_are_alive() -> None:
    with store_server() as (pid, port):
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=10))
        prefix = "torchring/job/0/epoch-3/"
        board = rendezvous.failure_board(store, prefix)  # where the engine posts (rendezvous.wire)
        board.set("failed/1", "rank 1 (this process): allreduce #10: hit the 5 s timeout")
        board.set("failed/3", "rank 3 (this process): allreduce #10: stopped waiting")
        store.set(prefix + "failed/2", "not on the board: a key beside it")
        alive = world._posted(store, prefix, 4)
        assert alive() == {1, 3}
        assert world._posted(None, prefix, 4)() == set()
        os.kill(pid, signal.SIGKILL)  # the store goes: nothing to go by, and nobody is waited for
        os.waitpid(pid, 0)
        assert alive() == set()
