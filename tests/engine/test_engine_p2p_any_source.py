"""recv from any source on the engine, in process (tests/support/_world.py), as MPI_ANY_SOURCE:
every other rank sends numbered messages to rank 0, which takes them with recvs from any
source posted before the messages came and after they were stashed, small (sent eagerly) and
large (announced, sent once cleared); each recv's Work names its sender (``source``), each
sender's messages arrive in the order sent and every message exactly once. A recv of rank 1
posted before a recv from any source takes rank 1's first message; the tag is matched; a size
mismatch fails both sides and leaves the communicator usable; a recv from any source that
nobody answers fails within the timeout, naming its tag. On shared memory, TCP and both."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import torchring
from _checks import Checker, expected_allreduce, rank_input
from _world import allreduce, payload, run_world

ANY = -1  # P2P::kAnySource
LAYOUTS = {"shm-3": ("aaa", "shm"), "tcp-3": ("abc", "tcp"), "hybrid-aab": ("aab", "shm"),
           "hybrid-abab": ("abab", "shm")}
PER_SENDER = 4
SMALL, LARGE = 1001, 40_000  # int32 elements: 4 KB (eager) and 160 KB (over the 64 KiB eager limit)


def _key(src: int, n: int) -> int:
    return src * 100 + n


def _take(chk: Checker, works: list[tuple[Any, torch.Tensor]], numel: int, world: int,
          next_of: dict[int, int]) -> None:
    """Checks each recv's sender and content: the sender's next message in the order it sent them."""
    for work, buf in works:
        work.wait()
        src = work.source
        if src not in next_of:
            chk.fail("recv from any source", f"source {src} is not a sending rank (1..{world - 1})")
            continue
        n = next_of[src]
        next_of[src] = n + 1
        chk.equal(f"message #{n} of rank {src} ({numel} elements)", buf, payload(_key(src, n), numel, torch.int32))


def _job(rank: int, comm: Any, world: int) -> list[str]:
    chk = Checker(rank)
    for numel in (SMALL, LARGE):
        if rank == 0:
            next_of = {src: 0 for src in range(1, world)}
            total = (world - 1) * PER_SENDER
            early = [(comm.recv(buf, ANY, 3), buf) for buf in
                     (torch.empty(numel, dtype=torch.int32) for _ in range(total // 2))]
            allreduce(comm, torch.ones(1))  # the senders start now: half the recvs wait for them
            _take(chk, early, numel, world, next_of)
            time.sleep(0.2)  # the rest arrived meanwhile: they wait in the stash
            late = [(comm.recv(buf, ANY, 3), buf) for buf in
                    (torch.empty(numel, dtype=torch.int32) for _ in range(total - total // 2))]
            _take(chk, late, numel, world, next_of)
            chk.true(f"every message once ({numel} elements)",
                     next_of == {src: PER_SENDER for src in range(1, world)}, f"taken per sender: {next_of}")
        else:
            allreduce(comm, torch.ones(1))
            sends = [comm.send(payload(_key(rank, n), numel, torch.int32), 0, 3) for n in range(PER_SENDER)]
            for work in sends:
                work.wait()
        got = allreduce(comm, rank_input(rank, world, 300, torch.int32))
        chk.equal(f"allreduce after the messages of {numel}", got, expected_allreduce(world, 300, torch.int32, "SUM"))
    return chk.failures


@pytest.mark.parametrize("layout", LAYOUTS)
def test_recv_from_any_source_takes_every_message_once_in_order(layout: str) -> None:
    hosts, transport = LAYOUTS[layout]
    world = len(hosts)
    results = run_world(world, lambda r, c: _job(r, c, world), hosts, transport, one_shot_bytes=0)
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


@pytest.mark.parametrize("hosts,transport", [("aaa", "shm"), ("abc", "tcp")])
def test_the_earlier_posted_recv_matches_first_and_tags_are_kept(hosts: str, transport: str) -> None:
    """Rank 0 posts recv(src=1), then a recv from any source, both tag 3, and one from any
    source with tag 9; rank 1 sends two messages with tag 3, rank 2 one with tag 9 and one with
    tag 3. The recv of rank 1 takes rank 1's first message; tag 9's takes rank 2's."""
    def job(rank: int, comm: Any) -> Any:
        if rank == 0:
            bufs = [torch.empty(5, dtype=torch.int64) for _ in range(4)]
            first = comm.recv(bufs[0], 1, 3)
            anyone = comm.recv(bufs[1], ANY, 3)
            nine = comm.recv(bufs[2], ANY, 9)
            allreduce(comm, torch.ones(1))
            for work in (first, anyone, nine):
                work.wait()
            rest = comm.recv(bufs[3], ANY, 3)
            rest.wait()
            return ([w.source for w in (first, anyone, nine, rest)],
                    [int(b[0]) for b in bufs])
        allreduce(comm, torch.ones(1))
        tags = [3, 3] if rank == 1 else [9, 3]
        sends = [comm.send(torch.full((5,), 10 * rank + i, dtype=torch.int64), 0, tag)
                 for i, tag in enumerate(tags)]
        for work in sends:
            work.wait()
        return None

    sources, firsts = run_world(3, job, hosts, transport)[0]
    assert sources[0] == 1 and firsts[0] == 10, (sources, firsts)  # rank 1's first message
    assert sources[2] == 2 and firsts[2] == 20, (sources, firsts)  # the only tag 9 message
    # The other two tag-3 messages (rank 1's second, rank 2's) went one to each recv from any source.
    assert sorted(zip(sources[1::2], firsts[1::2])) == [(1, 11), (2, 21)], (sources, firsts)


@pytest.mark.parametrize("hosts,transport", [("aa", "shm"), ("ab", "tcp")])
def test_a_size_mismatch_from_any_source_fails_both_and_keeps_the_communicator(hosts: str, transport: str) -> None:
    def job(rank: int, comm: Any) -> tuple[str, list[int]]:
        buf = torch.empty(4, dtype=torch.int32)
        if rank == 0:
            with pytest.raises(torchring.CollectiveMismatchError) as caught:
                comm.recv(torch.empty(3, dtype=torch.int32), ANY, 0).wait()
        else:
            with pytest.raises(torchring.CollectiveMismatchError) as caught:
                comm.send(torch.ones(4, dtype=torch.int32), 0, 0).wait()
        if rank == 0:
            comm.recv(buf, ANY, 0).wait()
        else:
            comm.send(torch.full((4,), 7, dtype=torch.int32), 0, 0).wait()
        return str(caught.value), buf.tolist()

    (error0, got), (error1, _) = run_world(2, job, hosts, transport)
    assert "recv from any source, matched rank 1" in error0 and "12 bytes" in error0, error0
    assert "16 bytes" in error1 and "12 bytes" in error1, error1
    assert got == [7] * 4


def test_a_recv_from_any_source_nobody_answers_fails_within_the_timeout() -> None:
    def job(rank: int, comm: Any) -> tuple[str, float] | None:
        if rank == 1:
            return None
        start = time.monotonic()
        with pytest.raises(torchring.CommunicatorFailedError) as caught:
            comm.recv(torch.empty(8), ANY, 4).wait()
        return str(caught.value), time.monotonic() - start

    error, took = run_world(2, job, "ab", "tcp", timeout=1.0)[0]
    assert "recv from any source (tag 4, float32[8]) got no message within 1 s" in error, error
    assert "no rank sent one with tag 4" in error and took < 4.0, (took, error)
