"""Spawned-rank checks of hvd's data-moving collectives: allgather, broadcast, alltoall and
reducescatter (run by tests/support/_hvd_checks.run_checks; same inputs and references)."""

from __future__ import annotations

import itertools
from typing import Sequence

import torch

from _hvd_checks import DTYPES, SHAPES, Ctx, op_inputs, reduce_ref, rows_of, scaled, val


# ---------------------------------------------------------------------------------- allgather
def check_allgather(c: Ctx) -> None:
    """Concatenation along dim 0 with a different dim 0 per rank (one rank sends none), every
    dtype, 1-3 dims; allgather_async; grouped_allgather{,_async}."""
    hvd, n, me = c.hvd, c.size, c.rank
    rows = [(r * 3) % 5 + 1 for r in range(n)]
    for dtype, dims in itertools.product([torch.uint8, torch.int8, torch.bool] + DTYPES, (1, 2, 3)):
        xs = [val(r, (rows[r], *[3] * (dims - 1)), dtype) for r in range(n)]
        c.equal(f"allgather {dtype} {dims}-D", hvd.allgather(xs[me]), torch.cat(xs))
    xs = [val(r, (0 if r == 1 else r + 2, 4), torch.float32) for r in range(n)]
    c.equal("allgather with 0 rows on rank 1", hvd.allgather(xs[me], name="rows0"), torch.cat(xs))
    xs = [val(r, (2, 2), torch.int64) for r in range(n)]
    c.equal("allgather_async", hvd.synchronize(hvd.allgather_async(xs[me], name="ag.async")), torch.cat(xs))
    per = [[val(r, (r + 1 + k, k + 1), torch.float64, salt=k) for r in range(n)] for k in range(3)]
    outs = hvd.grouped_allgather([p[me] for p in per])
    for k, p in enumerate(per):
        c.equal(f"grouped_allgather tensor {k}", outs[k], torch.cat(p))
    outs = hvd.synchronize(hvd.grouped_allgather_async([p[me] for p in per], name="gag"))
    for k, p in enumerate(per):
        c.equal(f"grouped_allgather_async tensor {k}", outs[k], torch.cat(p))


# ---------------------------------------------------------------------------------- broadcast
def check_broadcast(c: Ctx) -> None:
    """Every root x dtype x 1-3 dims: broadcast leaves the input, broadcast_ overwrites it."""
    hvd, n, me = c.hvd, c.size, c.rank
    for root, dtype, shape in itertools.product(range(n), [torch.uint8, torch.bool] + DTYPES, SHAPES):
        xs = [val(r, shape, dtype, salt=root) for r in range(n)]
        mine = xs[me].clone()
        what = f"root {root} {dtype} {list(shape)}"
        c.equal(f"broadcast {what}", hvd.broadcast(mine, root), xs[root])
        c.equal(f"broadcast {what} leaves its input", mine, xs[me])
        out = hvd.broadcast_(mine, root_rank=root, name=f"b_.{root}.{dtype}.{len(shape)}")
        c.true(f"broadcast_ {what} returns its input", out is mine)
        c.equal(f"broadcast_ {what}", mine, xs[root])
    for root in range(n):
        xs = [val(r, (5, 2), torch.float32, salt=9) for r in range(n)]
        c.equal(f"broadcast_async root {root}",
                hvd.synchronize(hvd.broadcast_async(xs[me], root, name=f"ba.{root}")), xs[root])
        buf = xs[me].clone()
        hvd.synchronize(hvd.broadcast_async_(buf, root))
        c.equal(f"broadcast_async_ root {root}", buf, xs[root])


# ---------------------------------------------------------------------------------- alltoall
def _a2a_input(r: int, splits: Sequence[int], inner: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Rank r's alltoall input: the block for destination q holds values 100*r + 10*q + row."""
    blocks = []
    for q, s in enumerate(splits):
        base = torch.arange(s, dtype=torch.int64) + 100 * r + 10 * q
        blocks.append(base.reshape(s, *[1] * len(inner)).expand(s, *inner))
    return torch.cat(blocks).to(dtype)


def check_alltoall(c: Ctx) -> None:
    """Equal splits (1-3 dims) return only the output; explicit splits (list, int32 or int64
    tensor, zeros allowed) also return how many rows came from each rank."""
    hvd, n, me = c.hvd, c.size, c.rank
    for dtype, inner in itertools.product([torch.int32, torch.float32, torch.float16, torch.float64],
                                          [(), (3,), (2, 2)]):
        xs = [_a2a_input(r, [2] * n, inner, dtype) for r in range(n)]
        got = hvd.alltoall(xs[me])
        c.equal(f"alltoall equal {dtype} {list(inner)}", got, torch.cat([x[2 * me:2 * me + 2] for x in xs]))
    splits = [[(r + 2 * q) % 3 for q in range(n)] for r in range(n)]
    xs = [_a2a_input(r, splits[r], (2,), torch.int64) for r in range(n)]
    want = torch.cat([xs[s][sum(splits[s][:me]):sum(splits[s][:me + 1])] for s in range(n)])
    want_received = torch.tensor([splits[s][me] for s in range(n)], dtype=torch.int32)
    for kind, sp in (("list", splits[me]), ("int32", torch.tensor(splits[me], dtype=torch.int32)),
                     ("int64", torch.tensor(splits[me], dtype=torch.int64))):
        out = hvd.alltoall(xs[me], sp)
        c.true(f"alltoall splits {kind} returns (output, received)", isinstance(out, tuple) and len(out) == 2,
               f"got {type(out).__name__}")
        if isinstance(out, tuple):
            c.equal(f"alltoall splits {kind}", out[0], want)
            c.equal(f"alltoall splits {kind} received splits", out[1], want_received)
    out, received = hvd.synchronize(hvd.alltoall_async(xs[me], splits[me], name="a2a.async"))
    c.equal("alltoall_async", out, want)
    c.equal("alltoall_async received splits", received, want_received)


def check_alltoall_errors(c: Ctx) -> None:
    """A dim 0 that equal splits cannot divide, splits that add up to more than dim 0 and
    floating-point splits are ValueErrors; the next alltoall works."""
    hvd, n, me = c.hvd, c.size, c.rank
    c.raises("dim 0 not divisible", (ValueError,), lambda: hvd.alltoall(torch.ones(n + 1, 2)))
    c.raises("splits add up to more than dim 0", (ValueError,),
             lambda: hvd.alltoall(torch.ones(n - 1 if n > 1 else 0, 2), torch.ones(n, dtype=torch.int32)))
    c.raises("float splits", (ValueError,),
             lambda: hvd.alltoall(torch.ones(n, 2), torch.ones(n, dtype=torch.float32)))
    c.raises("float splits as a list", (ValueError,), lambda: hvd.alltoall(torch.ones(n, 2), [1.0] * n))
    xs = [_a2a_input(r, [1] * n, (), torch.float32) for r in range(n)]
    c.equal("alltoall after the errors", hvd.alltoall(xs[me]), torch.cat([x[me:me + 1] for x in xs]))


# ---------------------------------------------------------------------------------- reducescatter
def check_reducescatter(c: Ctx) -> None:
    """Sum and Average of 2n+1 rows (first ranks one row more), every dtype, 1-3 dims; async;
    prescale/postscale; grouped; fewer rows than ranks."""
    hvd, n, me = c.hvd, c.size, c.rank
    d0 = 2 * n + 1
    mine_rows = rows_of(d0, n, me)
    for op, dtype, dims in itertools.product((hvd.Sum, hvd.Average), DTYPES, (1, 2, 3)):
        xs = op_inputs(c, op, (d0, *[3] * (dims - 1)), dtype)
        want = reduce_ref(xs, op, hvd)[mine_rows]
        c.equal(f"reducescatter op {op} {dtype} {dims}-D", hvd.reducescatter(xs[me], op=op), want)
    xs = op_inputs(c, hvd.Average, (d0, 2), torch.float32)
    c.equal("reducescatter default op is Average", hvd.reducescatter(xs[me]),
            reduce_ref(xs, hvd.Average, hvd)[mine_rows])
    c.equal("reducescatter_async", hvd.synchronize(hvd.reducescatter_async(xs[me], name="rs.a")),
            reduce_ref(xs, hvd.Average, hvd)[mine_rows])
    for dtype, op, pre, post in [(torch.float32, hvd.Sum, 0.5, 4.0), (torch.float16, hvd.Average, 2.0, 0.5),
                                 (torch.float64, hvd.Sum, 3.0, 1.0), (torch.int32, hvd.Sum, 1.5, 0.3),
                                 (torch.int64, hvd.Sum, 1.0, 2.5)]:
        xs = op_inputs(c, op, (d0, 2), dtype)
        want = scaled(reduce_ref([scaled(x, pre) for x in xs], op, hvd), post)[mine_rows]
        got = hvd.reducescatter(xs[me], op=op, prescale_factor=pre, postscale_factor=post)
        c.equal(f"reducescatter {dtype} op {op} pre {pre} post {post}", got, want)
    per = [op_inputs(c, hvd.Sum, (n + k, k + 1), torch.float32, salt=k) for k in range(3)]
    outs = hvd.grouped_reducescatter([p[me] for p in per], op=hvd.Sum)
    for k, p in enumerate(per):
        c.equal(f"grouped_reducescatter tensor {k}", outs[k], reduce_ref(p, hvd.Sum, hvd)[rows_of(n + k, n, me)])
    outs = hvd.synchronize(hvd.grouped_reducescatter_async([p[me] for p in per], op=hvd.Sum, name="grs"))
    for k, p in enumerate(per):
        c.equal(f"grouped_reducescatter_async tensor {k}", outs[k],
                reduce_ref(p, hvd.Sum, hvd)[rows_of(n + k, n, me)])
    per = op_inputs(c, hvd.Average, (n + 1, 3), torch.float64)
    outs = hvd.grouped_reducescatter([per[me], 2 * per[me]], op=hvd.Average, prescale_factor=0.5,
                                     postscale_factor=4.0)
    want = scaled(reduce_ref([scaled(x, 0.5) for x in per], hvd.Average, hvd), 4.0)[rows_of(n + 1, n, me)]
    c.equal("grouped_reducescatter scaled 0", outs[0], want)
    c.equal("grouped_reducescatter scaled 1", outs[1], 2 * want)
    xs = [val(r, (n - 1, 2), torch.int32) for r in range(n)]
    c.equal(f"reducescatter of {n - 1} rows", hvd.reducescatter(xs[me], op=hvd.Sum),
            reduce_ref(xs, hvd.Sum, hvd)[rows_of(n - 1, n, me)])


def check_reducescatter_errors(c: Ctx) -> None:
    """A scalar cannot be scattered; Adasum is refused (a RuntimeError); the next one works."""
    hvd, n, me = c.hvd, c.size, c.rank
    errors = (ValueError, RuntimeError)
    c.raises("scalar", errors, lambda: hvd.reducescatter(torch.tensor(3.0), op=hvd.Average))
    c.raises("grouped with a scalar", errors,
             lambda: hvd.grouped_reducescatter([torch.ones(n), torch.tensor(1.0)], op=hvd.Sum))
    c.raises("Adasum", (RuntimeError,), lambda: hvd.reducescatter(torch.ones(n * 4, 4), op=hvd.Adasum))
    xs = [val(r, (n, 2), torch.float32) for r in range(n)]
    c.equal("reducescatter after the errors", hvd.reducescatter(xs[me], op=hvd.Sum),
            reduce_ref(xs, hvd.Sum, hvd)[me:me + 1])
