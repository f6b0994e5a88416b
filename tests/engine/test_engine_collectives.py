"""The engine's collectives, in process (tests/support/_world.py): every dtype and op, sizes that
cross segment boundaries and the one-shot limit, staged and zero-copy (arena) allreduce,
broadcast from every root, allgather with uneven rows, reduce_scatter; on shared memory, TCP
and both, at worlds 1-4, with integer data whose results are exact."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from _checks import DTYPES, Checker, expected_allreduce, rank_input, reference, valid_ops
from _world import ENGINE, run_world, submit
from torchring._core.types import OpKind, ReduceOp

# name -> (host of each rank, transport, one-shot limit); segments are 4 KiB (1024 float32)
LAYOUTS = {
    "one": ("a", "shm", None),
    "shm-2": ("aa", "shm", None),
    "shm-3-chunked": ("aaa", "shm", 0),
    "shm-4": ("aaaa", "shm", None),
    "tcp-2": ("ab", "tcp", None),
    "tcp-3": ("abc", "tcp", None),
    "tcp-5": ("abcde", "tcp", None),
    "hybrid-aab": ("aab", "shm", 0),
    "hybrid-abab": ("abab", "shm", None),
}
# Layouts for Radix4's groups only (a radix-4 level needs 4 hosts): the sweeps above stay as they were.
RADIX_LAYOUTS = {
    "tcp-4": ("abcd", "tcp", None),
    "hybrid-abcda": ("abcda", "shm", None),
}
SIZES = [0, 1, 7, 1000, 1024 * 3 + 5]  # the last is several segments of every dtype


def _allreduce_sweep(rank: int, comm: Any, world: int) -> list[str]:
    chk = Checker(rank)
    for dtype in DTYPES + [torch.bool]:
        for op in valid_ops(dtype):
            for n in SIZES:
                t = rank_input(rank, world, n, dtype, op)
                got = submit(comm, OpKind.ALLREDUCE, t, ReduceOp[op]).wait()
                chk.equal(f"allreduce {dtype} {op} [{n}]", got, expected_allreduce(world, n, dtype, op))
        # Zero-copy: every rank's tensor in its shared-memory arena (plain memory for a rank
        # with no local peer, as torchring.empty does).
        for n in (5, 1024 * 5 + 3):
            shared = comm.empty_shared([n], dtype)
            if shared is None:
                shared = torch.empty(n, dtype=dtype)
            shared.copy_(rank_input(rank, world, n, dtype, "MAX"))
            submit(comm, OpKind.ALLREDUCE, shared, ReduceOp.MAX).wait()
            chk.equal(f"zero-copy allreduce {dtype} MAX [{n}]", shared,
                      expected_allreduce(world, n, dtype, "MAX"))
    # Queued async operations complete in submission order with exact results.
    works = [submit(comm, OpKind.ALLREDUCE, rank_input(rank, world, 100 * i, torch.int64), 0,
                    inline=False) for i in range(1, 6)]
    for i, work in enumerate(works, 1):
        chk.equal(f"async allreduce #{i}", work.wait(), expected_allreduce(world, 100 * i, torch.int64, "SUM"))
    return chk.failures


def _rooted_and_gathers(rank: int, comm: Any, world: int) -> list[str]:
    chk = Checker(rank)
    for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.int64):
        for root in range(world):
            for n in SIZES:
                t = rank_input(rank, world, n, dtype)
                want = rank_input(root, world, n, dtype)
                chk.equal(f"broadcast {dtype} root={root} [{n}]",
                          submit(comm, OpKind.BROADCAST, t, 0, root).wait(), want)
        for cols in (1, 3, 700):  # rank r contributes r+1 rows, rank 1 none
            rows = [0 if r == 1 else r + 1 for r in range(world)]
            mine = rank_input(rank, world, rows[rank] * cols, dtype, shape=(rows[rank], cols))
            want = torch.cat([rank_input(r, world, rows[r] * cols, dtype, shape=(rows[r], cols))
                              for r in range(world)])
            chk.equal(f"allgather {dtype} rows={rows} cols={cols}",
                      submit(comm, OpKind.ALLGATHER, mine).wait(), want)
        for op in valid_ops(dtype):
            for per_rank in (1, 5, 1024 * 2 + 1):
                n = per_rank * world
                inputs = [rank_input(r, world, n, dtype, op) for r in range(world)]
                got = submit(comm, OpKind.REDUCE_SCATTER, inputs[rank], ReduceOp[op]).wait()
                want = reference(inputs, op)[rank * per_rank:(rank + 1) * per_rank]
                chk.equal(f"reduce_scatter {dtype} {op} [{n}]", got, want)
    submit(comm, OpKind.BARRIER, None).wait()
    return chk.failures


def _sweep_on(layout: str, sweep: Callable[[int, Any, int], list[str]], algo: str = "auto",
              header: str = "") -> None:
    """Runs `sweep(rank, comm, world)` on every rank of `layout` (TORCHRING_ALGO=`algo`, the
    header exchange's shape `header`, "": as measured); fails with what it found."""
    hosts, transport, one_shot = {**LAYOUTS, **RADIX_LAYOUTS}[layout]
    world = len(hosts)
    results = run_world(world, lambda r, c: sweep(r, c, world), hosts, transport,
                        one_shot_bytes=one_shot, algo=algo, header=header)
    failures = [f for r in results for f in r]
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_allreduce_every_dtype_op_and_size(layout: str) -> None:
    _sweep_on(layout, _allreduce_sweep)


@pytest.mark.parametrize("algo", ["ring", "doubling", "rabenseifner"])
@pytest.mark.parametrize("layout", ["tcp-3", "hybrid-aab", "hybrid-abab"])
def test_allreduce_every_algorithm_among_hosts(layout: str, algo: str) -> None:
    """Each forced algorithm among hosts (3 hosts fold one in and out; 2 do not)."""
    _sweep_on(layout, _allreduce_sweep, algo)


@pytest.mark.parametrize("algo", ["doubling", "rabenseifner:1", "rabenseifner"])
def test_allreduce_halvings_among_five_hosts(algo: str) -> None:
    """Five hosts (one folds in and out of a core of four): Rabenseifner with one of its two
    halvings, then doubling on the half window; with both; and Doubling (none). Each rides
    on the header exchange up to kCarriedLimitBytes."""
    _sweep_on("tcp-5", _allreduce_sweep, algo)


@pytest.mark.parametrize("algo", ["radix4", "multiplying"])
@pytest.mark.parametrize("layout", ["tcp-4", "tcp-5", "hybrid-abcda"])
def test_allreduce_radix4_groups(layout: str, algo: str) -> None:
    """Radix4 and Multiplying among 4 hosts (one radix-4 level: three transfers at once each
    way, three folds into one quarter, or the whole buffer, in a fixed order), 5 (one folds in
    and out of the core of four), and 4 hosts with a second rank on one of them; the header
    exchange in Doubling's shape, so none of it rides on the headers)."""
    _sweep_on(layout, _allreduce_sweep, algo, header="doubling")


@pytest.mark.parametrize("algo", ["multiplying", "radix4", "auto"])
@pytest.mark.parametrize("layout", ["tcp-4", "tcp-5", "hybrid-abcda"])
def test_allreduce_rides_on_multiplying_headers(layout: str, algo: str) -> None:
    """The header exchange in Multiplying's shape (a group of three summaries at once per
    radix-4 level), Multiplying and Radix4 riding on it up to kCarriedLimitBytes: 4 hosts, 5
    (one folds in and out of the core of four), 4 with a second rank on one of them."""
    hosts = len(set(RADIX_LAYOUTS.get(layout, LAYOUTS.get(layout))[0]))

    def sweep(rank: int, comm: Any, world: int) -> list[str]:
        cost = comm.link_cost
        failures = [] if ENGINE.header_algo(hosts, cost[0], cost[3]) == "multiplying" else ["not Multiplying's shape"]
        chosen = comm.allreduce_algorithm(torch.zeros(1000))
        if not ENGINE.rides_on_headers(chosen, hosts, 1000, 4, *cost):
            failures.append(f"rank {rank}: {chosen} for 1000 float32 does not ride on the headers")
        if algo == "auto" and chosen != "multiplying":
            failures.append(f"rank {rank}: auto chose {chosen} for 1000 float32, not multiplying")
        return failures + _allreduce_sweep(rank, comm, world)
    _sweep_on(layout, sweep, algo, header="multiplying")


@pytest.mark.parametrize("forced", ["doubling", "multiplying"])
def test_forced_header_shape(forced: str) -> None:
    """TORCHRING_HEADER (CommOptions.header) keeps the header exchange's shape whatever the
    agreed cost says: here a cost under which Multiplying's shape would win on 5 hosts, and the
    choice for 1000 float32 follows the forced shape (what rides on it); every allreduce exact."""
    hosts, transport, one_shot = LAYOUTS["tcp-5"]

    def sweep(rank: int, comm: Any, world: int) -> list[str]:
        chosen = comm.allreduce_algorithm(torch.zeros(1000))
        want = "multiplying" if forced == "multiplying" else "doubling"
        failures = [] if chosen == want else [f"rank {rank}: chose {chosen} under a forced {forced} header"]
        return failures + _allreduce_sweep(rank, comm, world)
    results = run_world(5, lambda r, c: sweep(r, c, 5), hosts, transport, one_shot_bytes=one_shot,
                        header="multiplying", options={"header": list(ENGINE.ALGOS).index(forced)})
    failures = [f for r in results for f in r]
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("algo", ["doubling", "rabenseifner:1"])
def test_allreduce_apart_from_multiplying_headers(algo: str) -> None:
    """Allreduces that do not ride on a header exchange of Multiplying's shape run after it."""
    _sweep_on("tcp-5", _allreduce_sweep, algo, header="multiplying")


@pytest.mark.parametrize("layout", ["one", "shm-3-chunked", "tcp-3", "hybrid-abab"])
def test_broadcast_allgather_reduce_scatter(layout: str) -> None:
    _sweep_on(layout, _rooted_and_gathers)


@pytest.mark.parametrize("algo", ["ring", "doubling"])
@pytest.mark.parametrize("layout", ["tcp-3", "hybrid-abab"])
def test_broadcast_allgather_reduce_scatter_forced(layout: str, algo: str) -> None:
    """Ring forces the ring broadcast and allgather, and the ring reduce-scatter among hosts
    (hybrid-abab: a host's rows are not adjacent); doubling reduce-scatters with an allreduce."""
    _sweep_on(layout, _rooted_and_gathers, algo)


def _tcp_streams(rank: int, comm: Any, world: int) -> list[str]:
    """Chunks of several TCP segments (256 KiB): each send span waits on the folded or
    arrived bytes of the span before it, and the complete chunk is scaled or rounded piecewise;
    then streams long enough to be sent in pieces."""
    chk = Checker(rank)
    n = 3 * (1 << 18) // 4 * world + 11  # 3 segments of float32 per chunk, uneven chunks
    for dtype, op in [(torch.float32, "SUM"), (torch.float32, "AVG"), (torch.bfloat16, "SUM"),
                      (torch.bfloat16, "AVG"), (torch.int64, "MAX"), (torch.int32, "SUM")]:
        got = submit(comm, OpKind.ALLREDUCE, rank_input(rank, world, n, dtype, op), ReduceOp[op]).wait()
        chk.equal(f"allreduce {dtype} {op} [{n}]", got, expected_allreduce(world, n, dtype, op))
    # A send stream of 8 MiB and more goes to the kernel in pieces (TcpOptions.sendPieceBytes):
    # tensors of 8 MiB and a few elements make such streams at worlds 2 and 3.
    for dtype, op in [(torch.float32, "SUM"), (torch.bfloat16, "AVG")]:
        count = (8 << 20) // dtype.itemsize + 5
        got = submit(comm, OpKind.ALLREDUCE, rank_input(rank, world, count, dtype, op), ReduceOp[op]).wait()
        chk.equal(f"allreduce {dtype} {op} [{count}]", got, expected_allreduce(world, count, dtype, op))
    return chk.failures


@pytest.mark.parametrize("layout", ["tcp-2", "tcp-3", "hybrid-abab"])
def test_tcp_ring_streams_multi_segment_chunks(layout: str) -> None:
    _sweep_on(layout, _tcp_streams, "ring")


@pytest.mark.parametrize("algo", ["doubling", "rabenseifner", "radix4", "multiplying", "radix4 riding",
                                  "multiplying riding"])
def test_log_depth_steps_fold_as_bytes_arrive(algo: str) -> None:
    """The step-by-step allreduce on messages of several segments, 16-bit and scaled too
    (Radix4 on 4 hosts: a group's three receives fold segment by segment, in order; riding on
    a header exchange of Multiplying's shape, the same inside its groups)."""
    name, _, riding = algo.partition(" ")
    _sweep_on("tcp-4" if name != "doubling" and name != "rabenseifner" else "tcp-3", _tcp_streams, name,
              header="multiplying" if riding else "doubling")
