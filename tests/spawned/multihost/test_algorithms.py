"""Every cross-host algorithm, forced and chosen, exact on simulated hosts (tests/support/_hosts.py):
16 hosts × 1 rank and 8 hosts × 2 ranks. The job runs once per TORCHRING_ALGO (ring, doubling,
rabenseifner, rabenseifner:2 — two halvings, then doubling —, radix4, multiplying, auto: init, collectives,
shutdown) and, within each, on groups of the first H hosts
for H = 2, 3, 5, 6, 7, 9, 12 and the whole world, so every host count from 2 to 16 that folds a
non-power-of-two in and out is covered. Every rank checks allreduce (every dtype and op, sizes
below, at and above the host count), reduce_scatter, broadcast from several roots, allgather with
a different dim 0 per rank, reduce and barrier against a single-process reference on integer
data, and which algorithm the engine chose.

This file is also the job (``__main__``): one process per host, started in the host directly
(no launcher); each writes ``rank<r>.json`` (its failures) into the directory the hosts share.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))
_SUPPORT = os.path.join(_ROOT, "tests", "support")
ALGOS = ["ring", "doubling", "rabenseifner", "rabenseifner:2", "radix4", "multiplying", "auto"]
GROUP_HOSTS = [2, 3, 5, 6, 7, 9, 12]
_JOB_TIMEOUT = 420.0


def _cases(world: int) -> list[tuple]:
    """(dtype, op, numel) to check: every dtype and op whose result stays exact at this size."""
    import torch

    from _checks import DTYPES, valid_ops

    cases = []
    for dtype in DTYPES:
        for op in valid_ops(dtype):
            narrow = dtype in (torch.int8, torch.uint8)
            if narrow and op in ("SUM", "AVG", "PRODUCT") and world > 4:
                continue  # the sums or products leave the 8-bit range
            if dtype == torch.float16 and op == "PRODUCT" and world >= 16:
                continue  # 2^16 is past float16's largest value
            cases.append((dtype, op, 7 if dtype != torch.float32 else 1))
    big = [(torch.float32, "SUM", n) for n in (world - 1, world, 3 * world + 1, 1000, 70001)]
    return cases + [c for c in big if c[2] > 0] + [(torch.bfloat16, "SUM", 20000), (torch.int64, "MAX", 4099)]


def _check_group(chk, group, algo: str) -> None:
    """Every collective on `group` (or the world when None) against the reference."""
    import torch

    import torchring
    from _checks import expected_allreduce, rank_input, reference

    rank = group.rank() if group else torchring.rank()
    world = group.size() if group else torchring.size()
    ops = group if group else torchring
    per_host = int(os.environ["LOCAL_WORLD_SIZE"])
    hosts = -(-world // per_host)  # the group is the first `world` ranks
    where = f"{algo}, {world} ranks on {hosts} hosts"
    chosen = torchring.algorithm(torch.empty(3), group)
    want = "" if hosts == 1 else algo
    chk.true(f"{where}: algorithm()", chosen == want if want != "auto" else chosen in ALGOS,
             f"the engine runs {chosen!r}, expected {want!r}")
    for dtype, op, n in _cases(world):
        t = rank_input(rank, world, n, dtype, op)
        ops.allreduce(t, getattr(torchring.ReduceOp, op))
        chk.equal(f"{where}: allreduce({dtype}[{n}], {op})", t, expected_allreduce(world, n, dtype, op))
    rows = 2 * world + 1
    full = [rank_input(r, world, rows * 3, torch.int64).reshape(rows, 3) for r in range(world)]
    got = ops.reduce_scatter(full[rank].clone())
    want = reference(full, "SUM")
    first = sum(rows // world + (1 if r < rows % world else 0) for r in range(rank))
    mine = rows // world + (1 if rank < rows % world else 0)
    chk.equal(f"{where}: reduce_scatter", got, want[first:first + mine])
    for root in sorted({0, world // 2, world - 1}):
        for n in (5, 300000):
            t = rank_input(root, world, n, torch.float32) if rank == root else torch.zeros(n)
            ops.broadcast(t, root)
            chk.equal(f"{where}: broadcast(float32[{n}], root {root})", t, rank_input(root, world, n, torch.float32))
    mine_rows = rank % 3 + 1
    got = ops.allgather(torch.full((mine_rows, 2), rank, dtype=torch.int32))
    want = torch.cat([torch.full((r % 3 + 1, 2), r, dtype=torch.int32) for r in range(world)])
    chk.equal(f"{where}: allgather", got, want)
    t = rank_input(rank, world, 33, torch.int32)
    ops.reduce(t, 1 % world)
    if rank == 1 % world:
        chk.equal(f"{where}: reduce", t, expected_allreduce(world, 33, torch.int32, "SUM"))
    ops.barrier()


def _job(shared: str) -> None:
    import torchring
    from _checks import Checker

    rank = int(os.environ["RANK"])
    chk = Checker(rank)
    for algo in ALGOS:
        os.environ["TORCHRING_ALGO"] = algo
        torchring.init()
        world = torchring.size()
        for hosts in [h for h in GROUP_HOSTS if h < world]:
            group = torchring.new_group(list(range(hosts)))
            if group.is_member:
                _check_group(chk, group, algo)
        _check_group(chk, None, algo)
        torchring.shutdown()
    with open(os.path.join(shared, f"rank{rank}.json"), "w") as f:
        json.dump(chk.failures, f)


def _run(hs: list, per_host: int) -> None:
    from _host_jobs import job_env, log_tails, start_ranks, wait_all

    world = len(hs) * per_host
    env = job_env(hs, per_host, TORCHRING_TIMEOUT="60")
    procs, logs = start_ranks(hs, [sys.executable, __file__, hs[0].shared], env, per_host)
    codes = wait_all(procs, _JOB_TIMEOUT)
    assert codes == [0] * world, f"exit codes {codes}\n{log_tails(logs)}"
    shared = hs[0].shared
    failures = []
    for rank in range(world):
        with open(os.path.join(shared, f"rank{rank}.json")) as f:
            failures += json.load(f)
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures[:40])


@pytest.mark.parametrize("layout", [(16, 1), (8, 2)], ids=["16x1", "8x2"])
def test_every_algorithm_exact(layout: tuple[int, int]) -> None:
    from _hosts import hosts

    with hosts(layout[0]) as hs:
        _run(hs, layout[1])


if __name__ == "__main__":
    sys.path[:0] = [_SUPPORT, _ROOT]
    _job(sys.argv[1])
