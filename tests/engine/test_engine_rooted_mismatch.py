"""Mismatches in the rooted, all-to-all, fused and point-to-point operations, in process (tests/support/_world.py): a rank whose reduce
root, gather/scatter shape, alltoall splits, row shape or dtype, uneven reduce_scatter rows or
allreduce_many tensors differ from its peers', and a recv whose size differs from the send's.
Every rank taking part gets CollectiveMismatchError naming the ranks and the numbers that
differ, blocking and queued, and the next operations (collectives and send/recv) are exact;
on shared memory, TCP and both, with the odd rank first, in the middle or last."""

from __future__ import annotations

import re
from typing import Any, Callable, NamedTuple

import pytest
import torch

import torchring
from _checks import Checker, expected_allreduce, rank_input, reference
from _world import mismatch_text, payload, run_world, submit_op
from torchring._core.types import OpKind, ReduceOp

# name -> (host of each rank, transport, the odd rank, (sender, receiver) pairs for send/recv:
# within a host and across hosts where the layout has both)
LAYOUTS = {
    "shm-aaa": ("aaa", "shm", 1, [(1, 2), (0, 1)]),
    "tcp-abcd": ("abcd", "tcp", 3, [(3, 0), (1, 3)]),
    "hybrid-aab": ("aab", "shm", 2, [(2, 1), (0, 1)]),
    "hybrid-abab": ("abab", "shm", 0, [(0, 2), (3, 0)]),
}
I64 = torch.int64


class Case(NamedTuple):
    """`call(comm, rank, world, odd, inline)` queues one operation (the odd rank's differs) and
    returns its Work; `words(world)` are the patterns every rank's error must contain; `pair`:
    the error must also name a rank whose call differs from the odd rank's (False where the odd
    rank's call contradicts itself or what it expects from every rank, itself included)."""

    call: Callable[[Any, int, int, int, bool], Any]
    words: Callable[[int], list[str]]
    pair: bool = True


def _reduce_root(comm: Any, rank: int, world: int, odd: int, inline: bool) -> Any:
    root = world - 2 if rank == odd else world - 1
    return submit_op(comm, OpKind.REDUCE, torch.ones(10), ReduceOp.SUM, root, inline)


def _gather_shape(comm: Any, rank: int, world: int, odd: int, inline: bool) -> Any:
    shape = (3, 5) if rank == odd else (3, 4)
    return submit_op(comm, OpKind.GATHER, torch.ones(shape, dtype=torch.int32), root=0, inline=inline)


def _scatter_shape(comm: Any, rank: int, world: int, odd: int, inline: bool) -> Any:
    out = torch.zeros(7 if rank == odd else 6, dtype=torch.float64)
    concat = [torch.ones(world * out.numel(), dtype=torch.float64)] if rank == world - 1 else []
    return submit_op(comm, OpKind.SCATTER, out, root=world - 1, inline=inline, tensors=concat)


def _kind(comm: Any, rank: int, world: int, odd: int, inline: bool) -> Any:
    kind = OpKind.GATHER if rank == odd else OpKind.REDUCE
    return submit_op(comm, kind, torch.ones(10), ReduceOp.SUM, 0, inline)


def _alltoall(comm: Any, rows: int, cols: int, splits: list[int], dtype: torch.dtype, inline: bool,
              recv: list[int] | None = None) -> Any:
    """An alltoall of [rows, cols]; `recv` given: the rows this rank is sure to get from each."""
    known = recv is not None
    return submit_op(comm, OpKind.ALLTOALL, torch.ones(rows, cols, dtype=dtype), inline=inline,
                     send_splits=torch.tensor(splits, dtype=I64),
                     recv_splits=torch.tensor(recv if known else [0] * len(splits), dtype=I64),
                     recv_splits_known=known)


def _splits_sum(comm: Any, rank: int, world: int, odd: int, inline: bool) -> Any:
    splits = [11] * world
    if rank == odd:
        splits[-1] = 12  # sums to 11 * world + 1, but dim 0 is 11 * world
    return _alltoall(comm, 11 * world, 2, splits, torch.float32, inline)


def _recv_splits(comm: Any, rank: int, world: int, odd: int, inline: bool) -> Any:
    expect = [12 if rank == odd else 11] * world  # every peer sends 11 rows
    return _alltoall(comm, 11 * world, 2, [11] * world, torch.float32, inline, expect)


def _alltoall_cols(comm: Any, rank: int, world: int, odd: int, inline: bool) -> Any:
    return _alltoall(comm, 2 * world, 19 if rank == odd else 17, [2] * world, torch.float32, inline)


def _alltoall_dtype(comm: Any, rank: int, world: int, odd: int, inline: bool) -> Any:
    dtype = torch.int32 if rank == odd else torch.float32
    return _alltoall(comm, 2 * world, 3, [2] * world, dtype, inline)


def _reduce_scatter_rows(comm: Any, rank: int, world: int, odd: int, inline: bool) -> Any:
    return submit_op(comm, OpKind.REDUCE_SCATTER, torch.ones(8 if rank == odd else 7), inline=inline)


def _many_sizes(comm: Any, rank: int, world: int, odd: int, inline: bool) -> Any:
    tensors = [torch.ones(30), torch.ones(41 if rank == odd else 40)]
    return submit_op(comm, OpKind.ALLREDUCE_MANY, None, inline=inline, tensors=tensors)


def _many_dtype(comm: Any, rank: int, world: int, odd: int, inline: bool) -> Any:
    dtype = torch.float64 if rank == odd else torch.float32
    return submit_op(comm, OpKind.ALLREDUCE_MANY, None, inline=inline,
                     tensors=[torch.ones(5, dtype=dtype), torch.ones(6, dtype=dtype)])


def _either(*words: str) -> str:
    return "|".join(re.escape(w) for w in words)


CASES: dict[str, Case] = {
    "reduce root": Case(_reduce_root, lambda w: [rf"root\D{{0,3}}{w - 1}\b", rf"root\D{{0,3}}{w - 2}\b"]),
    "gather shape": Case(_gather_shape, lambda w: [re.escape("[3, 4]"), re.escape("[3, 5]")]),
    "scatter shape": Case(_scatter_shape, lambda w: [re.escape("[6]"), re.escape("[7]")]),
    "kind": Case(_kind, lambda w: [r"\breduce\b", r"\bgather\b"]),
    "alltoall recv splits": Case(_recv_splits, lambda w: [r"\b11\b", r"\b12\b"], False),
    "alltoall row shape": Case(_alltoall_cols, lambda w: [r"\b17\b", r"\b19\b"]),
    "alltoall dtype": Case(_alltoall_dtype, lambda w: [r"\bfloat32\b", r"\bint32\b"]),
    "reduce_scatter rows": Case(_reduce_scatter_rows, lambda w: [re.escape("[7]"), re.escape("[8]")]),
    "allreduce_many sizes": Case(_many_sizes, lambda w: [rf"\b({_either('40', '70')})\b",
                                                         rf"\b({_either('41', '71')})\b"]),
    "allreduce_many dtype": Case(_many_dtype, lambda w: [r"\bfloat32\b", r"\bfloat64\b"]),
}
ASYNC_CASES = ["gather shape", "alltoall recv splits", "allreduce_many sizes"]
# The odd rank's splits sum to one row more than its dim 0: its own arguments disagree, so an
# engine could refuse them on that rank alone, but then its peers would wait for it until the
# timeout and the communicator would fail; the header exchange must fail it on every rank.
SPLITS_SUM = Case(_splits_sum, lambda w: [rf"\b{11 * w}\b", rf"\b{11 * w + 1}\b"], False)



def _followups(comm: Any, rank: int, world: int, inline: bool) -> list[tuple[str, Any, torch.Tensor]]:
    """Exact multi-segment operations queued after a mismatch: (what, Work, expected result)."""
    n = 5003
    ins = [rank_input(r, world, n, torch.float32) for r in range(world)]
    out = [("allreduce float32[5003]", submit_op(comm, OpKind.ALLREDUCE, ins[rank].clone(), inline=inline),
            reference(ins, "SUM")),
           (f"reduce float32[5003] root={world - 1}",
            submit_op(comm, OpKind.REDUCE, ins[rank].clone(), ReduceOp.MAX, world - 1, inline),
            reference(ins, "MAX") if rank == world - 1 else ins[rank])]
    send = [[1000 + r + 3 * j for j in range(world)] for r in range(world)]
    mine = rank_input(rank, world, sum(send[rank]), torch.int32)
    want = torch.cat([rank_input(r, world, sum(send[r]), torch.int32)[sum(send[r][:rank]):][:send[r][rank]]
                      for r in range(world)])
    work = submit_op(comm, OpKind.ALLTOALL, mine, inline=inline,
                     send_splits=torch.tensor(send[rank], dtype=I64), recv_splits=torch.zeros(world, dtype=I64))
    out.append((f"alltoall int32 splits={send}", work, want))
    return out


def _p2p_followup(chk: Checker, comm: Any, rank: int, a: int, b: int, tag: int) -> None:
    """a sends b a 300 KB message with `tag`: exact."""
    n = 75_001
    if rank == a:
        comm.send(payload(a * 10 + b, n, torch.int32), b, tag).wait()
    elif rank == b:
        got = comm.recv(torch.empty(n, dtype=torch.int32), a, tag).wait()
        chk.equal(f"recv from rank {a} tag {tag} after the size mismatch", got,
                  payload(a * 10 + b, n, torch.int32))


def _p2p_size_mismatch(comm: Any, rank: int, a: int, b: int) -> str | None:
    """a sends int32[10] with tag 3, b receives int32[12]: both must fail."""
    if rank == a:
        return mismatch_text(comm.send(torch.ones(10, dtype=torch.int32), b, 3))
    if rank == b:
        return mismatch_text(comm.recv(torch.empty(12, dtype=torch.int32), a, 3))
    return "not involved"


def _job(rank: int, comm: Any, world: int, odd: int,
         pairs: list[tuple[int, int]]) -> tuple[dict[str, str | None], list[str]]:
    chk = Checker(rank)
    errors: dict[str, str | None] = {}
    for name, case in CASES.items():
        errors[name] = mismatch_text(case.call(comm, rank, world, odd, True))
        for what, work, want in _followups(comm, rank, world, True):
            chk.equal(f"{what} after the {name} mismatch", work.wait(), want)
    for name in ASYNC_CASES:
        bad = CASES[name].call(comm, rank, world, odd, False)
        followups = _followups(comm, rank, world, False)
        errors[f"queued {name}"] = mismatch_text(bad)
        for what, work, want in followups:
            chk.equal(f"{what} queued behind the {name} mismatch", work.wait(), want)
    for a, b in pairs:
        errors[f"send/recv {a}->{b}"] = _p2p_size_mismatch(comm, rank, a, b)
        _p2p_followup(chk, comm, rank, a, b, 3)
        got = submit_op(comm, OpKind.ALLREDUCE, rank_input(rank, world, 100, torch.int64)).wait()
        chk.equal(f"allreduce after the send/recv {a}->{b} mismatch", got,
                  expected_allreduce(world, 100, torch.int64, "SUM"))
    return errors, chk.failures


def _problem(err: str | None, odd: int | None, words: list[str], pair: bool = True) -> str | None:
    """What is missing from an error, or None if it names the odd rank (when `odd` is given)
    and another one (when `pair` is) and matches every pattern of `words`."""
    if err is None:
        return "no CollectiveMismatchError"
    named = {int(r) for r in re.findall(r"\brank (\d+)", err)}
    if odd is not None and odd not in named:
        return f"does not name the odd rank {odd}: {err}"
    if odd is not None and pair and not named - {odd}:
        return f"does not name a rank that disagrees with rank {odd}: {err}"
    missing = [w for w in words if not re.search(w, err)]
    return f"lacks {missing}: {err}" if missing else None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rooted_and_p2p_mismatches_fail_every_rank_and_leave_no_state(layout: str) -> None:
    hosts, transport, odd, pairs = LAYOUTS[layout]
    world = len(hosts)
    results = run_world(world, lambda r, c: _job(r, c, world, odd, pairs), hosts, transport,
                        one_shot_bytes=0, timeout=5.0)
    problems = [f for _, failures in results for f in failures]
    for rank, (errors, _) in enumerate(results):
        for name, err in errors.items():
            if name.startswith("send/recv"):
                a, b = (int(x) for x in name.split()[1].split("->"))
                if rank not in (a, b):
                    continue
                # the peer, the tag and both sizes (in elements or bytes)
                words = [rf"\brank {b if rank == a else a}\b", r"tag\D{0,3}3\b",
                         rf"\b({_either('10', '40')})\b", rf"\b({_either('12', '48')})\b"]
                problem = _problem(err, None, words)
            else:
                case = CASES[name.removeprefix("queued ")]
                problem = _problem(err, odd, case.words(world), case.pair)
            if problem:
                problems.append(f"rank {rank}, {name}: {problem}")
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:30])


@pytest.mark.parametrize("hosts,transport,odd", [("aaa", "shm", 1), ("abab", "shm", 3)])
def test_alltoall_splits_not_summing_to_dim0_fail_every_rank(hosts: str, transport: str, odd: int) -> None:
    world = len(hosts)

    def job(rank: int, comm: Any) -> tuple[str | None, list[str]]:
        chk = Checker(rank)
        try:
            error = mismatch_text(SPLITS_SUM.call(comm, rank, world, odd, True))
        except (ValueError, torchring.CommunicatorFailedError) as e:
            # refused on the odd rank alone: its peers wait for it and the communicator fails
            return f"{type(e).__name__}: {e}", chk.failures
        for what, work, want in _followups(comm, rank, world, True):
            chk.equal(f"{what} after the mismatch", work.wait(), want)
        return error, chk.failures

    results = run_world(world, job, hosts, transport, one_shot_bytes=0, timeout=3.0)
    problems = [f for _, failures in results for f in failures]
    for rank, (error, _) in enumerate(results):
        problem = _problem(error, odd, SPLITS_SUM.words(world), SPLITS_SUM.pair)
        if problem or (error or "").startswith(("ValueError", "CommunicatorFailedError")):
            problems.append(f"rank {rank}: {problem or error}")
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:30])
