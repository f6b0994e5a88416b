"""Every torchring collective on one device, checked against single-process references.

tests/gpu/test_cuda.py runs :func:`device_checks` on the CUDA device at worlds 1-4: at world 1
the NCCL path (allreduce, broadcast, allgather and even reduce_scatter go to NCCL, the others
and every call with extra arguments through pinned host copies), at worlds 2-4 the staged path.
The checks take the device as an argument, so the same logic runs on the CPU too.

Inputs come from _checks.rank_input (small integers, distinct per rank, exact in every dtype);
each reference is computed on the CPU from every rank's input with plain torch ops. A result
must be on the device, of the expected dtype and shape, and exact (AVG within assert_close);
in-place forms must return the caller's tensor, the ``_async`` forms the same from wait().
The first call of a kind gets an input that a kernel queued behind a GPU sleep writes last, so
a collective that does not wait for the caller's stream reads stale values.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from _checks import Checker, expected_allreduce, rank_input, reference, valid_ops

GPU_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64]
BIG = 2**17 + 1


def inp(rank: int, world: int, numel: int, dtype: torch.dtype, dev: torch.device, op: str = "SUM",
        shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """Rank `rank`'s input (_checks.rank_input) on `dev`."""
    return rank_input(rank, world, numel, dtype, op, shape).to(dev)


def late_inp(rank: int, world: int, numel: int, dtype: torch.dtype, dev: torch.device,
             op: str = "SUM", shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """Like :func:`inp`, but on CUDA its last write (a + 1 after a - 1) queues behind a few ms
    of GPU sleep on the current stream: reading it before the stream got there gives wrong values."""
    t = inp(rank, world, numel, dtype, dev, op, shape)
    if dev.type != "cuda" or t.numel() == 0:
        return t
    t.sub_(1)
    torch.cuda._sleep(int(5e6))  # ~2.5 ms at 2 GHz
    return t.add_(1)


def same(chk: Checker, what: str, got: Any, want: torch.Tensor, dev: torch.device,
         exact: bool = True) -> None:
    """Record a failure unless `got` is a tensor on `dev` equal to `want` (moved there)."""
    if isinstance(got, torch.Tensor) and got.device != dev:
        return chk.fail(what, f"result on {got.device}, expected {dev}")
    chk.equal(what, got, want.to(dev), exact)


def share(rows: int, world: int, rank: int) -> slice:
    """Rank `rank`'s rows when `rows` are split over `world` ranks: the first rows % world ranks
    get one row more (reduce_scatter's documented rule)."""
    base, extra = divmod(rows, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def _op(name: str) -> Any:
    import torchring

    return getattr(torchring.ReduceOp, name)


def check_allreduce_forms(chk: Checker, rank: int, world: int, dev: torch.device) -> None:
    """allreduce in place (returns its tensor) and allreduce_async, every dtype and op; with
    scaling factors (the staged path even on NCCL); synchronize()."""
    import torchring

    for dtype in GPU_DTYPES:
        for op in valid_ops(dtype):
            want = expected_allreduce(world, 1000, dtype, op)
            t = late_inp(rank, world, 1000, dtype, dev, op)
            out = torchring.allreduce(t, _op(op))
            chk.true(f"allreduce({dtype}, {op}) returns its tensor", out is t)
            same(chk, f"allreduce({dtype}, {op})", t, want, dev, op != "AVG")
            t = inp(rank, world, 1000, dtype, dev, op)
            out = torchring.allreduce_async(t, _op(op)).wait()
            chk.true(f"allreduce_async({dtype}, {op}).wait() returns its tensor", out is t)
            same(chk, f"allreduce_async({dtype}, {op})", t, want, dev, op != "AVG")
    for dtype, op, pre, post in [(torch.float32, "SUM", 0.5, 4.0), (torch.bfloat16, "AVG", 2.0, 0.25),
                                 (torch.float16, "SUM", 1.0, 0.5)]:
        xs = [rank_input(r, world, 999, dtype, op).double() * pre for r in range(world)]
        want = (reference(xs, op) * post).to(dtype)
        t = inp(rank, world, 999, dtype, dev, op)
        torchring.allreduce(t, _op(op), prescale_factor=pre, postscale_factor=post)
        same(chk, f"allreduce({dtype}, {op}, prescale={pre}, postscale={post})", t, want, dev, op != "AVG")
    t = inp(rank, world, BIG, torch.float32, dev)
    out = torchring.allreduce_async(t).synchronize()
    same(chk, f"allreduce_async(float32[{BIG}]).synchronize()", out,
         expected_allreduce(world, BIG, torch.float32, "SUM"), dev)


def check_broadcast(chk: Checker, rank: int, world: int, dev: torch.device) -> None:
    """broadcast and broadcast_async from every rank, every dtype; empty and large tensors."""
    import torchring

    for src in range(world):
        for dtype in GPU_DTYPES:
            t = late_inp(rank, world, 1000, dtype, dev)
            out = torchring.broadcast(t, src)
            chk.true(f"broadcast({dtype}, src={src}) returns its tensor", out is t)
            same(chk, f"broadcast({dtype}, src={src})", t, rank_input(src, world, 1000, dtype), dev)
            t = inp(rank, world, 77, dtype, dev, shape=(7, 11))
            out = torchring.broadcast_async(t, src).wait()
            chk.true(f"broadcast_async({dtype}, src={src}).wait() returns its tensor", out is t)
            same(chk, f"broadcast_async({dtype}[7, 11], src={src})", t,
                 rank_input(src, world, 77, dtype, shape=(7, 11)), dev)
    for n in (0, BIG):
        t = inp(rank, world, n, torch.float32, dev)
        torchring.broadcast(t, world - 1)
        same(chk, f"broadcast(float32[{n}], src={world - 1})", t, rank_input(world - 1, world, n, torch.float32), dev)


def check_allgather(chk: Checker, rank: int, world: int, dev: torch.device) -> None:
    """allgather with a different dim 0 per rank (one rank sends none from world 2 on), every
    dtype; a scalar as one row; a large one; allgather_async; the input left alone."""
    import torchring

    rows = [[2, 0, 3, 1][r % 4] for r in range(world)]
    for dtype in GPU_DTYPES:
        t = late_inp(rank, world, rows[rank] * 3, dtype, dev, shape=(rows[rank], 3))
        want = torch.cat([rank_input(r, world, rows[r] * 3, dtype, shape=(rows[r], 3)) for r in range(world)])
        same(chk, f"allgather({dtype}) rows per rank {rows}", torchring.allgather(t), want, dev)
        same(chk, f"allgather({dtype}) leaves its input", t,
             rank_input(rank, world, rows[rank] * 3, dtype, shape=(rows[rank], 3)), dev)
        h = torchring.allgather_async(inp(rank, world, rows[rank] * 3, dtype, dev, shape=(rows[rank], 3)))
        same(chk, f"allgather_async({dtype})", h.wait(), want, dev)
    scalar = torch.tensor(rank * 3 - 1, dtype=torch.int64, device=dev)
    same(chk, "allgather of a 0-dim tensor", torchring.allgather(scalar),
         torch.tensor([r * 3 - 1 for r in range(world)], dtype=torch.int64), dev)
    want = torch.cat([rank_input(r, world, BIG, torch.float32) for r in range(world)])
    same(chk, f"allgather(float32[{BIG}])", torchring.allgather(inp(rank, world, BIG, torch.float32, dev)), want, dev)


def check_reduce_scatter(chk: Checker, rank: int, world: int, dev: torch.device) -> None:
    """reduce_scatter of even rows (NCCL's kind at world 1) and uneven rows (the staged path),
    every dtype and op, into new tensors and with reduce_scatter_into; the _async forms."""
    import torchring

    for dtype in GPU_DTYPES:
        for op in valid_ops(dtype):
            for rows in (3 * world, 3 * world + 1, 0):  # uneven from world 2 on
                shape = (rows, 2)
                full = expected_allreduce(world, rows * 2, dtype, op, shape)
                t = late_inp(rank, world, rows * 2, dtype, dev, op, shape)
                what = f"reduce_scatter({dtype}{list(shape)}, {op})"
                same(chk, what, torchring.reduce_scatter(t, _op(op)), full[share(rows, world, rank)], dev, op != "AVG")
                same(chk, what + " leaves its input", t, rank_input(rank, world, rows * 2, dtype, op, shape), dev)
                out = torch.full_like(full[share(rows, world, rank)], 7).to(dev)
                got = torchring.reduce_scatter_into(out, t, _op(op))
                chk.true(f"reduce_scatter_into({dtype}{list(shape)}, {op}) returns out", got is out)
                same(chk, f"reduce_scatter_into({dtype}{list(shape)}, {op})", out, full[share(rows, world, rank)],
                     dev, op != "AVG")
    rows = 2 * world + 1
    full = expected_allreduce(world, rows * 4, torch.int64, "MAX", (rows, 4))
    t = inp(rank, world, rows * 4, torch.int64, dev, "MAX", (rows, 4))
    h = torchring.reduce_scatter_async(t, _op("MAX"))
    same(chk, f"reduce_scatter_async(int64[{rows}, 4], MAX)", h.wait(), full[share(rows, world, rank)], dev)
    out = torch.zeros_like(full[share(rows, world, rank)]).to(dev)
    got = torchring.reduce_scatter_into_async(out, t, _op("MAX")).wait()
    chk.true("reduce_scatter_into_async returns out", got is out)
    same(chk, f"reduce_scatter_into_async(int64[{rows}, 4], MAX)", out, full[share(rows, world, rank)], dev)


def check_rooted(chk: Checker, rank: int, world: int, dev: torch.device) -> None:
    """reduce (the root gets the result, the others keep their tensor), gather (a list on the
    root, None elsewhere) and scatter from and to every rank, blocking and _async."""
    import torchring

    cases = [(torch.float32, "SUM"), (torch.bfloat16, "MAX"), (torch.float16, "MIN"),
             (torch.int32, "PRODUCT"), (torch.int64, "SUM"), (torch.float32, "AVG")]
    for root in range(world):
        for dtype, op in cases:
            mine = rank_input(rank, world, 300, dtype, op)
            t = late_inp(rank, world, 300, dtype, dev, op)
            out = torchring.reduce(t, root, _op(op))
            what = f"reduce({dtype}, dst={root}, {op})"
            chk.true(what + " returns its tensor", out is t)
            want = expected_allreduce(world, 300, dtype, op) if rank == root else mine
            same(chk, what, t, want, dev, op != "AVG")
        t = inp(rank, world, 50, torch.int64, dev)
        torchring.reduce_async(t, root).wait()
        same(chk, f"reduce_async(int64, dst={root})", t, expected_allreduce(world, 50, torch.int64, "SUM")
             if rank == root else rank_input(rank, world, 50, torch.int64), dev)
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            parts = torchring.gather(late_inp(rank, world, 12, dtype, dev, shape=(3, 4)), root)
            _check_gathered(chk, f"gather({dtype}, dst={root})", parts, rank, root, world, dev,
                            lambda r, d=dtype: rank_input(r, world, 12, d, shape=(3, 4)))
        parts = torchring.gather_async(inp(rank, world, 5, torch.int32, dev), root).wait()
        _check_gathered(chk, f"gather_async(int32, dst={root})", parts, rank, root, world, dev,
                        lambda r: rank_input(r, world, 5, torch.int32))
        for dtype in (torch.float16, torch.int32):
            chunks = [inp(root * world + r, world, 6, dtype, dev, shape=(2, 3)) for r in range(world)]
            t = torch.full((2, 3), -1, dtype=dtype, device=dev)
            out = torchring.scatter(t, chunks if rank == root else None, root)
            chk.true(f"scatter({dtype}, src={root}) returns its tensor", out is t)
            same(chk, f"scatter({dtype}, src={root})", t,
                 rank_input(root * world + rank, world, 6, dtype, shape=(2, 3)), dev)
        t = torch.zeros(4, device=dev)
        chunks = [inp(100 + r, world, 4, torch.float32, dev) for r in range(world)]
        torchring.scatter_async(t, chunks if rank == root else None, root).wait()
        same(chk, f"scatter_async(float32, src={root})", t, rank_input(100 + rank, world, 4, torch.float32), dev)


def _check_gathered(chk: Checker, what: str, parts: Any, rank: int, root: int, world: int,
                    dev: torch.device, want: Callable[[int], torch.Tensor]) -> None:
    if rank != root:
        chk.true(what + " off the root", parts is None, f"got {type(parts).__name__}")
    elif not isinstance(parts, list) or len(parts) != world:
        chk.fail(what, f"expected a list of {world} tensors, got {parts!r}"[:300])
    else:
        for r, p in enumerate(parts):
            same(chk, f"{what} part of rank {r}", p, want(r), dev)


def check_fused(chk: Checker, rank: int, world: int, dev: torch.device) -> None:
    """allgather_into (into the caller's list) and allreduce_many (several dtypes and shapes,
    one empty), blocking and _async, returning the caller's tensors."""
    import torchring

    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        outs = [torch.full((2, 5), -1, dtype=dtype, device=dev) for _ in range(world)]
        got = torchring.allgather_into(outs, late_inp(rank, world, 10, dtype, dev, shape=(2, 5)))
        chk.true(f"allgather_into({dtype}) returns tensor_list's tensors",
                 isinstance(got, list) and len(got) == world and all(a is b for a, b in zip(got, outs)))
        for r in range(world):
            same(chk, f"allgather_into({dtype}) entry {r}", outs[r], rank_input(r, world, 10, dtype, shape=(2, 5)), dev)
    outs = [torch.zeros(3, dtype=torch.int32, device=dev) for _ in range(world)]
    torchring.allgather_into_async(outs, inp(rank, world, 3, torch.int32, dev)).wait()
    for r in range(world):
        same(chk, f"allgather_into_async entry {r}", outs[r], rank_input(r, world, 3, torch.int32), dev)
    specs = [(torch.float32, (3,)), (torch.int64, (4, 2)), (torch.bfloat16, (5,)), (torch.float32, (0,)),
             (torch.float16, (7, 3)), (torch.int32, (BIG,))]
    for op, run in (("SUM", torchring.allreduce_many), ("MAX", None)):
        ts = [late_inp(rank, world, _numel(s), d, dev, op, s) for d, s in specs]
        got = run(ts, _op(op)) if run else torchring.allreduce_many_async(ts, _op(op)).wait()
        name = "allreduce_many" if run else "allreduce_many_async"
        chk.true(f"{name}({op}) returns the caller's tensors",
                 isinstance(got, list) and len(got) == len(ts) and all(a is b for a, b in zip(got, ts)))
        for (d, s), t in zip(specs, ts):
            same(chk, f"{name}({op}) {d}{list(s)}", t, expected_allreduce(world, _numel(s), d, op, s), dev)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def a2a_rows(src: int, dst: int) -> int:
    """Rows rank `src` sends rank `dst` in the uneven cases (some are empty)."""
    return (src + 2 * dst) % 3 + (1 if src == dst else 0)


def a2a_input(src: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    n = sum(a2a_rows(src, k) for k in range(world))
    return rank_input(src, world, n * 2, dtype, shape=(n, 2))


def a2a_expected(rank: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    """What rank `rank` receives: from each source in rank order, its block for `rank`."""
    parts = []
    for src in range(world):
        start = sum(a2a_rows(src, k) for k in range(rank))
        parts.append(a2a_input(src, world, dtype)[start:start + a2a_rows(src, rank)])
    return torch.cat(parts)


def check_alltoall(chk: Checker, rank: int, world: int, dev: torch.device) -> None:
    """alltoall (equal blocks, and splits; the received counts) and all_to_all_single (into the
    caller's output; splits as lists and as tensors), blocking and _async."""
    import torchring

    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        ins = [rank_input(r, world, world * 2 * 3, dtype, shape=(world * 2, 3)) for r in range(world)]
        equal = torch.cat([ins[r][rank * 2:rank * 2 + 2] for r in range(world)])
        out, received = torchring.alltoall(late_inp(rank, world, world * 6, dtype, dev, shape=(world * 2, 3)))
        same(chk, f"alltoall({dtype}) equal blocks", out, equal, dev)
        chk.true(f"alltoall({dtype}) received counts", received.tolist() == [2] * world, f"got {received}")
        send = [a2a_rows(rank, k) for k in range(world)]
        out, received = torchring.alltoall(a2a_input(rank, world, dtype).to(dev), send)
        same(chk, f"alltoall({dtype}) splits {send}", out, a2a_expected(rank, world, dtype), dev)
        chk.true(f"alltoall({dtype}) received counts with splits",
                 received.tolist() == [a2a_rows(r, rank) for r in range(world)], f"got {received}")
        o = torch.full((world * 2, 3), -1, dtype=dtype, device=dev)
        got = torchring.all_to_all_single(o, inp(rank, world, world * 6, dtype, dev, shape=(world * 2, 3)))
        chk.true(f"all_to_all_single({dtype}) returns output", got is o)
        same(chk, f"all_to_all_single({dtype}) equal blocks", o, equal, dev)
        recv = [a2a_rows(r, rank) for r in range(world)]
        o = torch.full((sum(recv), 2), -1, dtype=dtype, device=dev)
        torchring.all_to_all_single(o, a2a_input(rank, world, dtype).to(dev), recv, torch.tensor(send))
        same(chk, f"all_to_all_single({dtype}) splits", o, a2a_expected(rank, world, dtype), dev)
    send = [a2a_rows(rank, k) for k in range(world)]
    out, received = torchring.alltoall_async(a2a_input(rank, world, torch.int32).to(dev), send).wait()
    same(chk, "alltoall_async(int32) splits", out, a2a_expected(rank, world, torch.int32), dev)
    recv = [a2a_rows(r, rank) for r in range(world)]
    o = torch.zeros((sum(recv), 2), dtype=torch.int32, device=dev)
    got = torchring.all_to_all_single_async(o, a2a_input(rank, world, torch.int32).to(dev), recv, send).wait()
    chk.true("all_to_all_single_async returns output", got is o)
    same(chk, "all_to_all_single_async(int32) splits", o, a2a_expected(rank, world, torch.int32), dev)


def check_in_flight(chk: Checker, rank: int, world: int, dev: torch.device) -> None:
    """Handles of seven kinds in flight at once (a blocking barrier behind them), waited for in
    reverse order."""
    import torchring

    src = world - 1
    b = inp(rank, world, 64, torch.float32, dev)
    a = inp(rank, world, 300, torch.bfloat16, dev)
    r = inp(rank, world, 20, torch.int32, dev, "MIN")
    gathered = torch.cat([rank_input(q, world, 6, torch.int64, shape=(3, 2)) for q in range(world)])
    scattered = expected_allreduce(world, world * 4, torch.float16, "SUM")[rank * 4:(rank + 1) * 4]
    reduced = expected_allreduce(world, 20, torch.int32, "MIN") if rank == 0 else \
        rank_input(rank, world, 20, torch.int32, "MIN")
    swapped = torch.cat([rank_input(q, world, world * 2, torch.int64, shape=(world, 2))[rank:rank + 1]
                         for q in range(world)])
    handles = [
        ("broadcast_async", torchring.broadcast_async(b, src), b, rank_input(src, world, 64, torch.float32)),
        ("barrier_async", torchring.barrier_async(), None, None),
        ("allgather_async", torchring.allgather_async(inp(rank, world, 6, torch.int64, dev, shape=(3, 2))), None,
         gathered),
        ("reduce_scatter_async", torchring.reduce_scatter_async(inp(rank, world, world * 4, torch.float16, dev)),
         None, scattered),
        ("allreduce_async", torchring.allreduce_async(a), a, expected_allreduce(world, 300, torch.bfloat16, "SUM")),
        ("reduce_async", torchring.reduce_async(r, 0, _op("MIN")), r, reduced),
        ("alltoall_async", torchring.alltoall_async(inp(rank, world, world * 2, torch.int64, dev, shape=(world, 2))),
         None, swapped)]
    torchring.barrier()
    for name, h, t, want in reversed(handles):
        got = h.wait()
        if want is None:
            continue
        if name == "alltoall_async":
            got = got[0]
        same(chk, f"{name} with seven in flight", t if t is not None else got, want, dev)
        chk.true(f"{name} is_completed() after wait()", h.is_completed() is True)


CHECKS: list[Callable[[Checker, int, int, torch.device], None]] = [
    check_allreduce_forms, check_broadcast, check_allgather, check_reduce_scatter, check_rooted,
    check_fused, check_alltoall, check_in_flight]


def device_checks(rank: int, world: int, dev: torch.device) -> list[str]:
    """Run every check of :data:`CHECKS` in this rank's torchring session; return the failures.
    A check that raises is recorded and ends the run (the ranks' calls no longer line up)."""
    import traceback

    chk = Checker(rank)
    for check in CHECKS:
        try:
            check(chk, rank, world, dev)
        except Exception:  # noqa: BLE001 - reported by name
            chk.fail(check.__name__, "raised:\n" + traceback.format_exc())
            break
    return chk.failures
