"""Point-to-point send/recv on the engine, in process (tests/support/_world.py): every dtype at
sizes 0, 1, odd and multi-segment, exchanged in both directions at once; a ring pass of
messages larger than 256 KiB (they wrap the shared-memory ring); FIFO order per (peer, tag),
and tags received in another order than sent; on shared memory, TCP and both (fake hosts),
at worlds 2-4. Every message is built from its (sender, receiver, key) alone, so each rank
checks what it received against its own copy of what the sender sent."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _checks import Checker, expected_allreduce, rank_input
from _world import payload, run_world, submit
from torchring._core.types import OpKind

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool]
SIZES = [0, 1, 7, 1001, 5000]  # 5000 elements: more than one 4 KiB segment for every dtype
BIG = 300_000  # float32 elements: 1.2 MB, larger than a 256 KiB ring

# name -> (host of each rank, transport)
LAYOUTS = {
    "shm-2": ("aa", "shm"),
    "shm-4": ("aaaa", "shm"),
    "tcp-3": ("abc", "tcp"),
    "hybrid-aab": ("aab", "shm"),
    "hybrid-abab": ("abab", "shm"),
    "hybrid-aabb": ("aabb", "shm"),
}


def _key(src: int, dst: int, n: int) -> int:
    """Distinct message contents per sender, receiver and message number."""
    return src * 1000 + dst * 100 + n


def _received(chk: Checker, what: str, work: Any, buf: torch.Tensor, want: torch.Tensor) -> None:
    """Checks that recv's wait() returns the buffer it filled, holding `want`."""
    got = work.wait()
    if isinstance(got, torch.Tensor):
        chk.true(f"{what}: wait() returns the receive buffer", got.data_ptr() == buf.data_ptr()
                 or buf.numel() == 0, "it returned another tensor")
    chk.equal(what, got, want)
    chk.equal(f"{what} (the buffer)", buf, want)


def _exchange_every_dtype(chk: Checker, rank: int, comm: Any, world: int) -> None:
    """Each rank sends to its right and receives from its left at the same time (with two ranks,
    both directions between the same pair): a blocking send first would deadlock."""
    right, left = (rank + 1) % world, (rank - 1) % world
    for d, dtype in enumerate(DTYPES):
        for n in SIZES:
            buf = torch.empty(n, dtype=dtype)
            sent = comm.send(payload(_key(rank, right, d), n, dtype), right, 0)
            got = comm.recv(buf, left, 0)
            _received(chk, f"{dtype}[{n}] from rank {left}", got, buf, payload(_key(left, rank, d), n, dtype))
            sent.wait()
    # A 2-D tensor and a non-zero tag: only the bytes travel, in order.
    buf = torch.empty(3, 5, dtype=torch.int64)
    sent = comm.send(payload(_key(rank, right, 99), 15, torch.int64, (3, 5)), right, 123_456)
    _received(chk, "int64[3, 5] tag 123456", comm.recv(buf, left, 123_456), buf,
              payload(_key(left, rank, 99), 15, torch.int64, (3, 5)))
    sent.wait()


def _ring_pass(chk: Checker, rank: int, comm: Any, world: int) -> None:
    """world-1 steps: each rank forwards what it received, so every message crosses every link."""
    right, left = (rank + 1) % world, (rank - 1) % world
    for dtype, numel in ((torch.float32, BIG), (torch.int16, BIG // 2 + 1)):
        mine = payload(rank, numel, dtype)
        for step in range(world - 1):
            buf = torch.empty(numel, dtype=dtype)
            sent, got = comm.send(mine, right, 7), comm.recv(buf, left, 7)
            origin = (rank - step - 1) % world
            _received(chk, f"ring pass {dtype}[{numel}] step {step} (from rank {origin})", got, buf,
                      payload(origin, numel, dtype))
            sent.wait()
            mine = buf


def _fifo_per_tag(chk: Checker, rank: int, comm: Any, world: int) -> None:
    """Rank 0 sends four messages with one tag to every other rank while they send four to it;
    each side posts everything before waiting, and every message arrives in order."""
    sizes = [70_001, 70_001, 70_001, 7]  # 280 KB each: the later ones start mid-ring
    peers = [p for p in range(world) if p != rank] if rank == 0 else [0]
    sends = [comm.send(payload(_key(rank, p, i), n, torch.int32), p, 5)
             for p in peers for i, n in enumerate(sizes)]
    recvs = []
    for p in peers:
        for i, n in enumerate(sizes):
            buf = torch.empty(n, dtype=torch.int32)
            recvs.append((f"message #{i} with tag 5 from rank {p}", comm.recv(buf, p, 5), buf,
                          payload(_key(p, rank, i), n, torch.int32)))
    for what, work, buf, want in recvs:
        _received(chk, what, work, buf, want)
    for work in sends:
        work.wait()


def _tags_out_of_order(chk: Checker, rank: int, comm: Any, world: int) -> None:
    """Every rank sends tag 1 then tag 2 to every other rank; receivers take every tag 2 first,
    and post tag 1 only after those arrived."""
    peers = [p for p in range(world) if p != rank]
    sends = [comm.send(payload(_key(rank, p, tag), 5000 if tag == 1 else 3, torch.float64), p, tag)
             for p in peers for tag in (1, 2)]
    for tag in (2, 1):
        n = 5000 if tag == 1 else 3
        posted = [(p, torch.empty(n, dtype=torch.float64)) for p in peers]
        works = [comm.recv(buf, p, tag) for p, buf in posted]
        for (p, buf), work in zip(posted, works):
            _received(chk, f"tag {tag} from rank {p}", work, buf, payload(_key(p, rank, tag), n, torch.float64))
    for work in sends:
        work.wait()


def _job(rank: int, comm: Any, world: int) -> list[str]:
    chk = Checker(rank)
    for step in (_exchange_every_dtype, _ring_pass, _fifo_per_tag, _tags_out_of_order):
        step(chk, rank, comm, world)
        # Point-to-point traffic leaves the collectives exact.
        got = submit(comm, OpKind.ALLREDUCE, rank_input(rank, world, 3000, torch.int32)).wait()
        chk.equal(f"allreduce after {step.__name__}", got, expected_allreduce(world, 3000, torch.int32, "SUM"))
    return chk.failures


@pytest.mark.parametrize("layout", LAYOUTS)
def test_send_recv_exact_and_ordered(layout: str) -> None:
    hosts, transport = LAYOUTS[layout]
    world = len(hosts)
    results = run_world(world, lambda r, c: _job(r, c, world), hosts, transport, one_shot_bytes=0)
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


def test_bad_peer_or_tag_is_a_value_error() -> None:
    """A peer outside [0, size) or a negative tag is refused before anything is sent; the next
    send/recv between the same ranks is exact."""
    def job(rank: int, comm: Any) -> tuple[list[str], bool]:
        errors = []
        for call, peer, tag in [(comm.send, 2, 0), (comm.recv, 2, 0), (comm.send, -1, 0),
                                (comm.recv, 1 - rank, -1), (comm.send, 1 - rank, -3)]:
            with pytest.raises(ValueError) as caught:
                call(torch.ones(4), peer, tag)
            errors.append(str(caught.value))
        buf = torch.empty(4, dtype=torch.int64)
        sent = comm.send(torch.full((4,), 10 + rank, dtype=torch.int64), 1 - rank, 0)
        got = comm.recv(buf, 1 - rank, 0).wait()
        sent.wait()
        return errors, got.tolist() == [11 - rank] * 4

    for rank, (errors, exact) in enumerate(run_world(2, job, "ab", "tcp")):
        assert all("2" in e for e in errors[:2]) and "-1" in errors[2], errors
        assert "-1" in errors[3] and "-3" in errors[4] and all("tag" in e for e in errors[3:]), errors
        assert exact, f"rank {rank}: the send/recv after the refused calls is wrong"


@pytest.mark.parametrize("hosts,transport", [("aa", "shm"), ("ab", "tcp")])
def test_a_send_completes_when_the_receiver_shuts_down_right_after_its_recv(hosts: str, transport: str) -> None:
    """The last message of a job: once the receiver's recv returned, the sender's send must
    complete, even though the receiver shuts its communicator down at once (repeated: a race)."""
    def job(rank: int, comm: Any) -> list[int]:
        sent = comm.send(torch.full((4,), rank, dtype=torch.int32), 1 - rank, 0)
        got = comm.recv(torch.empty(4, dtype=torch.int32), 1 - rank, 0).wait()
        sent.wait()
        return got.tolist()

    for attempt in range(10):
        assert run_world(2, job, hosts, transport, timeout=2.0) == [[1] * 4, [0] * 4], f"attempt {attempt}"
