"""torchring as a torch.distributed backend on CUDA tensors, alone and beside NCCL.

``backend="cpu:torchring,cuda:torchring"`` gives both devices to one torchring backend, which
stages CUDA tensors through host copies: all_reduce (every dtype and op), broadcast,
all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single, blocking and with
``async_op=True``, must be exact on the GPU, at world 1 and with two ranks sharing the GPU, and
CPU tensors on the same group too. ``backend="cpu:torchring,cuda:nccl"`` (world 1: NCCL refuses
two ranks on one GPU) must hand CUDA tensors to NCCL and CPU tensors to torchring, both exact,
an NCCL op in flight while torchring runs a CPU one. Each group is made on a fresh file:// store.
References are single-process torch ops on every rank's integer-valued input.
"""

from __future__ import annotations

import pytest
import torch

from _c10d import finish, init_pg
from _checks import Checker, assert_no_failures, expected_allreduce, rank_input, reference, valid_ops
from _device_collectives import GPU_DTYPES, a2a_expected, a2a_input, a2a_rows, inp, late_inp, same
from _dist import spawn

CPU = torch.device("cpu")
NCCL_LACKS = ("BAND", "BOR", "BXOR")


def _backend_names(chk: Checker, want: dict[str, str]) -> None:
    """The default group's backend for each device type is the one `want` names."""
    import torch.distributed as dist

    pg = dist.distributed_c10d._get_default_group()
    for device, name in want.items():
        try:
            got = pg._get_backend(torch.device(device)).name()
        except Exception as e:  # noqa: BLE001 - reported
            got = f"{type(e).__name__}: {e}"
        chk.true(f"the {device} backend", got == name, f"is {got!r}, expected {name!r}")


def _dist_op(name: str):
    import torch.distributed as dist

    return getattr(dist.ReduceOp, name)


def _check_ops(chk: Checker, rank: int, world: int, dev: torch.device, label: str) -> None:
    """The five collectives of the issue on `dev`, blocking then async_op=True."""
    import torch.distributed as dist

    for dtype in GPU_DTYPES:
        for op in valid_ops(dtype):
            if label == "cuda:nccl" and op in NCCL_LACKS:
                continue  # torch's NCCL group raises ValueError for these (no bitwise ops in NCCL)
            t = late_inp(rank, world, 500, dtype, dev, op)
            dist.all_reduce(t, op=_dist_op(op))
            same(chk, f"{label}: all_reduce({dtype}, {op})", t, expected_allreduce(world, 500, dtype, op), dev,
                 op != "AVG")
    for src in range(world):
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            t = late_inp(rank, world, 300, dtype, dev, shape=(3, 100))
            dist.broadcast(t, src=src)
            same(chk, f"{label}: broadcast({dtype}, src={src})", t,
                 rank_input(src, world, 300, dtype, shape=(3, 100)), dev)
    for dtype in (torch.float32, torch.float16, torch.int32):
        everyone = [rank_input(r, world, 6, dtype, shape=(2, 3)) for r in range(world)]
        flat = torch.full((world * 6,), -1, dtype=dtype, device=dev)
        dist.all_gather_into_tensor(flat, late_inp(rank, world, 6, dtype, dev, shape=(2, 3)))
        same(chk, f"{label}: all_gather_into_tensor({dtype}) flat", flat,
             torch.cat([e.flatten() for e in everyone]), dev)
        stacked = torch.zeros((world, 2, 3), dtype=dtype, device=dev)
        dist.all_gather_into_tensor(stacked, everyone[rank].to(dev))
        same(chk, f"{label}: all_gather_into_tensor({dtype}) stacked", stacked, torch.stack(everyone), dev)
    n = 5
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for op in ("SUM", "MAX"):
            inputs = [rank_input(r, world, world * n, dtype, op) for r in range(world)]
            out = torch.zeros(n, dtype=dtype, device=dev)
            dist.reduce_scatter_tensor(out, late_inp(rank, world, world * n, dtype, dev, op), op=_dist_op(op))
            same(chk, f"{label}: reduce_scatter_tensor({dtype}, {op})", out,
                 reference(inputs, op)[rank * n:(rank + 1) * n], dev)
    ins = [rank_input(r, world, world * 2 * 3, torch.int64, shape=(world * 2, 3)) for r in range(world)]
    out = torch.zeros((world * 2, 3), dtype=torch.int64, device=dev)
    dist.all_to_all_single(out, late_inp(rank, world, world * 6, torch.int64, dev, shape=(world * 2, 3)))
    same(chk, f"{label}: all_to_all_single equal blocks", out,
         torch.cat([ins[r][rank * 2:rank * 2 + 2] for r in range(world)]), dev)
    send = [a2a_rows(rank, k) for k in range(world)]
    recv = [a2a_rows(k, rank) for k in range(world)]
    out = torch.full((sum(recv), 2), -1.0, device=dev)
    dist.all_to_all_single(out, a2a_input(rank, world, torch.float32).to(dev), output_split_sizes=recv,
                           input_split_sizes=send)
    same(chk, f"{label}: all_to_all_single with splits", out, a2a_expected(rank, world, torch.float32), dev)
    _check_async(chk, rank, world, dev, label)


def _check_async(chk: Checker, rank: int, world: int, dev: torch.device, label: str) -> None:
    """async_op=True forms of the five, in flight together, waited for in reverse order; the
    all_reduce's future holds the reduced tensor."""
    import torch.distributed as dist

    a = inp(rank, world, 64, torch.float32, dev)
    b = inp(rank, world, 10, torch.int32, dev)
    gathered = torch.zeros(world * 4, dtype=torch.bfloat16, device=dev)
    scattered = torch.zeros(3, dtype=torch.float16, device=dev)
    swapped = torch.zeros(world * 2, dtype=torch.int64, device=dev)
    works = [dist.all_reduce(a, async_op=True),
             dist.broadcast(b, src=world - 1, async_op=True),
             dist.all_gather_into_tensor(gathered, inp(rank, world, 4, torch.bfloat16, dev), async_op=True),
             dist.reduce_scatter_tensor(scattered, inp(rank, world, world * 3, torch.float16, dev), async_op=True),
             dist.all_to_all_single(swapped, inp(rank, world, world * 2, torch.int64, dev), async_op=True)]
    future = works[0].get_future()
    for w in reversed(works):
        w.wait()
    want = expected_allreduce(world, 64, torch.float32, "SUM")
    same(chk, f"{label}: all_reduce(async_op=True)", a, want, dev)
    value = future.wait()
    if isinstance(value, list) and value:
        same(chk, f"{label}: all_reduce future value", value[0], want, dev)
    else:
        chk.fail(f"{label}: all_reduce future value", f"expected a list of one tensor, got {value!r}"[:200])
    same(chk, f"{label}: broadcast(async_op=True)", b, rank_input(world - 1, world, 10, torch.int32), dev)
    same(chk, f"{label}: all_gather_into_tensor(async_op=True)", gathered,
         torch.cat([rank_input(r, world, 4, torch.bfloat16) for r in range(world)]), dev)
    same(chk, f"{label}: reduce_scatter_tensor(async_op=True)", scattered,
         expected_allreduce(world, world * 3, torch.float16, "SUM")[rank * 3:(rank + 1) * 3], dev)
    same(chk, f"{label}: all_to_all_single(async_op=True)", swapped,
         torch.cat([rank_input(r, world, world * 2, torch.int64)[rank * 2:rank * 2 + 2] for r in range(world)]), dev)


def _c10d_job(rank: int, world: int, device: str, store: str, with_nccl: bool) -> list[str]:
    """The torchring-only group, then (with_nccl) the torchring + NCCL group, in one process."""
    import torch.distributed as dist

    chk = Checker(rank)
    dev = torch.device(device, 0) if device == "cuda" else CPU
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    init_pg("cpu:torchring,cuda:torchring", init_method=f"file://{store}.0")
    try:
        _backend_names(chk, {"cpu": "torchring", "cuda": "torchring"})
        _check_ops(chk, rank, world, dev, "cuda:torchring")
        if dev.type == "cuda":
            _check_ops(chk, rank, world, CPU, "cpu:torchring beside cuda:torchring")
        dist.barrier()
    finally:
        finish()
    if not with_nccl:
        return chk.failures
    init_pg("cpu:torchring,cuda:nccl", init_method=f"file://{store}.1")
    try:
        _backend_names(chk, {"cpu": "torchring", "cuda": "nccl"})
        _check_ops(chk, rank, world, dev, "cuda:nccl")
        _check_ops(chk, rank, world, CPU, "cpu:torchring beside cuda:nccl")
        # An NCCL all_reduce in flight while torchring reduces a CPU tensor, and the other way.
        g = late_inp(rank, world, 4096, torch.float32, dev)
        on_gpu = dist.all_reduce(g, async_op=True)
        c = inp(rank, world, 4096, torch.int64, CPU)
        dist.all_reduce(c)
        d = inp(rank, world, 8, torch.float32, CPU)
        on_cpu = dist.all_reduce(d, async_op=True)
        h = inp(rank, world, 8, torch.bfloat16, dev)
        dist.all_reduce(h, op=_dist_op("MAX"))
        on_gpu.wait()
        on_cpu.wait()
        for what, got, n, dtype, op, where in [
                ("NCCL all_reduce beside a torchring one", g, 4096, torch.float32, "SUM", dev),
                ("torchring all_reduce beside an NCCL one", c, 4096, torch.int64, "SUM", CPU),
                ("NCCL all_reduce MAX after a torchring async", h, 8, torch.bfloat16, "MAX", dev),
                ("torchring async all_reduce across an NCCL one", d, 8, torch.float32, "SUM", CPU)]:
            same(chk, what, got, expected_allreduce(world, n, dtype, op), where)
    finally:
        finish()
    return chk.failures


@pytest.mark.parametrize("world", [1, 2])
def test_c10d_backend_on_cuda(world: int, tmp_path) -> None:
    """cuda:torchring at worlds 1 and 2; at world 1 also cuda:nccl beside cpu:torchring."""
    assert_no_failures(spawn(world, _c10d_job, world, "cuda", str(tmp_path / "store"), world == 1,
                             timeout=180))
