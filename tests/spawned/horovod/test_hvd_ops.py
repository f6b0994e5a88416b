"""torchring.horovod's collectives on spawned ranks, checked the way Horovod's users rely on them.

Each test spawns one world and runs a list of checks in it (tests/support/_hvd_checks.run_checks), each
check comparing every rank's result with a single-process reference built from every rank's
integer-valued input. Covered: allreduce (every op, dtype and 1-3 dims, scaling, in place,
grouped, async with poll, named ops in different orders, duplicate names), allgather, broadcast,
alltoall, reducescatter, the autograd rule of each, mismatches raising on every rank with the
ranks named (and the next collective working), join, barrier, process sets (even/odd at world
4), init after shutdown, and the timeline file.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest
import torch

import _hvd_checks as H
import _hvd_movers as M
from _checks import assert_no_failures
from _dist import spawn
from _hvd_checks import Ctx, reduce_ref, rows_of, scaled, val

FLOATS = [torch.float32, torch.float64]


# ---------------------------------------------------------------------------------- autograd
def check_grad_allreduce(c: Ctx) -> None:
    """allreduce's gradient is the allreduce of the gradients with the same op and factors."""
    hvd, n, me = c.hvd, c.size, c.rank
    for dtype, shape, (op, pre, post) in [(d, s, case) for d in FLOATS for s in H.SHAPES for case in
                                          ((hvd.Sum, 1.0, 1.0), (hvd.Average, 1.0, 1.0), (hvd.Sum, 0.5, 4.0))]:
        gs = [val(r, shape, dtype, salt=5, mult=n) for r in range(n)]
        x = val(me, shape, dtype).requires_grad_()
        hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post).backward(gs[me])
        want = scaled(reduce_ref([scaled(g, pre) for g in gs], op, hvd), post)
        c.equal(f"allreduce grad {dtype} {list(shape)} op {op} pre {pre} post {post}", x.grad, want)
    gs = [[val(r, s, torch.float32, salt=k, mult=n) for r in range(n)] for k, s in enumerate(H.SHAPES)]
    for op in (hvd.Sum, hvd.Average):
        xs = [val(me, s, torch.float32).requires_grad_() for s in H.SHAPES]
        ys = hvd.grouped_allreduce(xs, op=op)
        sum((y * g[me]).sum() for y, g in zip(ys, gs)).backward()
        for k, x in enumerate(xs):
            c.equal(f"grouped_allreduce grad {k} op {op}", x.grad, reduce_ref(gs[k], op, hvd))


def check_grad_allgather_broadcast(c: Ctx) -> None:
    """allgather's gradient is the averaged gradient narrowed to this rank's rows; broadcast's is
    the averaged gradient on the root and zeros elsewhere."""
    hvd, n, me = c.hvd, c.size, c.rank
    rows = [(r * 2) % 5 + 1 for r in range(n)]
    start = sum(rows[:me])
    for dtype, dims in ((d, k) for d in FLOATS for k in (1, 2, 3)):
        inner = [3] * (dims - 1)
        gs = [val(r, (sum(rows), *inner), dtype, salt=2, mult=n) for r in range(n)]
        x = val(me, (rows[me], *inner), dtype).requires_grad_()
        hvd.allgather(x).backward(gs[me])
        c.equal(f"allgather grad {dtype} {dims}-D", x.grad,
                reduce_ref(gs, hvd.Average, hvd)[start:start + rows[me]])
    per = [[val(r, (sum(rows), k + 1), torch.float64, salt=k, mult=n) for r in range(n)] for k in range(2)]
    xs = [val(me, (rows[me], k + 1), torch.float64).requires_grad_() for k in range(2)]
    sum((y * g[me]).sum() for y, g in zip(hvd.grouped_allgather(xs), per)).backward()
    for k, x in enumerate(xs):
        c.equal(f"grouped_allgather grad {k}", x.grad, reduce_ref(per[k], hvd.Average, hvd)[start:start + rows[me]])
    for root, dtype, shape in ((r, d, s) for r in range(n) for d in FLOATS for s in H.SHAPES):
        gs = [val(r, shape, dtype, salt=root, mult=n) for r in range(n)]
        x = val(me, shape, dtype).requires_grad_()
        hvd.broadcast(x, root).backward(gs[me])
        want = reduce_ref(gs, hvd.Average, hvd) if me == root else torch.zeros(shape, dtype=dtype)
        c.equal(f"broadcast grad root {root} {dtype} {list(shape)}", x.grad, want)


def check_grad_alltoall_reducescatter(c: Ctx) -> None:
    """alltoall's gradient is an alltoall back with the received splits; reducescatter's is the
    allgathered gradient, times the set's size for Sum and times the scale factors."""
    hvd, n, me = c.hvd, c.size, c.rank
    splits = [[(r + q) % 3 + (1 if r == q else 0) for q in range(n)] for r in range(n)]
    received = [[splits[s][q] for s in range(n)] for q in range(n)]  # what rank q got from each s
    for dtype, inner in ((d, i) for d in FLOATS for i in ((), (2,), (2, 3))):
        gs = [val(q, (sum(received[q]), *inner), dtype, salt=4) for q in range(n)]
        x = val(me, (sum(splits[me]), *inner), dtype).requires_grad_()
        out, _ = hvd.alltoall(x, splits[me])
        out.backward(gs[me])
        want = torch.cat([gs[q][sum(received[q][:me]):sum(received[q][:me + 1])] for q in range(n)])
        c.equal(f"alltoall grad {dtype} {list(inner)}", x.grad, want)
        x = val(me, (2 * n, *inner), dtype).requires_grad_()
        eq = [val(q, (2 * n, *inner), dtype, salt=6) for q in range(n)]
        hvd.alltoall(x).backward(eq[me])
        c.equal(f"alltoall equal-split grad {dtype} {list(inner)}", x.grad,
                torch.cat([g[2 * me:2 * me + 2] for g in eq]))
    d0 = 2 * n + 1
    for dtype, dims, (op, pre, post) in ((d, k, case) for d in FLOATS for k in (1, 2, 3) for case in
                                         ((hvd.Sum, 1.0, 1.0), (hvd.Average, 1.0, 1.0), (hvd.Sum, 0.5, 4.0))):
        inner = [2] * (dims - 1)
        gs = [val(q, (len(rows_of(d0, n, q)), *inner), dtype, salt=3) for q in range(n)]
        x = val(me, (d0, *inner), dtype).requires_grad_()
        hvd.reducescatter(x, op=op, prescale_factor=pre, postscale_factor=post).backward(gs[me])
        factor = (n if op == hvd.Sum else 1) * pre * post
        c.equal(f"reducescatter grad {dtype} {dims}-D op {op} pre {pre} post {post}", x.grad,
                scaled(torch.cat(gs), factor))
    xs = [val(me, (d0, k + 1), torch.float32).requires_grad_() for k in range(2)]
    per = [[val(q, (len(rows_of(d0, n, q)), k + 1), torch.float32, salt=k) for q in range(n)] for k in range(2)]
    sum((y * g[me]).sum() for y, g in zip(hvd.grouped_reducescatter(xs, op=hvd.Average), per)).backward()
    for k, x in enumerate(xs):
        c.equal(f"grouped_reducescatter grad {k}", x.grad, torch.cat(per[k]))


# ---------------------------------------------------------------------------------- mismatches
def _works_after(c: Ctx, what: str) -> None:
    xs = [val(r, (3, 2), torch.int32, salt=7) for r in range(c.size)]
    c.equal(f"allreduce after {what}", c.hvd.allreduce(xs[c.rank], op=c.hvd.Sum), reduce_ref(xs, c.hvd.Sum, c.hvd))


def check_mismatches(c: Ctx) -> None:
    """An op whose shape, dtype, dimensions, root, op or tensor count differs on the last rank
    raises HorovodInternalError (a RuntimeError) on every rank, naming the op and a rank other
    than the reader; the next collective works."""
    hvd, n, me = c.hvd, c.size, c.rank
    odd = me == n - 1
    other = 0 if odd else n - 1

    def shaped(a: tuple[int, ...], b: tuple[int, ...], dtype: torch.dtype = torch.float32,
               dtype_odd: torch.dtype = torch.float32) -> torch.Tensor:
        return val(me, b if odd else a, dtype_odd if odd else dtype)

    cases: dict[str, Any] = {
        "allreduce shape": lambda name: hvd.allreduce(shaped((4,), (5,)), name=name),
        "allreduce dims": lambda name: hvd.allreduce(shaped((2, 2), (4,)), name=name),
        "allreduce dtype": lambda name: hvd.allreduce(shaped((4,), (4,), dtype_odd=torch.int32), name=name),
        "allreduce op": lambda name: hvd.allreduce(val(me, (4,), torch.float32), name=name,
                                                   op=hvd.Max if odd else hvd.Sum),
        "allreduce_async shape": lambda name: hvd.synchronize(hvd.allreduce_async(shaped((3,), (6,)), name=name)),
        "allreduce_ shape": lambda name: hvd.allreduce_(shaped((2, 3), (3, 2)), name=name),
        "grouped_allreduce count": lambda name: hvd.grouped_allreduce(
            [val(me, (2,), torch.float32)] * (3 if odd else 2), name=name),
        "allgather shape": lambda name: hvd.allgather(shaped((2, 3), (2, 4)), name=name),
        "allgather dims": lambda name: hvd.allgather(shaped((2, 3), (2, 3, 1)), name=name),
        "allgather dtype": lambda name: hvd.allgather(shaped((2, 3), (2, 3), dtype_odd=torch.float64), name=name),
        "broadcast shape": lambda name: hvd.broadcast(shaped((3, 3), (3, 4)), 0, name=name),
        "broadcast dtype": lambda name: hvd.broadcast(shaped((3,), (3,), dtype_odd=torch.int64), 0, name=name),
        "broadcast root": lambda name: hvd.broadcast(val(me, (3,), torch.float32), me, name=name),
        "alltoall dtype": lambda name: hvd.alltoall(shaped((n, 2), (n, 2), dtype_odd=torch.int32), name=name),
        "alltoall shape": lambda name: hvd.alltoall(shaped((n, 2), (n, 3)), name=name),
        "reducescatter shape": lambda name: hvd.reducescatter(shaped((n, 2), (n + 1, 2)), name=name),
        "reducescatter dtype": lambda name: hvd.reducescatter(shaped((n, 2), (n, 2), dtype_odd=torch.float16),
                                                              name=name),
    }
    for what, fn in cases.items():
        name = "mm." + what.replace(" ", ".")
        c.raises(what, (hvd.HorovodInternalError,), lambda: fn(name), [name, f"rank {other}"])
        _works_after(c, what)
    c.true("HorovodInternalError is a RuntimeError", issubclass(hvd.HorovodInternalError, RuntimeError))
    xs = [val(r, (n, 2), torch.float32) for r in range(n)]
    c.equal("allgather after the mismatches", hvd.allgather(xs[me]), torch.cat(xs))
    c.equal("broadcast after the mismatches", hvd.broadcast(xs[me], n - 1), xs[n - 1])
    c.equal("alltoall after the mismatches", hvd.alltoall(xs[me]), torch.cat([x[me:me + 1] for x in xs]))
    c.equal("reducescatter after the mismatches", hvd.reducescatter(xs[me], op=hvd.Sum),
            reduce_ref(xs, hvd.Sum, hvd)[me:me + 1])


# ---------------------------------------------------------------------------------- join, init
def _same_everywhere(c: Ctx, what: str, value: Any) -> None:
    import torchring  # in the rank only (see _hvd_checks.run_checks)

    seen = torchring.allgather_object(value)
    c.true(f"{what}: the same on every rank", all(v == seen[0] for v in seen), f"got {seen}")


def check_join_allreduce(c: Ctx) -> None:
    """A rank that joined early adds zeros to the others' Average allreduces (and to Sum
    reducescatters and grouped allreduces); join() returns one rank, the same everywhere, not
    the first to join."""
    hvd, n, me = c.hvd, c.size, c.rank
    d0 = 2 * n + 1
    for first, warm, dtype in ((f, w, d) for f in range(n) for w in (False, True)
                               for d in (torch.int32, torch.int64, torch.float32, torch.float64)):
        mult = n if dtype.is_floating_point else 1
        a = [val(r, (5, 5), dtype, salt=first, mult=mult) for r in range(n)]
        b = [val(r, (17,), dtype, salt=first + 1, mult=mult) for r in range(n)]
        rs = [val(r, (d0, 2), dtype, salt=2) for r in range(n)]
        if warm:  # the names have run once with every rank before one joins
            hvd.synchronize(hvd.allreduce_async(a[me], name="ja", op=hvd.Average))
            hvd.synchronize(hvd.allreduce_async(b[me], name="jb", op=hvd.Average))
        what = f"first {first} warm {warm} {dtype}"
        if me == first:
            ret = hvd.join()
        else:
            ha = hvd.allreduce_async(a[me], name="ja", op=hvd.Average)
            hb = hvd.allreduce_async(b[me], name="jb", op=hvd.Average)
            zero = [x if r != first else torch.zeros_like(x) for r, x in enumerate(a)]
            c.equal(f"{what}: Average with rank {first} joined", hvd.synchronize(ha), reduce_ref(zero, hvd.Average, hvd))
            zero = [x if r != first else torch.zeros_like(x) for r, x in enumerate(b)]
            c.equal(f"{what}: second Average", hvd.synchronize(hb), reduce_ref(zero, hvd.Average, hvd))
            zero = [x if r != first else torch.zeros_like(x) for r, x in enumerate(rs)]
            c.equal(f"{what}: reducescatter Sum", hvd.reducescatter(rs[me], op=hvd.Sum, name="jrs"),
                    reduce_ref(zero, hvd.Sum, hvd)[rows_of(d0, n, me)])
            outs = hvd.grouped_allreduce([a[me], b[me]], name="jg", op=hvd.Sum)
            for k, xs in enumerate((a, b)):
                zero = [x if r != first else torch.zeros_like(x) for r, x in enumerate(xs)]
                c.equal(f"{what}: grouped Sum tensor {k}", outs[k], reduce_ref(zero, hvd.Sum, hvd))
            ret = hvd.join()
        c.true(f"{what}: join() returns a rank other than the first to join", ret != first and 0 <= ret < n,
               f"got {ret}")
        _same_everywhere(c, f"{what}: join()", ret)
    _works_after(c, "the joins")


def check_join_returns_the_last(c: Ctx) -> None:
    """When one rank joins well after the others, join() returns that rank on every rank."""
    import torchring  # in the rank only

    hvd, n, me = c.hvd, c.size, c.rank
    for last in range(n):
        torchring.barrier()  # direct: every rank starts the round together
        if me == last:
            time.sleep(0.3)
        got = hvd.join()
        c.true(f"rank {last} joined last", got == last, f"join() returned {got}")


def check_join_refuses_data_movers(c: Ctx) -> None:
    """While a rank has joined, allgather and broadcast raise on the others; join still ends."""
    hvd, n, me = c.hvd, c.size, c.rank
    for first in range(n):
        if me == first:
            ret = hvd.join()
        else:
            root = (first + 1) % n
            c.raises(f"allgather with rank {first} joined", (RuntimeError,),
                     lambda: hvd.allgather(torch.ones(2, 3), name="jgather"))
            c.raises(f"broadcast with rank {first} joined", (RuntimeError,),
                     lambda: hvd.broadcast(torch.ones(3), root, name="jbcast"))
            ret = hvd.join()
        c.true(f"first {first}: join() returns another rank", ret != first, f"got {ret}")
        _same_everywhere(c, f"first {first}: join()", ret)
    _works_after(c, "the refused ops")


def check_join_unnamed_allgather(c: Ctx) -> None:
    """As above with unnamed allgathers (Horovod's own join test names none): the rank that
    joined skipped the allgathers the others issued, so their automatic names can no longer
    match it; each must still fail promptly instead of waiting for a rank that never asks."""
    hvd, n, me = c.hvd, c.size, c.rank
    for first in range(n):
        if me == first:
            ret = hvd.join()
        else:
            h = hvd.allgather_async(torch.ones(2, 3))
            deadline = time.monotonic() + 5
            while not hvd.poll(h) and time.monotonic() < deadline:
                time.sleep(0.01)
            if hvd.poll(h):
                c.raises(f"unnamed allgather with rank {first} joined", (RuntimeError,), lambda: hvd.synchronize(h))
            else:
                c.fail(f"unnamed allgather with rank {first} joined", "still waiting after 5 s")
            ret = hvd.join()
        _same_everywhere(c, f"first {first}: join()", ret)


def check_init_after_shutdown(c: Ctx) -> None:
    """shutdown() ends the session (size() refuses), init() starts another with the same ranks."""
    hvd = c.hvd
    _works_after(c, "the first init")
    hvd.shutdown()
    c.true("is_initialized() after shutdown", not hvd.is_initialized())
    c.raises("size() after shutdown", (ValueError,), hvd.size)
    hvd.init()
    c.true("is_initialized() after init", hvd.is_initialized())
    c.true("rank and size kept", (hvd.rank(), hvd.size()) == (c.rank, c.size), f"got {(hvd.rank(), hvd.size())}")
    c.true("global set", hvd.global_process_set.ranks == list(range(c.size)) and hvd.global_process_set.size() == c.size,
           str(hvd.global_process_set))
    _works_after(c, "the second init")
    h = hvd.allreduce_async(torch.ones(2), name="late")
    hvd.synchronize(h)
    c.true("synchronize() of a finished handle gives None", hvd.synchronize(h) is None)


# ---------------------------------------------------------------------------------- process sets
def _set_collectives(c: Ctx, ps: Any) -> None:
    """Every collective within `ps` (this rank is a member); references from its members only."""
    hvd, me, members = c.hvd, c.rank, list(ps.ranks)
    k, where = len(members), f"set {members}"
    xs = {r: val(r, (3, 4), torch.int32, salt=k) for r in members}
    c.equal(f"{where} allreduce Sum", hvd.allreduce(xs[me], op=hvd.Sum, process_set=ps),
            reduce_ref([xs[r] for r in members], hvd.Sum, hvd))
    c.equal(f"{where} allreduce Average", hvd.allreduce(xs[me], op=hvd.Average, process_set=ps),
            reduce_ref([xs[r] for r in members], hvd.Average, hvd))
    outs = hvd.grouped_allreduce([xs[me], 3 * xs[me]], op=hvd.Max, process_set=ps)
    c.equal(f"{where} grouped_allreduce", outs[1], reduce_ref([3 * xs[r] for r in members], hvd.Max, hvd))
    gath = {r: val(r, (r + 1, 2), torch.float32) for r in members}
    c.equal(f"{where} allgather", hvd.allgather(gath[me], process_set=ps), torch.cat([gath[r] for r in members]))
    outs = hvd.grouped_allgather([gath[me], 2 * gath[me]], process_set=ps)
    c.equal(f"{where} grouped_allgather", outs[1], torch.cat([2 * gath[r] for r in members]))
    for root in members:
        c.equal(f"{where} broadcast from world rank {root}", hvd.broadcast(xs[me], root, process_set=ps), xs[root])
    c.raises(f"{where} broadcast from a rank outside", (ValueError,),
             lambda: hvd.broadcast(xs[me], next(r for r in range(c.size) if r not in members), process_set=ps))
    a2a = {r: val(r, (2 * k, 3), torch.float64, salt=1) for r in members}
    i = members.index(me)
    c.equal(f"{where} alltoall", hvd.alltoall(a2a[me], process_set=ps),
            torch.cat([a2a[r][2 * i:2 * i + 2] for r in members]))
    rs = {r: val(r, (2 * k + 1, 2), torch.float32, salt=2) for r in members}
    c.equal(f"{where} reducescatter", hvd.reducescatter(rs[me], op=hvd.Sum, process_set=ps),
            reduce_ref([rs[r] for r in members], hvd.Sum, hvd)[rows_of(2 * k + 1, k, i)])
    gs = {r: val(r, (4,), torch.float32, salt=3, mult=k) for r in members}
    x = val(me, (4,), torch.float32).requires_grad_()
    hvd.allreduce(x, op=hvd.Average, process_set=ps).backward(gs[me])
    c.equal(f"{where} allreduce grad", x.grad, reduce_ref([gs[r] for r in members], hvd.Average, hvd))
    gs = {r: val(r, (sum(q + 1 for q in members), 2), torch.float64, salt=4, mult=k) for r in members}
    x = val(me, (me + 1, 2), torch.float64).requires_grad_()
    hvd.allgather(x, process_set=ps).backward(gs[me])
    start = sum(q + 1 for q in members[:i])
    c.equal(f"{where} allgather grad", x.grad,
            reduce_ref([gs[r] for r in members], hvd.Average, hvd)[start:start + me + 1])
    root = members[-1]
    gs = {r: val(r, (3,), torch.float32, salt=5, mult=k) for r in members}
    x = val(me, (3,), torch.float32).requires_grad_()
    hvd.broadcast(x, root, process_set=ps).backward(gs[me])
    c.equal(f"{where} broadcast grad (root world rank {root})", x.grad,
            reduce_ref([gs[r] for r in members], hvd.Average, hvd) if me == root else torch.zeros(3))
    gs = {r: val(r, (len(rows_of(2 * k + 1, k, members.index(r))), 2), torch.float32, salt=6) for r in members}
    x = val(me, (2 * k + 1, 2), torch.float32).requires_grad_()
    hvd.reducescatter(x, op=hvd.Sum, process_set=ps).backward(gs[me])
    c.equal(f"{where} reducescatter grad", x.grad, k * torch.cat([gs[r] for r in members]))
    sp = {r: (val(r, (6, 2), torch.float32, salt=7) * ((torch.arange(6) + r) % 2).reshape(6, 1)) for r in members}
    got = hvd.sparse_allreduce_async(sp[me].to_sparse(), f"sparse.set{k}", hvd.Sum, process_set=ps)()
    c.equal(f"{where} sparse_allreduce_async", got.to_dense(), reduce_ref([sp[r] for r in members], hvd.Sum, hvd))
    hvd.barrier(process_set=ps)


def check_process_sets(c: Ctx) -> None:
    """Even and odd sets at world 4: ids, sizes and ranks; collectives within each, interleaved
    with the global set; non-members and duplicate sets refused; remove and add again."""
    hvd, me, n = c.hvd, c.rank, c.size
    c.true("global set", hvd.global_process_set.process_set_id == 0
           and hvd.global_process_set.ranks == list(range(n)), str(hvd.global_process_set))
    even = hvd.add_process_set([r for r in range(n) if r % 2 == 0])
    odd = hvd.add_process_set(hvd.ProcessSet([r for r in range(n) if r % 2]))
    ids = [hvd.global_process_set.process_set_id, even.process_set_id, odd.process_set_id]
    c.true("ids differ", len(set(ids)) == 3, f"got {ids}")
    _same_everywhere(c, "set ids", ids)
    mine, other = (even, odd) if me % 2 == 0 else (odd, even)
    c.true("size/rank/included of my set", (mine.size(), mine.rank(), mine.included()) == (n // 2, me // 2, True),
           f"got {(mine.size(), mine.rank(), mine.included())}")
    c.true("rank/included of the other set", (other.rank(), other.included()) == (-1, False),
           f"got {(other.rank(), other.included())}")
    _set_collectives(c, mine)
    c.raises("allreduce on a set without this rank", (ValueError,),
             lambda: hvd.allreduce(torch.ones(2), process_set=other))
    # Async ops of the set and of the global set, synchronized in opposite orders.
    xs = [val(r, (6,), torch.int64, salt=8) for r in range(n)]
    h_set = hvd.allreduce_async(xs[me], op=hvd.Sum, name="both", process_set=mine)
    h_all = hvd.allreduce_async(xs[me], op=hvd.Sum, name="both")
    c.equal("global op beside a set op", hvd.synchronize(h_all), reduce_ref(xs, hvd.Sum, hvd))
    c.equal("set op beside a global op", hvd.synchronize(h_set), reduce_ref([xs[r] for r in mine.ranks], hvd.Sum, hvd))
    c.raises("adding a set with the ranks of another", (ValueError,), lambda: hvd.add_process_set(list(even.ranks)))
    c.raises("adding the global set's ranks", (ValueError,), lambda: hvd.add_process_set(list(range(n))))
    c.raises("removing the global set", (ValueError,), lambda: hvd.remove_process_set(hvd.global_process_set))
    c.true("remove_process_set(odd)", hvd.remove_process_set(odd) is True)
    c.true("removing it again gives False", hvd.remove_process_set(odd) is False)
    if me % 2:
        c.raises("allreduce on a removed set", (ValueError,), lambda: hvd.allreduce(torch.ones(2), process_set=odd))
    again = hvd.add_process_set([r for r in range(n) if r % 2])
    c.true("a re-added set gets a new id", again.process_set_id not in ids, f"got {again.process_set_id}")
    _set_collectives(c, even if me % 2 == 0 else again)
    hvd.barrier()
    c.true("remove even", hvd.remove_process_set(even) and hvd.remove_process_set(again))
    c.raises("a set with a rank outside the world", (ValueError,), lambda: hvd.add_process_set([0, n]))
    _works_after(c, "removing the sets")


def check_overlapping_sets_in_opposite_orders(c: Ctx) -> None:
    """Two sets sharing ranks 1 and 2: those ranks submit to the sets in opposite orders and wait
    in opposite orders; every op completes within its set."""
    hvd, me, n = c.hvd, c.rank, c.size
    first, second = hvd.add_process_set(list(range(n - 1))), hvd.add_process_set(list(range(1, n)))
    xs = [val(r, (4, 3), torch.float32, salt=9) for r in range(n)]
    mine = [ps for ps in (first, second) if me in ps.ranks]
    if me % 2:
        mine.reverse()
    for round_ in range(3):
        handles = [(ps, hvd.allreduce_async(xs[me], name=f"overlap.{round_}", op=hvd.Sum, process_set=ps))
                   for ps in mine]
        for ps, h in reversed(handles):
            c.equal(f"round {round_} set {ps.ranks}", hvd.synchronize(h),
                    reduce_ref([xs[r] for r in ps.ranks], hvd.Sum, hvd))
    hvd.barrier()
    c.true("removed", hvd.remove_process_set(first) and hvd.remove_process_set(second))


def check_init_with_process_sets(c: Ctx) -> None:
    """hvd.init(process_sets=[...]) registers the sets (a set of three and a singleton)."""
    hvd, me, n = c.hvd, c.rank, c.size
    hvd.shutdown()
    three, single = hvd.ProcessSet(list(range(n - 1))), hvd.ProcessSet([n - 1])
    hvd.init(process_sets=[three, single])
    c.true("registered", three.process_set_id is not None and single.process_set_id is not None
           and three.process_set_id != single.process_set_id, f"{three} {single}")
    if me < n - 1:
        _set_collectives(c, three)
    else:
        x = val(me, (5,), torch.float32)
        c.equal("singleton allreduce", hvd.allreduce(x, op=hvd.Sum, process_set=single), x)
        c.equal("singleton allgather", hvd.allgather(x, process_set=single), x)
    _works_after(c, "init with process sets")


# ---------------------------------------------------------------------------------- timeline
def _trace_failures(path: str, op_name: str, cycles: bool) -> list[str]:
    """What is wrong with the Chrome trace at `path` (empty when nothing is)."""
    try:
        with open(path) as f:
            events = json.load(f)
    except (OSError, ValueError) as e:
        return [f"{path}: not a readable JSON trace: {e}"]
    if not isinstance(events, list):
        events = events.get("traceEvents", []) if isinstance(events, dict) else []
    rows = {e.get("pid"): str(e.get("args", {}).get("name")) for e in events if e.get("name") == "process_name"}
    mine = {pid for pid, row in rows.items() if op_name in row}
    bad = [] if mine else [f"{path}: no row named after {op_name!r}; rows {sorted(rows.values())}"]
    for phase in ("NEGOTIATE_ALLREDUCE", "ALLREDUCE"):
        if not any(e.get("name") == phase and e.get("pid") in mine for e in events):
            bad.append(f"{path}: no {phase} on the row of {op_name!r}")
    has_cycles = any(e.get("name") == "CYCLE_START" for e in events)
    if has_cycles != cycles:
        bad.append(f"{path}: CYCLE_START marks {'missing' if cycles else 'present without mark_cycles'}")
    for pid in rows:
        begins = sum(1 for e in events if e.get("pid") == pid and e.get("ph") == "B")
        ends = sum(1 for e in events if e.get("pid") == pid and e.get("ph") == "E")
        if begins != ends:
            bad.append(f"{path}: row {rows[pid]!r} opens {begins} phases and closes {ends}")
    return bad


def check_timeline(c: Ctx) -> None:
    """HOROVOD_TIMELINE (with HOROVOD_TIMELINE_MARK_CYCLES=1) from init, then start_timeline /
    stop_timeline with and without mark_cycles: valid JSON on rank 0 only, rows named after the
    ops, Horovod's phase names."""
    hvd, me = c.hvd, c.rank
    env_path = os.environ["HOROVOD_TIMELINE"]
    folder = os.path.dirname(env_path)
    hvd.allreduce(val(me, (8,), torch.float32), name="tl_env_tensor")
    hvd.allgather(val(me, (2, 2), torch.float32))
    hvd.stop_timeline()
    hvd.barrier()
    if me == 0:
        for why in _trace_failures(env_path, "tl_env_tensor", cycles=True):
            c.fail("HOROVOD_TIMELINE", why)
    for mark in (False, True):
        path = os.path.join(folder, f"api.{int(mark)}.rank{me}.json")
        hvd.start_timeline(path, mark_cycles=mark)
        hvd.allreduce(val(me, (8,), torch.float64), name=f"tl_api_{int(mark)}")
        h = hvd.allreduce_async(val(me, (3,), torch.float64), name="tl_open")
        hvd.synchronize(h)
        hvd.stop_timeline()
        hvd.barrier()
        if me == 0:
            for why in _trace_failures(path, f"tl_api_{int(mark)}", cycles=mark):
                c.fail(f"start_timeline(mark_cycles={mark})", why)
        else:
            c.true(f"rank {me} writes no timeline", not os.path.exists(path), f"{path} exists")
    _works_after(c, "the timelines")


# ---------------------------------------------------------------------------------- the tests
REDUCTIONS = [H.check_allreduce_ops, H.check_allreduce_int_average_truncates,
              H.check_allreduce_deprecated_average, H.check_allreduce_scaling, H.check_grouped_allreduce,
              H.check_sparse_allreduce, H.check_odd_inputs,
              H.check_async_poll, H.check_names_in_any_order, H.check_duplicate_name,
              H.check_barrier_with_ops_in_flight]
DATA_MOVERS = [M.check_allgather, M.check_broadcast, M.check_alltoall, M.check_alltoall_errors,
               M.check_reducescatter, M.check_reducescatter_errors]
AUTOGRAD = [check_grad_allreduce, check_grad_allgather_broadcast, check_grad_alltoall_reducescatter]
FAILURES_AND_JOIN = [check_mismatches, check_join_allreduce, check_join_refuses_data_movers,
                     check_init_after_shutdown]


@pytest.mark.parametrize("world", [2, 3])
def test_hvd_reductions(world: int) -> None:
    assert_no_failures(spawn(world, H.run_checks, REDUCTIONS))


@pytest.mark.parametrize("world", [2, 3])
def test_hvd_data_movers_and_autograd(world: int) -> None:
    assert_no_failures(spawn(world, H.run_checks, DATA_MOVERS + AUTOGRAD))


@pytest.mark.parametrize("world", [2, 3])
def test_hvd_mismatches_join_and_reinit(world: int) -> None:
    assert_no_failures(spawn(world, H.run_checks, FAILURES_AND_JOIN))


def test_hvd_process_sets_world4() -> None:
    assert_no_failures(spawn(4, H.run_checks, [check_process_sets, check_overlapping_sets_in_opposite_orders,
                                               check_join_allreduce,
                                               check_init_with_process_sets]))


def test_hvd_timeline(tmp_path: Any) -> None:
    env = {"HOROVOD_TIMELINE": str(tmp_path / "env.json"), "HOROVOD_TIMELINE_MARK_CYCLES": "1"}
    assert_no_failures(spawn(2, H.run_checks, [check_timeline], env=env))


def test_hvd_join_returns_the_last_rank_world3() -> None:
    assert_no_failures(spawn(3, H.run_checks, [check_join_returns_the_last]))


def test_hvd_join_with_unnamed_allgathers_world3() -> None:
    assert_no_failures(spawn(3, H.run_checks, [check_join_unnamed_allgather]))


def test_hvd_blocking_and_async_forms_share_names() -> None:
    assert_no_failures(spawn(2, H.run_checks, [H.check_sync_and_async_forms_meet]))
