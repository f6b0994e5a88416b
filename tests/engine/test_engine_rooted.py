"""The rooted, all-to-all and fused collectives on the engine, in process (tests/support/_world.py): reduce, gather and
scatter from every root, alltoall with uneven and empty splits, reduce_scatter with dim 0 not
divisible by the world size (into a caller's tensor too), alltoall from a rank that sends no
rows but receives some, splits whose sum overflows int64 (a mismatch on every rank, and the next
operation exact), allreduce_many, prescale/postscale;
every dtype (int16 included, bool where the op moves data or takes MIN/MAX), sizes 0, 1, odd
and multi-segment, at worlds 1-4 on shared memory, TCP and both. Inputs are small integers,
so every result is exact; each rank computes the expected result from every rank's input with
plain torch ops."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from _checks import Checker, expected_allreduce, rank_input, reference, valid_ops
from _world import run_world, submit_op
from torchring._core.types import OpKind, ReduceOp

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool]
SIZES = [0, 1, 7, 1001, 5000]  # 5000 elements: more than one 4 KiB segment for every dtype

FEW = [torch.float32, torch.bfloat16, torch.int16, torch.bool]  # on the slower 4-rank layouts
# name -> (host of each rank, transport, one-shot limit, dtypes); segments are 4 KiB
LAYOUTS = {
    "one": ("a", "shm", None, DTYPES),
    "shm-3-chunked": ("aaa", "shm", 0, DTYPES),
    "shm-4": ("aaaa", "shm", None, FEW),
    "tcp-2": ("ab", "tcp", None, FEW),
    "tcp-3": ("abc", "tcp", None, DTYPES),
    "hybrid-aab": ("aab", "shm", 0, DTYPES),
    "hybrid-abab": ("abab", "shm", None, FEW),
    "hybrid-aabb": ("aabb", "shm", 0, FEW),
}


def _rows(d0: int, world: int, r: int) -> tuple[int, int]:
    """(offset, count) of rank r's rows when d0 rows are split as evenly as possible, the first
    d0 % world ranks taking one row more (Horovod's reducescatter)."""
    base, extra = divmod(d0, world)
    return r * base + min(r, extra), base + (r < extra)


def _scaled_reference(inputs: list[torch.Tensor], op: str, pre: float, post: float) -> torch.Tensor:
    """post * (sum of pre * x) (divided by the world size for AVG), in float64, cast back."""
    total = torch.stack([t.to(torch.float64) * pre for t in inputs]).sum(0) * post
    if op == "AVG":
        total = total / len(inputs)
    return total.to(inputs[0].dtype)


def _reduce_gather_scatter(rank: int, comm: Any, world: int, dtypes: list[torch.dtype]) -> list[str]:
    chk = Checker(rank)
    turn = 0  # the root moves on with every call, so every rank is the root of many
    for dtype in dtypes:
        for op in valid_ops(dtype):
            for n in SIZES:
                root, turn = turn % world, turn + 1
                inputs = [rank_input(r, world, n, dtype, op) for r in range(world)]
                t = inputs[rank].clone()
                got = submit_op(comm, OpKind.REDUCE, t, ReduceOp[op], root).wait()
                what = f"reduce {dtype} {op} [{n}] root={root}"
                chk.equal(what, got, reference(inputs, op) if rank == root else inputs[rank])
                chk.equal(f"{what} (in place)", t, reference(inputs, op) if rank == root else inputs[rank])
        for shape in [(), (0,), (1,), (7,), (3, 5), (5000,)]:
            root, turn = turn % world, turn + 1
            numel = 1
            for s in shape:
                numel *= s
            inputs = [rank_input(r, world, numel, dtype, shape=shape) for r in range(world)]
            got = submit_op(comm, OpKind.GATHER, inputs[rank].clone(), root=root).wait()
            what = f"gather {dtype}{list(shape)} root={root}"
            if rank == root:
                chk.equal(what, got, torch.cat([x.reshape((1,) if x.dim() == 0 else x.shape) for x in inputs]))
            else:
                chk.true(what, got is None, f"a rank other than the root got {type(got).__name__}, not None")
        for shape in [(0,), (1,), (7,), (3, 5), (5000,)]:
            root, turn = turn % world, turn + 1
            numel = 1
            for s in shape:
                numel *= s
            chunks = [rank_input(r + 2 * root, world, numel, dtype, shape=shape) for r in range(world)]
            out = torch.zeros(shape, dtype=dtype)
            concat = [torch.cat(chunks)] if rank == root else []
            got = submit_op(comm, OpKind.SCATTER, out, root=root, tensors=concat).wait()
            what = f"scatter {dtype}{list(shape)} root={root}"
            chk.equal(what, got, chunks[rank])
            chk.equal(f"{what} (in place)", out, chunks[rank])
    # int16 on today's collectives, and bool where they only move data.
    for n in (0, 7, 5000):
        for op in valid_ops(torch.int16):
            t = rank_input(rank, world, n, torch.int16, op)
            got = submit_op(comm, OpKind.ALLREDUCE, t, ReduceOp[op]).wait()
            chk.equal(f"allreduce int16 {op} [{n}]", got, expected_allreduce(world, n, torch.int16, op))
        for dtype in (torch.int16, torch.bool):
            root, turn = turn % world, turn + 1
            got = submit_op(comm, OpKind.BROADCAST, rank_input(rank, world, n, dtype), root=root).wait()
            chk.equal(f"broadcast {dtype} [{n}] root={root}", got, rank_input(root, world, n, dtype))
            inputs = [rank_input(r, world, n * (r + 1), dtype) for r in range(world)]  # uneven rows
            got = submit_op(comm, OpKind.ALLGATHER, inputs[rank]).wait()
            chk.equal(f"allgather {dtype} [{n} * (rank + 1)]", got, torch.cat(inputs))
    # Queued, not inline: completed in submission order.
    n = 2000
    ins = [rank_input(r, world, n, torch.int16) for r in range(world)]
    works = [submit_op(comm, OpKind.REDUCE, ins[rank].clone(), ReduceOp.SUM, world - 1, inline=False),
             submit_op(comm, OpKind.GATHER, ins[rank].clone(), root=0, inline=False),
             submit_op(comm, OpKind.REDUCE, ins[rank].clone(), ReduceOp.MAX, 0, inline=False)]
    chk.equal("queued reduce SUM", works[0].wait(), reference(ins, "SUM") if rank == world - 1 else ins[rank])
    got = works[1].wait()
    if rank == 0:
        chk.equal("queued gather", got, torch.cat(ins))
    chk.equal("queued reduce MAX", works[2].wait(), reference(ins, "MAX") if rank == 0 else ins[rank])
    return chk.failures


def _alltoall_case(chk: Checker, rank: int, comm: Any, world: int, dtype: torch.dtype,
                   splits: Callable[[int, int], int], cols: int | None, known: bool, use_out: bool) -> None:
    """One alltoall: rank r sends splits(r, j) rows (of `cols` columns; 1-D if None) to rank j."""
    send = [[splits(r, j) for j in range(world)] for r in range(world)]
    inputs = [rank_input(r, world, sum(send[r]) * (cols or 1), dtype,
                         shape=(sum(send[r]),) if cols is None else (sum(send[r]), cols)) for r in range(world)]
    pieces = []
    for r in range(world):  # what rank r sends to this rank: its rows after those for ranks < rank
        start = sum(send[r][:rank])
        pieces.append(inputs[r][start:start + send[r][rank]])
    want = torch.cat(pieces)
    expected_splits = [send[r][rank] for r in range(world)]
    recv = torch.tensor(expected_splits if known else [0] * world, dtype=torch.int64)
    out = torch.full_like(want, 3) if use_out else None
    got = submit_op(comm, OpKind.ALLTOALL, inputs[rank].clone(), out=out,
                    send_splits=torch.tensor(send[rank], dtype=torch.int64), recv_splits=recv,
                    recv_splits_known=known).wait()
    what = f"alltoall {dtype} cols={cols} splits={send} known={known} out={use_out}"
    chk.equal(what, got, want)
    chk.true(f"{what}: received splits", recv.tolist() == expected_splits,
             f"got {recv.tolist()}, expected {expected_splits}")
    if out is not None:
        chk.equal(f"{what} (out)", out, want)


def _alltoall_reduce_scatter_many(rank: int, comm: Any, world: int, dtypes: list[torch.dtype]) -> list[str]:
    chk = Checker(rank)
    for d, dtype in enumerate(dtypes):
        # (rows rank r sends rank j, columns or 1-D, recv splits known, into out=); out= needs
        # the receive splits known
        for splits, cols, known, use_out in [
                (lambda r, j: (r + 2 * j + d) % 3, None, d % 2 == 0, d % 4 == 0),  # uneven, some none
                (lambda r, j: 1000 + 7 * r + j, 3, d % 2 == 1, d % 4 == 1),  # multi-segment
                (lambda r, j: 0, 2, d % 2 == 0, d % 4 == 2)]:  # nothing at all
            _alltoall_case(chk, rank, comm, world, dtype, splits, cols, known, use_out)
        for op in valid_ops(dtype):
            for i, shape in enumerate([(0,), (1,), (7, 3), (1001,), (5003,)]):
                inputs = [rank_input(r, world, shape[0] * (shape[1] if len(shape) > 1 else 1), dtype, op, shape)
                          for r in range(world)]
                off, count = _rows(shape[0], world, rank)
                want = reference(inputs, op)[off:off + count]
                out = torch.full_like(want, 3) if i % 2 == 0 else None
                got = submit_op(comm, OpKind.REDUCE_SCATTER, inputs[rank].clone(), ReduceOp[op], out=out).wait()
                what = f"reduce_scatter {dtype} {op} {list(shape)} out={out is not None}"
                chk.equal(what, got, want)
                if out is not None:
                    chk.equal(f"{what} (out)", out, want)
                    chk.true(f"{what}: wait() returns out",
                             got.data_ptr() == out.data_ptr() or out.numel() == 0, "another tensor")
        op = "MIN" if dtype == torch.bool else "SUM"
        shapes = [(0,), (1,), (7,), (3, 5), (5000,)]
        inputs = [[rank_input(r + k, world, s[0] * (s[1] if len(s) > 1 else 1), dtype, op, s)
                   for k, s in enumerate(shapes)] for r in range(world)]
        mine = [t.clone() for t in inputs[rank]]
        chk.true(f"allreduce_many {dtype} {op}: wait() returns None",
                 submit_op(comm, OpKind.ALLREDUCE_MANY, None, ReduceOp[op], tensors=mine).wait() is None)
        for k, t in enumerate(mine):
            want = reference([inputs[r][k] for r in range(world)], op)
            chk.equal(f"allreduce_many {dtype} {op} tensor {k}", t, want)
    _scales(chk, rank, comm, world)
    return chk.failures


def _scales(chk: Checker, rank: int, comm: Any, world: int) -> None:
    """prescale/postscale on allreduce, reduce_scatter and allreduce_many, SUM and AVG."""
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        # Powers of two keep 16-bit results exact; float32/64 take a factor of 3 exactly.
        pre, post = (3.0, 0.5) if dtype in (torch.float32, torch.float64) else (2.0, 0.25)
        for op in ("SUM", "AVG"):
            for n in (1, 7, 5000):
                inputs = [rank_input(r, world, n, dtype, op) for r in range(world)]
                want = _scaled_reference(inputs, op, pre, post)
                what = f"{dtype} {op} [{n}] prescale={pre} postscale={post}"
                got = submit_op(comm, OpKind.ALLREDUCE, inputs[rank].clone(), ReduceOp[op],
                                prescale=pre, postscale=post).wait()
                chk.equal(f"allreduce {what}", got, want)
                off, count = _rows(n, world, rank)
                got = submit_op(comm, OpKind.REDUCE_SCATTER, inputs[rank].clone(), ReduceOp[op],
                                prescale=pre, postscale=post).wait()
                chk.equal(f"reduce_scatter {what}", got, want[off:off + count])
                mine = [inputs[rank].clone(), inputs[rank][:1].clone()]
                submit_op(comm, OpKind.ALLREDUCE_MANY, None, ReduceOp[op], tensors=mine,
                          prescale=pre, postscale=post).wait()
                chk.equal(f"allreduce_many {what} tensor 0", mine[0], want)
                chk.equal(f"allreduce_many {what} tensor 1", mine[1], want[:1])
    if world > 1:
        # prescale applies before the sum: float16 values whose plain sum overflows (65504)
        # must come back finite when halved first.
        v = float(64 * int(80_000 / world / 64))
        got = submit_op(comm, OpKind.ALLREDUCE, torch.full((7,), v, dtype=torch.float16),
                        prescale=0.5).wait()
        chk.equal(f"allreduce float16 {v:g} x {world} ranks prescale=0.5", got,
                  torch.full((7,), v * world / 2, dtype=torch.float16))
    # Factors on an integer dtype are refused; the next collective is exact.
    for kind in (OpKind.ALLREDUCE, OpKind.REDUCE_SCATTER):
        try:
            submit_op(comm, kind, torch.ones(world * 2, dtype=torch.int32), prescale=2.0).wait()
            chk.fail(f"{kind.name} int32 prescale=2.0", "no ValueError")
        except ValueError as e:
            chk.true(f"{kind.name} int32 prescale=2.0: the message names the dtype", "int32" in str(e), str(e))
    got = submit_op(comm, OpKind.ALLREDUCE, rank_input(rank, world, 9, torch.int32)).wait()
    chk.equal("allreduce after the refused factors", got, expected_allreduce(world, 9, torch.int32, "SUM"))


def _sweep(layout: str, sweep: Callable[[int, Any, int, list[torch.dtype]], list[str]]) -> None:
    hosts, transport, one_shot, dtypes = LAYOUTS[layout]
    world = len(hosts)
    results = run_world(world, lambda r, c: sweep(r, c, world, dtypes), hosts, transport, one_shot_bytes=one_shot)
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reduce_gather_scatter(layout: str) -> None:
    _sweep(layout, _reduce_gather_scatter)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_alltoall_reduce_scatter_allreduce_many_scales(layout: str) -> None:
    _sweep(layout, _alltoall_reduce_scatter_many)


# alltoall at its edges: a rank without rows, splits whose sum overflows int64.
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
