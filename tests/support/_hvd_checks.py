"""Spawned-rank checks of torchring.horovod's reductions, run many per world by :func:`run_checks`
(the data-moving collectives' checks are in tests/support/_hvd_movers.py, the rest in tests/spawned/horovod/test_hvd_ops.py).

Each check is ``check(c: Ctx) -> None``: it runs hvd collectives on every rank and records
mismatches in ``c`` (tests/support/_checks.Checker), so one job reports every bad case by name. Inputs are
small integers that every rank can rebuild for every other rank (:func:`val`, :func:`signs`), and
expected values come from :func:`reduce_ref`, a single-process reduction in float64 cast back.
The rules the references follow are Horovod's: Average is the sum over the set divided by its
size (integers truncate toward zero), integer tensors are scaled in float64 and cast back, a
reducescatter gives the first ranks one row more, root ranks are world ranks.

A check that raises stops the job after it on every rank (the ranks agree on that through a
direct torchring allgather), since a rank that left a check early issues different operations.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from _checks import Checker

INTS = [torch.int32, torch.int64]
FLOATS = [torch.float16, torch.float32, torch.float64, torch.bfloat16]
DTYPES = INTS + FLOATS
SHAPES = [(11,), (4, 5), (3, 2, 4)]  # 1, 2 and 3 dimensions


@dataclass
class Ctx:
    """What a check needs: the hvd module, this rank, the world size and the failure collector."""

    hvd: Any
    rank: int
    size: int
    chk: Checker
    where: str = ""

    def equal(self, what: str, got: Any, want: torch.Tensor) -> None:
        self.chk.equal(f"{self.where}: {what}", got, want)

    def true(self, what: str, cond: bool, why: str = "condition is false") -> None:
        self.chk.true(f"{self.where}: {what}", cond, why)

    def fail(self, what: str, why: str) -> None:
        self.chk.fail(f"{self.where}: {what}", why)

    def raises(self, what: str, types: tuple[type, ...], fn: Callable[[], Any],
               must_name: Sequence[str] = ()) -> str:
        """Runs `fn`, records a failure unless it raises one of `types` with every `must_name`
        text in its message; returns the message."""
        try:
            fn()
        except types as e:
            msg = str(e)
            missing = [s for s in must_name if s not in msg]
            self.true(f"{what}: message names {missing}", not missing, f"message: {msg}")
            return msg
        except Exception as e:  # noqa: BLE001 - the wrong type is what is reported
            self.fail(what, f"raised {type(e).__name__} instead of {[t.__name__ for t in types]}: {e}")
            return str(e)
        self.fail(what, f"did not raise {[t.__name__ for t in types]}")
        return ""


def run_checks(rank: int, checks: Sequence[Callable[[Ctx], None]],
               init_kwargs: dict[str, Any] | None = None) -> list[str]:
    """In a spawned rank: hvd.init(), every check in order, hvd.shutdown(); returns the failures."""
    import torchring  # here, not at the top: the parent process never needs the engine
    import torchring.horovod as hvd

    hvd.init(**(init_kwargs or {}))
    c = Ctx(hvd, rank, hvd.size(), Checker(rank))
    try:
        for check in checks:
            c.where = check.__name__
            crashed = False
            try:
                check(c)
            except Exception:  # noqa: BLE001 - reported by name, then the job stops
                c.fail("raised", traceback.format_exc())
                crashed = True
            flags = torchring.allgather_object(crashed)  # direct, not negotiated
            if any(flags):
                left = [ch.__name__ for ch in checks[checks.index(check) + 1:]]
                c.fail("job stopped", f"ranks {[r for r, f in enumerate(flags) if f]} raised; "
                                      f"not run: {left}")
                break
    finally:
        if hvd.is_initialized():
            hvd.shutdown()
    return c.chk.failures


# ---------------------------------------------------------------------------------- data
def val(rank: int, shape: Sequence[int], dtype: torch.dtype, salt: int = 0, mult: int = 1) -> torch.Tensor:
    """Rank `rank`'s input: integers in [-9, 9] (times `mult`), distinct per rank and element."""
    i = torch.arange(math.prod(shape), dtype=torch.int64)
    x = (i * 7 + rank * 5 + salt * 11) % 19 - 9
    if dtype == torch.bool:
        return (x % 2 == 0).reshape(tuple(shape))
    if dtype == torch.uint8:
        x = x + 9
    return (x * mult).to(dtype).reshape(tuple(shape))


def signs(rank: int, shape: Sequence[int], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Inputs for Product: values in {1, 2, -1}, so a product over 4 ranks stays exact."""
    i = torch.arange(math.prod(shape), dtype=torch.int64)
    return torch.tensor([1, 2, -1])[(i + 2 * rank + salt) % 3].to(dtype).reshape(tuple(shape))


def reduce_ref(xs: Sequence[torch.Tensor], op: int, hvd: Any, divisor: int | None = None) -> torch.Tensor:
    """The reduction of `xs` in one process (float64, cast back); Average divides by `divisor`
    (default len(xs)), truncating toward zero for integers."""
    dtype, n = xs[0].dtype, divisor or len(xs)
    x = torch.stack([t.to(torch.float64) for t in xs])
    if op == hvd.Sum:
        out = x.sum(0)
    elif op == hvd.Average:
        out = x.sum(0) / n if dtype.is_floating_point else torch.div(x.sum(0), n, rounding_mode="trunc")
    elif op == hvd.Min:
        out = x.amin(0)
    elif op == hvd.Max:
        out = x.amax(0)
    elif op == hvd.Product:
        out = x.prod(0)
    else:
        raise ValueError(f"no reference for op {op}")
    return out.to(dtype)


def scaled(t: torch.Tensor, factor: float) -> torch.Tensor:
    """`t` times `factor` in float64, cast back: Horovod's rule for integers (truncation toward
    zero); for floats the tests use factors that are exact in every dtype."""
    return (t.to(torch.float64) * factor).to(t.dtype)


def rows_of(d0: int, n: int, me: int) -> torch.Tensor:
    """The row indices rank `me` keeps when `d0` rows are split over `n`: first ranks one more."""
    base, extra = divmod(d0, n)
    start = me * base + min(me, extra)
    return torch.arange(start, start + base + (1 if me < extra else 0))


def op_inputs(c: Ctx, op: int, shape: Sequence[int], dtype: torch.dtype, salt: int = 0,
              ranks: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Every rank's input for `op`: Product gets signs; a float Average gets multiples of the
    set's size (so the mean is exact); integers keep values whose sums do not divide evenly."""
    ranks = list(range(c.size)) if ranks is None else list(ranks)
    if op == c.hvd.Product:
        return [signs(r, shape, dtype, salt) for r in ranks]
    mult = len(ranks) if op == c.hvd.Average and dtype.is_floating_point else 1
    return [val(r, shape, dtype, salt, mult) for r in ranks]


# ---------------------------------------------------------------------------------- allreduce
def check_allreduce_ops(c: Ctx) -> None:
    """Every op x dtype x 1-3 dims, out of place, in place, async and async in place."""
    hvd = c.hvd
    ops = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max, "Product": hvd.Product}
    for (opname, op), dtype, shape in itertools.product(ops.items(), DTYPES, SHAPES):
        xs = op_inputs(c, op, shape, dtype)
        want, what = reduce_ref(xs, op, hvd), f"{opname} {dtype} {list(shape)}"
        mine = xs[c.rank].clone()
        c.equal(f"allreduce {what}", hvd.allreduce(mine, op=op), want)
        c.equal(f"allreduce {what} leaves its input", mine, xs[c.rank])
        out = hvd.allreduce_(mine, op=op, name=f"inplace.{opname}.{dtype}.{len(shape)}")
        c.true(f"allreduce_ {what} returns its input", out is mine)
        c.equal(f"allreduce_ {what}", mine, want)
        h = hvd.allreduce_async(xs[c.rank].clone(), op=op)
        c.equal(f"allreduce_async {what}", hvd.synchronize(h), want)
        buf = xs[c.rank].clone()
        c.equal(f"allreduce_async_ {what}", hvd.synchronize(hvd.allreduce_async_(buf, op=op)), want)
        c.equal(f"allreduce_async_ {what} wrote its input", buf, want)


def check_allreduce_int_average_truncates(c: Ctx) -> None:
    """An integer Average is the sum divided by the size, rounded toward zero (not floored)."""
    hvd, n = c.hvd, c.size
    base = torch.tensor([-9, -7, -4, -2, -1, 0, 1, 2, 4, 7])
    for dtype in INTS:
        xs = [(base + r * r).to(dtype) for r in range(n)]
        total = sum(x.to(torch.int64) for x in xs)
        c.true("the data has a negative sum that does not divide evenly",
               bool(((total < 0) & (total % n != 0)).any()), f"sums {total.tolist()}")
        want = torch.div(total, n, rounding_mode="trunc").to(dtype)
        c.equal(f"Average {dtype}", hvd.allreduce(xs[c.rank], op=hvd.Average), want)
        c.true(f"Average {dtype} is not floor division",
               not torch.equal(want, torch.div(total, n, rounding_mode="floor").to(dtype)))


def check_allreduce_deprecated_average(c: Ctx) -> None:
    """average=True is Average and average=False is Sum, each with a DeprecationWarning."""
    hvd = c.hvd
    xs = [val(r, (6,), torch.float32, mult=c.size) for r in range(c.size)]
    for average, op in ((True, hvd.Average), (False, hvd.Sum)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = hvd.allreduce(xs[c.rank], average=average)
        c.equal(f"average={average}", got, reduce_ref(xs, op, hvd))
        c.true(f"average={average} warns", any(issubclass(w.category, DeprecationWarning) for w in seen),
               f"warnings: {[str(w.message) for w in seen]}")


def check_allreduce_scaling(c: Ctx) -> None:
    """prescale_factor before the sum, postscale_factor after; integers scaled in float64."""
    hvd = c.hvd
    cases = [(hvd.Sum, 0.5, 4.0), (hvd.Average, 2.0, 0.25), (hvd.Sum, 3.0, 1.0), (hvd.Sum, 1.0, 0.5)]
    for (op, pre, post), dtype, shape in itertools.product(cases, FLOATS, SHAPES):
        xs = op_inputs(c, op, shape, dtype)
        want = reduce_ref([scaled(x, pre) for x in xs], op, hvd)
        want = scaled(want, post)
        got = hvd.allreduce(xs[c.rank], op=op, prescale_factor=pre, postscale_factor=post)
        c.equal(f"op {op} pre {pre} post {post} {dtype} {list(shape)}", got, want)
    for dtype, (pre, post) in itertools.product(INTS, [(1.5, 1.0), (1.0, 0.3), (2.5, 0.7), (0.5, 3.0)]):
        xs = [val(r, (4, 5), dtype) for r in range(c.size)]
        want = scaled(reduce_ref([scaled(x, pre) for x in xs], hvd.Sum, hvd), post)
        c.equal(f"Sum {dtype} pre {pre} post {post}",
                hvd.allreduce(xs[c.rank], op=hvd.Sum, prescale_factor=pre, postscale_factor=post), want)
        buf = xs[c.rank].clone()
        hvd.allreduce_(buf, op=hvd.Sum, prescale_factor=pre, postscale_factor=post)
        c.equal(f"allreduce_ Sum {dtype} pre {pre} post {post}", buf, want)
        want = reduce_ref([scaled(x, pre) for x in xs], hvd.Average, hvd)
        c.equal(f"Average {dtype} pre {pre}",
                hvd.allreduce(xs[c.rank], op=hvd.Average, prescale_factor=pre), want)


def check_grouped_allreduce(c: Ctx) -> None:
    """grouped_allreduce{,_,_async,_async_}: each tensor of the list reduced as by allreduce."""
    hvd = c.hvd
    for dtype, op in itertools.product(DTYPES, (hvd.Sum, hvd.Average, hvd.Max)):
        xss = [op_inputs(c, op, shape, dtype, salt=k) for k, shape in enumerate(SHAPES)]
        wants = [reduce_ref(xs, op, hvd) for xs in xss]
        mine = [xs[c.rank].clone() for xs in xss]
        outs = hvd.grouped_allreduce(mine, op=op)
        for k, (o, w) in enumerate(zip(outs, wants)):
            c.equal(f"grouped_allreduce {dtype} op {op} tensor {k}", o, w)
            c.equal(f"grouped_allreduce {dtype} leaves input {k}", mine[k], xss[k][c.rank])
        outs = hvd.grouped_allreduce_(mine, op=op)
        c.true(f"grouped_allreduce_ {dtype} returns its inputs", all(a is b for a, b in zip(outs, mine)))
        for k, w in enumerate(wants):
            c.equal(f"grouped_allreduce_ {dtype} op {op} tensor {k}", mine[k], w)
        h = hvd.grouped_allreduce_async([xs[c.rank] for xs in xss], op=op, name=f"g.{dtype}.{op}")
        for k, (o, w) in enumerate(zip(hvd.synchronize(h), wants)):
            c.equal(f"grouped_allreduce_async {dtype} op {op} tensor {k}", o, w)
        bufs = [xs[c.rank].clone() for xs in xss]
        hvd.synchronize(hvd.grouped_allreduce_async_(bufs, op=op, prescale_factor=1.0))
        for k, w in enumerate(wants):
            c.equal(f"grouped_allreduce_async_ {dtype} op {op} tensor {k}", bufs[k], w)
    xss = [[val(r, s, torch.float32, k) for r in range(c.size)] for k, s in enumerate(SHAPES)]
    outs = hvd.grouped_allreduce([xs[c.rank] for xs in xss], op=hvd.Sum, prescale_factor=0.5,
                                 postscale_factor=4.0)
    for k, xs in enumerate(xss):
        c.equal(f"grouped_allreduce scaled tensor {k}", outs[k], reduce_ref(xs, hvd.Sum, hvd) * 2)


def check_sparse_allreduce(c: Ctx) -> None:
    """sparse_allreduce_async of COO tensors with a different number of non-zeros per rank (none
    on rank 1) equals the dense Sum / Average; several in flight at once."""
    hvd, n, me = c.hvd, c.size, c.rank

    def dense(r: int, d0: int, k: int) -> torch.Tensor:
        t = val(r, (d0, 4), torch.float32, salt=k, mult=n)
        keep = (torch.arange(d0) + r + k) % 3 == 0
        return torch.zeros_like(t) if r == 1 else t * keep.reshape(d0, 1)

    cases = [(k, d0, op) for k, d0 in enumerate((17, 32, 5)) for op in (hvd.Sum, hvd.Average)]
    waits = [hvd.sparse_allreduce_async(dense(me, d0, k).to_sparse(), f"sparse.{k}.{op}", op)
             for k, d0, op in cases]
    for (k, d0, op), wait in zip(cases, waits):
        got = wait()
        c.true(f"sparse {k} op {op} is sparse", got.is_sparse, f"got layout {got.layout}")
        c.equal(f"sparse {k} op {op}", got.to_dense(), reduce_ref([dense(r, d0, k) for r in range(n)], op, hvd))


def check_odd_inputs(c: Ctx) -> None:
    """Non-contiguous, 0-dim, empty and multi-MiB tensors; fp16 compression; 300 named async ops
    in flight at once (their requests outgrow one negotiation slot)."""
    hvd, n, me = c.hvd, c.size, c.rank
    xs = [val(r, (5, 7), torch.float32) for r in range(n)]
    c.equal("allreduce of a transposed tensor", hvd.allreduce(xs[me].t(), op=hvd.Sum),
            reduce_ref(xs, hvd.Sum, hvd).t())
    c.equal("allgather of a transposed tensor", hvd.allgather(xs[me].t()), torch.cat([x.t() for x in xs]))
    c.equal("broadcast of a transposed tensor", hvd.broadcast(xs[me].t(), n - 1), xs[n - 1].t())
    c.equal("reducescatter of a column slice", hvd.reducescatter(xs[me][:, 1:3].t(), op=hvd.Sum),
            reduce_ref(xs, hvd.Sum, hvd)[:, 1:3].t()[rows_of(2, n, me)])
    scalars = [torch.tensor(float(3 * r - 2)) for r in range(n)]
    c.equal("allreduce of a 0-dim tensor", hvd.allreduce(scalars[me], op=hvd.Sum), reduce_ref(scalars, hvd.Sum, hvd))
    c.equal("broadcast of a 0-dim tensor", hvd.broadcast(scalars[me], 0), scalars[0])
    c.equal("allreduce of an empty tensor", hvd.allreduce(torch.zeros(0, 3), op=hvd.Sum), torch.zeros(0, 3))
    big = [val(r, (2**18 + 3,), torch.float32) for r in range(n)]
    c.equal("allreduce of 1 MiB + 12 bytes", hvd.allreduce(big[me], op=hvd.Sum), reduce_ref(big, hvd.Sum, hvd))
    c.equal("allgather of 1 MiB + 12 bytes", hvd.allgather(big[me]), torch.cat(big))
    c.equal("broadcast of 1 MiB + 12 bytes", hvd.broadcast(big[me], n - 1), big[n - 1])
    out = hvd.allreduce(xs[me], op=hvd.Sum, compression=hvd.Compression.fp16)
    c.equal("allreduce with Compression.fp16 keeps float32", out, reduce_ref(xs, hvd.Sum, hvd))
    names = [f"a.long.name.for.a.tensor.of.layer.{k}.of.a.model.with.a.great.many.layers.weight" for k in range(300)]
    small = [[val(r, (3,), torch.int64, salt=k) for r in range(n)] for k in range(len(names))]
    order = list(range(len(names)))[::1 if me % 2 == 0 else -1]
    handles = {k: hvd.allreduce_async(small[k][me], name=names[k], op=hvd.Sum) for k in order}
    bad = [k for k in order if not torch.equal(hvd.synchronize(handles[k]), reduce_ref(small[k], hvd.Sum, hvd))]
    c.true("300 named async ops in flight", not bad, f"wrong results for {bad[:5]}")


def check_async_poll(c: Ctx) -> None:
    """Many async allreduces in flight: poll() is False while rank 0 has not submitted them yet
    (it waits for the others' polls on a direct torchring barrier), True once they are done, and
    synchronize() then returns every result."""
    import torchring  # in the rank only, like run_checks

    hvd = c.hvd
    xss = [[val(r, (7, 3), torch.int64, salt=k) for r in range(c.size)] for k in range(10)]
    if c.rank == 0:
        torchring.barrier()
    handles = [hvd.allreduce_async(xs[c.rank], op=hvd.Sum, name=f"fused.{k}") for k, xs in enumerate(xss)]
    if c.rank != 0:
        polled = [hvd.poll(h) for h in handles]
        torchring.barrier()
        c.true("poll() is False before rank 0 submitted", not any(polled), f"got {polled}")
    deadline = time.monotonic() + 30
    while not all(hvd.poll(h) for h in handles) and time.monotonic() < deadline:
        time.sleep(0.005)
    c.true("poll() becomes True", all(hvd.poll(h) for h in handles))
    for k, (h, xs) in enumerate(zip(handles, xss)):
        c.equal(f"fused.{k}", hvd.synchronize(h), reduce_ref(xs, hvd.Sum, hvd))


def check_names_in_any_order(c: Ctx) -> None:
    """Named async ops of every kind submitted (and synchronized) in a different order on each
    rank all complete with the right results."""
    hvd, n, me = c.hvd, c.size, c.rank
    xs = [val(r, (6, 2), torch.int32) for r in range(n)]
    gath = [val(r, (r + 1, 3), torch.float32, salt=1) for r in range(n)]
    a2a = [val(r, (2 * n, 2), torch.int64, salt=2) for r in range(n)]
    d0 = 2 * n + 1
    rs = [val(r, (d0, 3), torch.float64, salt=3) for r in range(n)]
    submit = {
        "ord.sum": lambda: hvd.allreduce_async(xs[me], name="ord.sum", op=hvd.Sum),
        "ord.max": lambda: hvd.allreduce_async(xs[me], name="ord.max", op=hvd.Max),
        "ord.gather": lambda: hvd.allgather_async(gath[me], name="ord.gather"),
        "ord.bcast": lambda: hvd.broadcast_async(xs[me], root_rank=n - 1, name="ord.bcast"),
        "ord.a2a": lambda: hvd.alltoall_async(a2a[me], name="ord.a2a"),
        "ord.rs": lambda: hvd.reducescatter_async(rs[me], name="ord.rs", op=hvd.Sum),
        "ord.group": lambda: hvd.grouped_allreduce_async([xs[me], 2 * xs[me]], name="ord.group", op=hvd.Sum),
    }
    names = list(submit)
    order = names[me:] + names[:me]
    if me % 2:
        order.reverse()
    handles = {name: submit[name]() for name in order}
    got = {name: hvd.synchronize(handles[name]) for name in reversed(order)}
    c.equal("ord.sum", got["ord.sum"], reduce_ref(xs, hvd.Sum, hvd))
    c.equal("ord.max", got["ord.max"], reduce_ref(xs, hvd.Max, hvd))
    c.equal("ord.gather", got["ord.gather"], torch.cat(gath))
    c.equal("ord.bcast", got["ord.bcast"], xs[n - 1])
    c.equal("ord.a2a", got["ord.a2a"][0], torch.cat([a[2 * me:2 * me + 2] for a in a2a]))
    c.equal("ord.rs", got["ord.rs"], reduce_ref(rs, hvd.Sum, hvd)[rows_of(d0, n, me)])
    grouped = got["ord.group"]
    c.equal("ord.group 0", grouped[0], reduce_ref(xs, hvd.Sum, hvd))
    c.equal("ord.group 1", grouped[1], reduce_ref([2 * x for x in xs], hvd.Sum, hvd))


def _in_thread(fn: Callable[[], Any], seconds: float) -> dict[str, Any]:
    """Runs `fn` in a thread for at most `seconds`: {"out": ...} or {"error": ...}, {} if still running."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["out"] = fn()
        except Exception as e:  # noqa: BLE001 - handed back to the check
            box["error"] = e

    th = threading.Thread(target=body, daemon=True)
    th.start()
    th.join(seconds)
    return box


def check_sync_and_async_forms_meet(c: Ctx) -> None:
    """One name, the blocking form on even ranks and the *_async form on odd ranks: they are the
    same operation (as in Horovod), so each pair completes. A pair that has not finished after
    3 s is reported, then released by each rank issuing the other form too."""
    hvd, n, me = c.hvd, c.size, c.rank
    x = val(me, (2 * n, 3), torch.float32)
    xs = [val(r, (2 * n, 3), torch.float32) for r in range(n)]
    forms = {
        "allreduce": (lambda nm: hvd.allreduce(x, name=nm, op=hvd.Sum),
                      lambda nm: hvd.synchronize(hvd.allreduce_async(x, name=nm, op=hvd.Sum)),
                      reduce_ref(xs, hvd.Sum, hvd)),
        "allgather": (lambda nm: hvd.allgather(x, name=nm),
                      lambda nm: hvd.synchronize(hvd.allgather_async(x, name=nm)), torch.cat(xs)),
        "broadcast": (lambda nm: hvd.broadcast(x, 0, name=nm),
                      lambda nm: hvd.synchronize(hvd.broadcast_async(x, 0, name=nm)), xs[0]),
        "alltoall": (lambda nm: hvd.alltoall(x, name=nm),
                     lambda nm: hvd.synchronize(hvd.alltoall_async(x, name=nm))[0],
                     torch.cat([t[2 * me:2 * me + 2] for t in xs])),
        "reducescatter": (lambda nm: hvd.reducescatter(x, name=nm, op=hvd.Sum),
                          lambda nm: hvd.synchronize(hvd.reducescatter_async(x, name=nm, op=hvd.Sum)),
                          reduce_ref(xs, hvd.Sum, hvd)[2 * me:2 * me + 2]),
    }
    for kind, (blocking, asynchronous, want) in forms.items():
        name = f"forms.{kind}"
        mine, theirs = (blocking, asynchronous) if me % 2 == 0 else (asynchronous, blocking)
        box = _in_thread(lambda: mine(name), 3.0)
        if not box:
            c.fail(f"{kind}: blocking and async forms named {name!r}", "still waiting after 3 s")
            _in_thread(lambda: theirs(name), 30.0)  # meets the other ranks' form
            continue
        if "error" in box:
            c.fail(f"{kind}: forms named {name!r}", f"raised {box['error']!r}")
            continue
        c.equal(f"{kind}: blocking and async forms", box["out"], want)


def check_duplicate_name(c: Ctx) -> None:
    """A second in-flight op with a name is a ValueError on that rank only; the first op still
    completes once every rank submitted it, and the name can be reused afterwards. Each rank checks
    the duplicate while another rank has not yet submitted the name (behind a barrier), so the first
    op cannot have finished in between."""
    hvd, me = c.hvd, c.rank
    xs = [val(r, (17, 3), torch.float32) for r in range(c.size)]
    for checker, name in ((0, "dup"), (c.size - 1, "dup_last")):
        first = None
        if me == checker:
            first = hvd.allreduce_async(xs[me], name=name, op=hvd.Sum)
            c.raises(f"second {name!r} on rank {me}", (ValueError,),
                     lambda: hvd.allreduce_async(xs[me], name=name, op=hvd.Sum), [name])
        hvd.barrier()
        if me != checker:
            first = hvd.allreduce_async(xs[me], name=name, op=hvd.Sum)
        c.equal(f"the first {name!r} op", hvd.synchronize(first), reduce_ref(xs, hvd.Sum, hvd))
    c.equal("'dup' reused after it finished", hvd.allreduce(xs[me], name="dup", op=hvd.Sum),
            reduce_ref(xs, hvd.Sum, hvd))
    if me == 0:
        h = hvd.broadcast_async(xs[me], 0, name="dupb")
        c.raises("second broadcast 'dupb'", (ValueError,), lambda: hvd.broadcast_async(xs[me], 0, name="dupb"))
        c.raises("second allgather 'dupg'", (ValueError,), lambda: [hvd.allgather_async(xs[me], name="dupg"),
                                                                   hvd.allgather_async(xs[me], name="dupg")])
    hvd.barrier()
    if me > 0:
        h = hvd.broadcast_async(xs[me], 0, name="dupb")
        hvd.allgather_async(xs[me], name="dupg")
    c.equal("broadcast 'dupb'", hvd.synchronize(h), xs[0])


def check_barrier_with_ops_in_flight(c: Ctx) -> None:
    """barrier() while async broadcast/allgather/allreduce are in flight; all complete afterwards."""
    hvd, me = c.hvd, c.rank
    eyes = [torch.eye(3) * (r + 1) for r in range(c.size)]
    hb = hvd.broadcast_async(eyes[me], root_rank=0)
    g1 = [torch.eye(5) + r for r in range(c.size)]
    hg1 = hvd.allgather_async(g1[me])
    hg2 = hvd.allgather_async(torch.zeros(5, 5))
    ha = hvd.allreduce_async(g1[me], op=hvd.Sum)
    hvd.barrier()
    c.equal("allreduce", hvd.synchronize(ha), reduce_ref(g1, hvd.Sum, hvd))
    c.equal("allgather 1", hvd.synchronize(hg1), torch.cat(g1))
    c.equal("allgather 2", hvd.synchronize(hg2), torch.zeros(5 * c.size, 5))
    c.equal("broadcast", hvd.synchronize(hb), eyes[0])
    hvd.barrier()
