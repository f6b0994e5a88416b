"""torchring.horovod on CUDA tensors: the collectives a Horovod script calls, on the GPU.

hvd.allreduce (every op; out of place, in place, async, grouped, scaled), allgather (a different
dim 0 per rank), broadcast and broadcast_ from every root, broadcast_parameters of a CUDA model,
alltoall (equal parts, and splits with the received counts), reducescatter, and two steps of
DistributedOptimizer against single-process training, all on CUDA tensors: at world 1 (the NCCL
path) and world 2 (two ranks sharing the GPU: the staged path). Every result must stay on the
GPU and equal a single-process reference (tests/support/_hvd_checks.reduce_ref, Horovod's
arithmetic) of every rank's integer-valued input. One spawned world runs every check
(_hvd_checks.run_checks), so a failure names its check.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch import nn

from _checks import assert_no_failures
from _dist import spawn
from _hvd_checks import Ctx, op_inputs, reduce_ref, rows_of, run_checks, scaled, val

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64]
_device_type = "cuda"  # this process's job: "cuda", or "cpu" to try the checks without a GPU


def _dev() -> torch.device:
    """This rank's device: torchring's CUDA device (an error if the job has no CUDA path)."""
    if _device_type == "cpu":
        return torch.device("cpu")
    import torchring

    dev = torchring.cuda.device()
    if dev is None or torchring.cuda.path() == "none":
        raise RuntimeError(f"no CUDA path: {torchring.cuda.path()} ({torchring.cuda.reason()})")
    return dev


def _on(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A copy of `t` on `dev` (a copy on the CPU too, so in-place calls leave the inputs alone)."""
    return t.to(dev, copy=True)


def _same(c: Ctx, what: str, got: Any, want: torch.Tensor, dev: torch.device) -> None:
    """Record a failure unless `got` is on `dev` and equals `want` exactly."""
    if isinstance(got, torch.Tensor) and got.device != dev:
        return c.fail(what, f"result on {got.device}, expected {dev}")
    c.equal(what, got, want.to(dev))


def check_cuda_allreduce(c: Ctx) -> None:
    """allreduce, allreduce_, allreduce_async(_) with every op and dtype; grouped; scaled."""
    hvd, dev, me = c.hvd, _dev(), c.rank
    ops = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max, "Product": hvd.Product}
    for (name, op), dtype in itertools.product(ops.items(), DTYPES):
        xs = op_inputs(c, op, (4, 5), dtype)
        want, what = reduce_ref(xs, op, hvd), f"{name} {dtype}"
        mine = _on(xs[me], dev)
        _same(c, f"allreduce {what}", hvd.allreduce(mine, op=op), want, dev)
        _same(c, f"allreduce {what} leaves its input", mine, xs[me], dev)
        out = hvd.allreduce_(mine, op=op)
        c.true(f"allreduce_ {what} returns its input", out is mine)
        _same(c, f"allreduce_ {what}", mine, want, dev)
        _same(c, f"allreduce_async {what}", hvd.synchronize(hvd.allreduce_async(_on(xs[me], dev), op=op)), want, dev)
        buf = _on(xs[me], dev)
        hvd.synchronize(hvd.allreduce_async_(buf, op=op))
        _same(c, f"allreduce_async_ {what}", buf, want, dev)
    shapes = [(11,), (4, 5), (3, 2, 4)]
    per = [op_inputs(c, hvd.Average, shape, torch.float32, salt=k) for k, shape in enumerate(shapes)]
    outs = hvd.grouped_allreduce([_on(p[me], dev) for p in per], op=hvd.Average)
    for k, p in enumerate(per):
        _same(c, f"grouped_allreduce Average tensor {k}", outs[k], reduce_ref(p, hvd.Average, hvd), dev)
    for dtype, op, pre, post in [(torch.float32, hvd.Sum, 0.5, 4.0), (torch.float16, hvd.Average, 2.0, 0.5),
                                 (torch.int32, hvd.Sum, 1.5, 0.5)]:
        xs = op_inputs(c, op, (6, 3), dtype)
        want = scaled(reduce_ref([scaled(x, pre) for x in xs], op, hvd), post)
        got = hvd.allreduce(_on(xs[me], dev), op=op, prescale_factor=pre, postscale_factor=post)
        _same(c, f"allreduce {dtype} op {op} pre {pre} post {post}", got, want, dev)


def check_cuda_allgather(c: Ctx) -> None:
    """allgather with a different dim 0 per rank (none from rank 1), every dtype; async; grouped."""
    hvd, dev, n, me = c.hvd, _dev(), c.size, c.rank
    rows = [[3, 0, 2, 1][r % 4] for r in range(n)]
    for dtype in DTYPES:
        xs = [val(r, (rows[r], 3), dtype) for r in range(n)]
        _same(c, f"allgather {dtype} rows {rows}", hvd.allgather(_on(xs[me], dev)), torch.cat(xs), dev)
    xs = [val(r, (r + 2, 2), torch.int64, salt=3) for r in range(n)]
    _same(c, "allgather_async", hvd.synchronize(hvd.allgather_async(_on(xs[me], dev))), torch.cat(xs), dev)
    per = [[val(r, (r + 1 + k, k + 1), torch.bfloat16, salt=k) for r in range(n)] for k in range(2)]
    outs = hvd.grouped_allgather([_on(p[me], dev) for p in per])
    for k, p in enumerate(per):
        _same(c, f"grouped_allgather tensor {k}", outs[k], torch.cat(p), dev)


def check_cuda_broadcast(c: Ctx) -> None:
    """broadcast (new tensor, input left alone), broadcast_ (in place) and broadcast_async from
    every root; broadcast_parameters makes every rank's CUDA model rank 0's."""
    hvd, dev, n, me = c.hvd, _dev(), c.size, c.rank
    for root, dtype in itertools.product(range(n), DTYPES):
        xs = [val(r, (5, 3), dtype, salt=root) for r in range(n)]
        mine, what = _on(xs[me], dev), f"root {root} {dtype}"
        _same(c, f"broadcast {what}", hvd.broadcast(mine, root), xs[root], dev)
        _same(c, f"broadcast {what} leaves its input", mine, xs[me], dev)
        out = hvd.broadcast_(mine, root)
        c.true(f"broadcast_ {what} returns its input", out is mine)
        _same(c, f"broadcast_ {what}", mine, xs[root], dev)
        got = hvd.synchronize(hvd.broadcast_async(_on(xs[me], dev), root))
        _same(c, f"broadcast_async {what}", got, xs[root], dev)

    def model(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 2))

    mine, root = model(100 + me).to(dev), model(100).state_dict()
    hvd.broadcast_parameters(mine.state_dict(), root_rank=0)
    for name, t in mine.state_dict().items():
        _same(c, f"broadcast_parameters {name}", t, root[name], dev)


def check_cuda_alltoall(c: Ctx) -> None:
    """alltoall with equal parts returns the output only; with splits (a list, an int32 tensor)
    also the rows received from each rank; alltoall_async."""
    hvd, dev, n, me = c.hvd, _dev(), c.size, c.rank
    for dtype in DTYPES:
        xs = [val(r, (2 * n, 3), dtype) for r in range(n)]
        _same(c, f"alltoall equal parts {dtype}", hvd.alltoall(_on(xs[me], dev)),
              torch.cat([x[2 * me:2 * me + 2] for x in xs]), dev)
    splits = [[(r + 2 * q) % 3 + (1 if r == q else 0) for q in range(n)] for r in range(n)]
    xs = [val(r, (sum(splits[r]), 2), torch.float32, salt=5) for r in range(n)]
    want = torch.cat([xs[s][sum(splits[s][:me]):sum(splits[s][:me + 1])] for s in range(n)])
    received_want = [splits[s][me] for s in range(n)]
    for kind, sp in (("list", splits[me]), ("int32 tensor", torch.tensor(splits[me], dtype=torch.int32))):
        out = hvd.alltoall(_on(xs[me], dev), sp)
        if not (isinstance(out, tuple) and len(out) == 2):
            c.fail(f"alltoall splits {kind}", f"expected (output, received), got {type(out).__name__}")
            continue
        _same(c, f"alltoall splits {kind}", out[0], want, dev)
        c.true(f"alltoall splits {kind} received", out[1].tolist() == received_want, f"got {out[1]}")
    out, received = hvd.synchronize(hvd.alltoall_async(_on(xs[me], dev), splits[me]))
    _same(c, "alltoall_async", out, want, dev)
    c.true("alltoall_async received", received.tolist() == received_want, f"got {received}")


def check_cuda_reducescatter(c: Ctx) -> None:
    """reducescatter of 2n+1 rows (the first ranks one row more), Sum and Average, every dtype;
    the default op (Average); reducescatter_async."""
    hvd, dev, n, me = c.hvd, _dev(), c.size, c.rank
    d0 = 2 * n + 1
    mine_rows = rows_of(d0, n, me)
    for op, dtype in itertools.product((hvd.Sum, hvd.Average), DTYPES):
        xs = op_inputs(c, op, (d0, 3), dtype)
        _same(c, f"reducescatter op {op} {dtype}", hvd.reducescatter(_on(xs[me], dev), op=op),
              reduce_ref(xs, op, hvd)[mine_rows], dev)
    xs = op_inputs(c, hvd.Average, (d0, 2), torch.float32, salt=2)
    want = reduce_ref(xs, hvd.Average, hvd)[mine_rows]
    _same(c, "reducescatter default op", hvd.reducescatter(_on(xs[me], dev)), want, dev)
    _same(c, "reducescatter_async", hvd.synchronize(hvd.reducescatter_async(_on(xs[me], dev))), want, dev)


def check_cuda_optimizer(c: Ctx) -> None:
    """DistributedOptimizer on a CUDA model, each rank on its slice of the batch: two SGD steps
    match single-process training on the whole batch (Average of the ranks' mean gradients)."""
    hvd, dev, n, me = c.hvd, _dev(), c.size, c.rank

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).to(dev)

    ref, model = make(), make()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        x = torch.randint(-3, 4, (4 * n, 8), generator=g).float().to(dev)
        y = torch.randint(-3, 4, (4 * n, 3), generator=g).float().to(dev)
        opt_ref.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        opt_ref.step()
        opt.zero_grad()
        nn.functional.mse_loss(model(x[me * 4:(me + 1) * 4]), y[me * 4:(me + 1) * 4]).backward()
        opt.step()
        for (name, a), b in zip(model.named_parameters(), ref.parameters()):
            if a.device != dev:
                c.fail(f"step {step}: {name}", f"on {a.device}, expected {dev}")
            elif not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
                c.fail(f"step {step}: {name}", f"differs from single-process training by "
                                               f"{(a - b).abs().max().item():.3g}")


CHECKS = [check_cuda_allreduce, check_cuda_allgather, check_cuda_broadcast, check_cuda_alltoall,
          check_cuda_reducescatter, check_cuda_optimizer]


def _hvd_job(rank: int, device_type: str) -> list[str]:
    global _device_type
    _device_type = device_type
    return run_checks(rank, CHECKS)


@pytest.mark.parametrize("world", [1, 2])
def test_horovod_on_cuda(world: int) -> None:
    assert_no_failures(spawn(world, _hvd_job, "cuda", timeout=180))
