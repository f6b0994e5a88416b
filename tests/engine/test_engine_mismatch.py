"""A mismatch leaves no state behind, in process (tests/support/_world.py): every case of
tests/spawned/api/test_mismatch.py's MISMATCHES, on shared memory, TCP and both, with the odd rank first,
in the middle or last, on the chunked path with 4 KiB segments. Each mismatch must fail on
every rank with CollectiveMismatchError naming exactly rank 0's call and the first differing
rank's call, and must be followed by exact collectives: a one-segment allreduce (on one host,
its data travels with its header), then multi-segment ones: a staged and a zero-copy
(arena) allreduce, a broadcast from the last rank, an uneven allgather and a reduce_scatter.
Then the same with async handles: the mismatched ones queued first, the follow-ups queued
behind them, all waited in order."""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch

from _checks import Checker, expected_allreduce, rank_input, reference
from _world import ENGINE, mismatch_text, run_world, submit, submit_op
from _mismatches import MISMATCHES, Call, expected_pair, message_problem
from torchring._core.types import OpKind, ReduceOp

# name -> (host of each rank, transport, odd ranks to try: first, a middle one, last)
LAYOUTS = {
    "shm-aaaa": ("aaaa", "shm", (0, 2, 3)),
    "tcp-abcd": ("abcd", "tcp", (0, 1, 3)),
    # Five hosts: 0 sits out of the header exchange's core (folds in and out), 4 is in it.
    "tcp-abcde": ("abcde", "tcp", (0, 4)),
    "hybrid-aab": ("aab", "shm", (0, 1, 2)),   # 1: the non-leader of host a; 2: host b alone
    "hybrid-abab": ("abab", "shm", (0, 2, 3)),  # 2 and 3: the non-leaders of hosts a and b
}
SEG = 1024  # float32 elements in one 4 KiB segment


class Followup(NamedTuple):
    """One exact collective: what to submit and what this rank must see afterwards."""

    what: str
    kind: OpKind
    tensor: torch.Tensor
    op: ReduceOp
    root: int
    want: torch.Tensor
    in_place: bool  # check `tensor` itself (the zero-copy allreduce), not wait()'s result


def _followups(rank: int, world: int, comm: Any) -> list[Followup]:
    """The collectives run after every mismatch; each spans several segments."""
    f32 = torch.float32
    # One segment: on one host the header exchange carries the data (one synchronization).
    n = SEG // 2 + 3
    out = [Followup(f"one-sync allreduce float32[{n}]", OpKind.ALLREDUCE, rank_input(rank, world, n, f32),
                    ReduceOp.SUM, -1, expected_allreduce(world, n, f32, "SUM"), False)]
    n = 3 * SEG + 5
    out.append(Followup(f"allreduce float32[{n}]", OpKind.ALLREDUCE, rank_input(rank, world, n, f32),
                        ReduceOp.SUM, -1, expected_allreduce(world, n, f32, "SUM"), False))
    # Zero-copy: in this rank's shared-memory arena, plain memory for a rank with no local peer.
    n = 3 * SEG + 3
    shared = comm.empty_shared([n], torch.int32)
    if shared is None:
        shared = torch.empty(n, dtype=torch.int32)
    shared.copy_(rank_input(rank, world, n, torch.int32, "MAX"))
    out.append(Followup(f"zero-copy allreduce int32[{n}] MAX", OpKind.ALLREDUCE, shared,
                        ReduceOp.MAX, -1, expected_allreduce(world, n, torch.int32, "MAX"), True))
    n, last = SEG + 7, world - 1  # int64: 3 segments
    out.append(Followup(f"broadcast int64[{n}] root={last}", OpKind.BROADCAST,
                        rank_input(rank, world, n, torch.int64), ReduceOp.SUM, last,
                        rank_input(last, world, n, torch.int64), False))
    cols = 500  # rank r contributes r+1 rows, rank 1 none
    rows = [0 if r == 1 else r + 1 for r in range(world)]
    gathered = [rank_input(r, world, rows[r] * cols, f32, shape=(rows[r], cols)) for r in range(world)]
    out.append(Followup(f"allgather rows={rows} cols={cols}", OpKind.ALLGATHER, gathered[rank],
                        ReduceOp.SUM, -1, torch.cat(gathered), False))
    per_rank = SEG + 1  # each rank's block crosses a segment boundary
    inputs = [rank_input(r, world, per_rank * world, f32, "MIN") for r in range(world)]
    want = reference(inputs, "MIN")[rank * per_rank:(rank + 1) * per_rank]
    out.append(Followup(f"reduce_scatter float32[{per_rank * world}] MIN", OpKind.REDUCE_SCATTER,
                        inputs[rank], ReduceOp.MIN, -1, want, False))
    return out


def _submit_call(comm: Any, call: Call, rank: int, world: int, inline: bool) -> Any:
    """Queues one of MISMATCHES' calls on the engine; returns its Work."""
    kind, dtype, shape, op, src = call
    if kind == "barrier":
        return submit(comm, OpKind.BARRIER, None, inline=inline)
    numel = 1
    for d in shape:
        numel *= d
    t = rank_input(rank, world, numel, dtype, "SUM", shape)
    root = min(src, world - 1) if kind == "broadcast" else -1
    return submit(comm, OpKind[kind.upper()], t, ReduceOp[op], root, inline)



def _check(chk: Checker, f: Followup, result: Any, when: str) -> None:
    chk.equal(f"{f.what} {when}", f.tensor if f.in_place else result, f.want)


def _job(rank: int, comm: Any, world: int, odd: int) -> tuple[dict[str, list[str | None]], list[str]]:
    """Every case blocking, then every case async; returns the errors by case and the failures."""
    chk = Checker(rank)
    errors: dict[str, list[str | None]] = {}
    for case, (agree, differ, _) in MISMATCHES.items():
        calls = differ if rank == odd else agree
        errors[case] = [mismatch_text(_submit_call(comm, c, rank, world, True)) for c in calls]
        for f in _followups(rank, world, comm):
            result = submit(comm, f.kind, f.tensor, f.op, f.root).wait()
            _check(chk, f, result, f"after the {case} mismatch")
    for case, (agree, differ, _) in MISMATCHES.items():
        calls = differ if rank == odd else agree
        bad = [_submit_call(comm, c, rank, world, False) for c in calls]
        followups = _followups(rank, world, comm)
        works = [submit(comm, f.kind, f.tensor, f.op, f.root, inline=False) for f in followups]
        errors[f"async {case}"] = [mismatch_text(w) for w in bad]
        for f, w in zip(followups, works):
            _check(chk, f, w.wait(), f"queued behind the async {case} mismatch")
    return errors, chk.failures


# Four and five hosts again with the header exchange in Multiplying's shape (groups of three
# summaries at once; the full round by groups too).
@pytest.mark.parametrize(("layout", "header"), [(name, "") for name in LAYOUTS] +
                         [("tcp-abcd", "multiplying"), ("tcp-abcde", "multiplying")])
def test_mismatch_leaves_no_state_behind(layout: str, header: str) -> None:
    hosts, transport, odds = LAYOUTS[layout]
    world = len(hosts)
    problems: list[str] = []
    for odd in odds:
        results = run_world(world, lambda r, c: _job(r, c, world, odd), hosts, transport,
                            segment_kb=4, one_shot_bytes=0, timeout=10.0, header=header)
        for rank, (errors, failures) in enumerate(results):
            problems += [f"odd rank {odd}: {f}" for f in failures]
            for case, (agree, differ, _) in MISMATCHES.items():
                for name in (case, f"async {case}"):
                    for i, err in enumerate(errors[name]):
                        problem = message_problem(err, rank, expected_pair(agree, differ, odd, world, i))
                        if problem:
                            problems.append(f"odd rank {odd}, rank {rank}, {name} call {i}: {problem}")
        # Every rank holds the same table of headers, so every rank words the verdict alike.
        for name in results[0][0]:
            for i in range(len(results[0][0][name])):
                bodies = {(e[name][i] or "").split(": ", 1)[-1] for e, _ in results}
                if len(bodies) != 1:
                    problems.append(f"odd rank {odd}, {name} call {i}: the ranks disagree: {sorted(bodies)}")
    assert not problems, "\n".join(problems[:30])


def _carried_mismatches(rank: int, comm: Any, world: int, algo: str,
                        other: tuple[str, int]) -> tuple[list[str | None], list[str]]:
    """Allreduces that ride on the header exchange (`algo`), each with rank 3 (a core member;
    rank 0 folds in and out) differing: in its algorithm (`other`: another that rides on the
    same header shape, with its count of halvings), in its size, in its op. Every rank must fail
    each alike, its tensor untouched, and an exact allreduce must follow."""
    chk = Checker(rank)
    errors: list[str | None] = []
    n = 3000
    mine_algo = ENGINE.ALGOS.index(algo.partition(":")[0]), int(algo.partition(":")[2] or 0)
    other_algo = ENGINE.ALGOS.index(other[0]), other[1]
    cases = [("levels", n, "SUM", other_algo), ("size", n + 1, "SUM", mine_algo), ("op", n, "MAX", mine_algo)]
    for what, count, op, odd_algo in cases:
        odd = rank == 3
        comm.algo, comm.levels = odd_algo if odd else mine_algo
        mine = count if odd else n
        opname = op if odd else "SUM"
        t = rank_input(rank, world, mine, torch.float32, opname)
        before = t.clone()
        errors.append(mismatch_text(submit(comm, OpKind.ALLREDUCE, t, ReduceOp[opname])))
        chk.equal(f"{what}: the tensor after the failed allreduce", t, before)
        comm.algo, comm.levels = mine_algo
        got = submit(comm, OpKind.ALLREDUCE, rank_input(rank, world, n, torch.float32)).wait()
        chk.equal(f"{what}: the allreduce after it", got, expected_allreduce(world, n, torch.float32, "SUM"))
    # 16-bit floats (their folds run on the leader's float32 sums): a size mismatch, then exact.
    t = rank_input(rank, world, n + (rank == 3), torch.bfloat16)
    before = t.clone()
    errors.append(mismatch_text(submit(comm, OpKind.ALLREDUCE, t)))
    chk.equal("bfloat16: the tensor after the failed allreduce", t, before)
    got = submit(comm, OpKind.ALLREDUCE, rank_input(rank, world, n, torch.bfloat16)).wait()
    chk.equal("bfloat16: the allreduce after it", got, expected_allreduce(world, n, torch.bfloat16, "SUM"))
    # Prescaled: the factor applies to a copy of the contribution, the tensor gets the sum.
    t = rank_input(rank, world, n, torch.float32)
    got = submit_op(comm, OpKind.ALLREDUCE, t, prescale=2.0).wait()
    chk.equal("prescale 2", got, 2 * expected_allreduce(world, n, torch.float32, "SUM"))
    return errors, chk.failures


# (the header exchange's shape, the allreduce, rank 3's other choice, its name in the message)
CARRIED = [("doubling", "rabenseifner:1", ("rabenseifner", 0), "rank 3 rabenseifner"),
           ("multiplying", "radix4", ("multiplying", 0), "rank 3 multiplying")]


@pytest.mark.parametrize(("header", "algo", "other", "named"), CARRIED)
def test_carried_allreduce_mismatch_fails_alike(header: str, algo: str, other: tuple[str, int], named: str) -> None:
    world = 5
    results = run_world(world, lambda r, c: _carried_mismatches(r, c, world, algo, other), "abcde", "tcp",
                        timeout=10.0, algo=algo, header=header)
    failures = [f for _, fs in results for f in fs]
    assert not failures, "\n".join(failures[:10])
    # Every rank words it alike but for its own name in front ("rank 2: collective #0 ...").
    texts = [[e.split(": ", 1)[1] if e else e for e in errors] for errors, _ in results]
    assert all(t == texts[0] for t in texts[1:]), texts
    levels, size, op, half = texts[0]
    assert levels is not None and "ranks chose different algorithms among hosts" in levels, levels
    assert algo in levels and named in levels, levels
    assert size is not None and "float32[3001]" in size and "rank 3" in size, size
    assert op is not None and "MAX" in op and "rank 3" in op, op
    assert half is not None and "bfloat16[3001]" in half and "rank 3" in half, half
