"""Every torch.distributed op on the "torchring" backend against references built in the test.

One spawned world per case runs all the checks of :func:`_all_checks` (worlds 2 and 3; the env://
and file:// init methods) and returns its mismatches. Each rank builds every rank's input with
``_checks.rank_input`` (small integers, exact in every dtype), so it computes its expected output
locally with plain torch ops.
"""

from __future__ import annotations

import os

import pytest
import torch

from _c10d import finish, init_pg
from _checks import (DTYPES, FLOAT_DTYPES, Checker, assert_no_failures, expected_allreduce, rank_input,
                     reference, valid_ops)
from _dist import hybrid_env, spawn


def _op(name: str, factor: float | None = None):
    import torch.distributed as dist

    if name == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(factor)
    return getattr(dist.ReduceOp, name)


def _check_all_reduce(chk: Checker, rank: int, world: int) -> None:
    import torch.distributed as dist

    for dtype in DTYPES:
        for op in valid_ops(dtype):
            for numel, shape in [(13, (13,)), (12, (3, 4)), (1, ()), (0, (0,))]:
                t = rank_input(rank, world, numel, dtype, op, shape)
                dist.all_reduce(t, op=_op(op))
                chk.equal(f"all_reduce({dtype}{list(shape)}, {op})", t,
                          expected_allreduce(world, numel, dtype, op, shape))
    big = 2**18 + 3
    t = rank_input(rank, world, big, torch.float32)
    dist.all_reduce(t)
    chk.equal(f"all_reduce(float32[{big}])", t, expected_allreduce(world, big, torch.float32, "SUM"))
    # A non-contiguous tensor (a transposed view) is reduced in place.
    base = rank_input(rank, world, 24, torch.int64, "SUM", (4, 6))
    view = base.t()
    dist.all_reduce(view, op=dist.ReduceOp.MAX)
    chk.equal("all_reduce of a transposed view, MAX", base,
              expected_allreduce(world, 24, torch.int64, "MAX", (4, 6)))
    # PREMUL_SUM: each rank's input times the factor, then summed (a float factor, a tensor factor).
    for dtype in FLOAT_DTYPES:
        for factor in (0.5, torch.tensor(0.25, dtype=torch.float64)):
            t = rank_input(rank, world, 10, dtype)
            dist.all_reduce(t, op=_op("PREMUL_SUM", factor))
            want = (expected_allreduce(world, 10, torch.float64, "SUM") * float(factor)).to(dtype)
            chk.equal(f"all_reduce({dtype}, PREMUL_SUM({float(factor)}))", t, want)
    # all_reduce_coalesced: several tensors, one call.
    ts = [rank_input(rank, world, n, torch.float32, shape=s) for n, s in [(5, (5,)), (6, (2, 3))]]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_reduce_coalesced(ts)
    for t, (n, s) in zip(ts, [(5, (5,)), (6, (2, 3))]):
        chk.equal(f"all_reduce_coalesced float32{list(s)}", t, expected_allreduce(world, n, torch.float32, "SUM", s))


def _check_broadcast_reduce(chk: Checker, rank: int, world: int) -> None:
    import torch.distributed as dist

    for src in range(world):
        for dtype, shape in [(torch.float32, (7,)), (torch.int64, (2, 3)), (torch.bfloat16, ()),
                             (torch.uint8, (0,)), (torch.float16, (33,))]:
            numel = int(torch.tensor(shape).prod()) if shape else 1
            t = rank_input(rank, world, numel, dtype, shape=shape)
            dist.broadcast(t, src=src)
            chk.equal(f"broadcast({dtype}{list(shape)}, src={src})", t,
                      rank_input(src, world, numel, dtype, shape=shape))
        base = rank_input(rank, world, 12, torch.int32, shape=(3, 4))
        dist.broadcast(base[:, 1], src=src)
        want = base.clone()
        want[:, 1] = rank_input(src, world, 12, torch.int32, shape=(3, 4))[:, 1]
        chk.equal(f"broadcast of a column view, src={src}", base, want)
        for op in ["SUM", "MIN", "MAX", "PRODUCT"]:
            t = rank_input(rank, world, 9, torch.float32, op)
            dist.reduce(t, dst=src, op=_op(op))
            if rank == src:
                chk.equal(f"reduce(float32, {op}, dst={src})", t, expected_allreduce(world, 9, torch.float32, op))
        t = rank_input(rank, world, 9, torch.int64)
        dist.reduce(t, dst=src)
        if rank == src:
            chk.equal(f"reduce(int64, SUM, dst={src})", t, expected_allreduce(world, 9, torch.int64, "SUM"))


def _check_gathers(chk: Checker, rank: int, world: int) -> None:
    import torch.distributed as dist

    for dtype in [torch.float32, torch.int64, torch.bfloat16, torch.int8]:
        shape = (2, 3)
        mine = rank_input(rank, world, 6, dtype, shape=shape)
        everyone = [rank_input(r, world, 6, dtype, shape=shape) for r in range(world)]
        out = [torch.full(shape, -1).to(dtype) for _ in range(world)]
        dist.all_gather(out, mine)
        for r in range(world):
            chk.equal(f"all_gather({dtype}) row of rank {r}", out[r], everyone[r])
        flat = torch.zeros(world * 6, dtype=dtype)
        dist.all_gather_into_tensor(flat, mine)
        chk.equal(f"all_gather_into_tensor({dtype}) flat", flat, torch.cat([e.flatten() for e in everyone]))
        stacked = torch.zeros(world, *shape, dtype=dtype)
        dist.all_gather_into_tensor(stacked, mine)
        chk.equal(f"all_gather_into_tensor({dtype}) stacked", stacked, torch.stack(everyone))
    # Outputs that are column views of one buffer (not contiguous).
    buf = torch.zeros(4, world, dtype=torch.int32)
    dist.all_gather(list(buf.unbind(1)), rank_input(rank, world, 4, torch.int32))
    chk.equal("all_gather into column views", buf,
              torch.stack([rank_input(r, world, 4, torch.int32) for r in range(world)], 1))
    for dst in range(world):
        mine = rank_input(rank, world, 5, torch.float64)
        out = [torch.zeros(5, dtype=torch.float64) for _ in range(world)] if rank == dst else None
        dist.gather(mine, out, dst=dst)
        if rank == dst:
            for r in range(world):
                chk.equal(f"gather(dst={dst}) row of rank {r}", out[r], rank_input(r, world, 5, torch.float64))
    for src in range(world):
        chunks = [rank_input(src * world + r, world, 4, torch.int64, shape=(2, 2)) for r in range(world)]
        out = torch.zeros(2, 2, dtype=torch.int64)
        dist.scatter(out, chunks if rank == src else None, src=src)
        chk.equal(f"scatter(src={src})", out, chunks[rank])


def _check_reduce_scatter(chk: Checker, rank: int, world: int) -> None:
    import torch.distributed as dist

    n = 6
    for dtype in [torch.float32, torch.bfloat16, torch.float64, torch.int32]:
        ops = [op for op in valid_ops(dtype)] + (["PREMUL_SUM"] if dtype.is_floating_point else [])
        for op in ops:
            what_op = "SUM" if op == "PREMUL_SUM" else op
            inputs = [rank_input(rank, world, world * n, dtype, what_op).view(world, n) for rank in range(world)]
            factor = 0.5
            full = reference(inputs, what_op)
            if op == "PREMUL_SUM":
                full = (reference([x.double() for x in inputs], "SUM") * factor).to(dtype)
            want = full[rank]
            mine = inputs[rank]
            out = torch.zeros(n, dtype=dtype)
            dist.reduce_scatter(out, list(mine.clone().unbind(0)), op=_op(op, factor))
            chk.equal(f"reduce_scatter({dtype}, {op})", out, want)
            out = torch.zeros(n, dtype=dtype)
            dist.reduce_scatter_tensor(out, mine.clone().flatten(), op=_op(op, factor))
            chk.equal(f"reduce_scatter_tensor({dtype}, {op})", out, want)
    # The stacked input form and a non-contiguous output.
    inputs = [rank_input(r, world, world * 8, torch.float32).view(world, 2, 4) for r in range(world)]
    out = torch.zeros(4, 2).t()
    dist.reduce_scatter_tensor(out, inputs[rank].clone())
    chk.equal("reduce_scatter_tensor into a transposed view", out, reference(inputs, "SUM")[rank])


def _check_coalesced(chk: Checker, rank: int, world: int) -> None:
    """Ops batched by torch's coalescing manager (as FSDP1 and DTensor issue them)."""
    import warnings

    import torch.distributed as dist

    ins = [rank_input(rank, world, 2, torch.float32), rank_input(rank, world, 3, torch.int64)]
    outs = [torch.zeros(world * 2), torch.zeros(world * 3, dtype=torch.int64)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, i in zip(outs, ins):
            dist.all_gather_into_tensor(o, i)
    cm.wait()
    for o, (n, dtype) in zip(outs, [(2, torch.float32), (3, torch.int64)]):
        chk.equal(f"coalesced all_gather_into_tensor({dtype})", o,
                  torch.cat([rank_input(r, world, n, dtype) for r in range(world)]))
    full = [[rank_input(r, world, world * n, torch.float32) for r in range(world)] for n in (2, 3)]
    outs = [torch.zeros(2), torch.zeros(3)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, per_rank in zip(outs, full):
            dist.reduce_scatter_tensor(o, per_rank[rank].clone())
    cm.wait()
    for o, per_rank, n in zip(outs, full, (2, 3)):
        chk.equal(f"coalesced reduce_scatter_tensor[{n}]", o, reference(per_rank, "SUM")[rank * n:(rank + 1) * n])
    ts = [rank_input(rank, world, n, torch.int32) for n in (2, 5)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t)
    cm.wait()
    for t, n in zip(ts, (2, 5)):
        chk.equal(f"coalesced all_reduce[{n}]", t, expected_allreduce(world, n, torch.int32, "SUM"))
    # The deprecated all_gather_coalesced: right, or refused by name.
    outs = [[torch.zeros(2), torch.zeros(1)] for _ in range(world)]  # torch's layout: [rank][input]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            dist.all_gather_coalesced(outs, [rank_input(rank, world, 2, torch.float32),
                                             rank_input(rank, world, 1, torch.float32)])
        for r in range(world):
            chk.equal(f"all_gather_coalesced input 0 of rank {r}", outs[r][0], rank_input(r, world, 2, torch.float32))
            chk.equal(f"all_gather_coalesced input 1 of rank {r}", outs[r][1], rank_input(r, world, 1, torch.float32))
    except RuntimeError as e:
        chk.true("all_gather_coalesced refused by name", "allgather_coalesced" in str(e), f"says {e}")


def _check_all_to_all(chk: Checker, rank: int, world: int) -> None:
    import torch.distributed as dist

    # Equal blocks: rank r's input rows [k*2, k*2+2) go to rank k.
    ins = [rank_input(r, world, world * 2 * 3, torch.int64, shape=(world * 2, 3)) for r in range(world)]
    out = torch.zeros(world * 2, 3, dtype=torch.int64)
    dist.all_to_all_single(out, ins[rank])
    chk.equal("all_to_all_single, equal blocks", out, torch.cat([ins[r][rank * 2:rank * 2 + 2] for r in range(world)]))

    # Uneven splits: rank r sends (r + k) % 3 rows to rank k (some are empty).
    def rows(src: int, dst: int) -> int:
        return (src + dst) % 3

    def inp(src: int) -> torch.Tensor:
        n = sum(rows(src, k) for k in range(world))
        return rank_input(src, world, n * 2, torch.float32, shape=(n, 2))

    send = [rows(rank, k) for k in range(world)]
    recv = [rows(k, rank) for k in range(world)]
    out = torch.full((sum(recv), 2), -1.0)
    dist.all_to_all_single(out, inp(rank), output_split_sizes=recv, input_split_sizes=send)
    want = []
    for src in range(world):
        start = sum(rows(src, k) for k in range(rank))
        want.append(inp(src)[start:start + rows(src, rank)])
    chk.equal("all_to_all_single with splits", out, torch.cat(want))

    # List form: tensor i of rank r goes to rank i, sizes differ per pair.
    def piece(src: int, dst: int) -> torch.Tensor:
        return rank_input(src * world + dst, world, 1 + src + 2 * dst, torch.int32)

    outs = [torch.zeros(1 + k + 2 * rank, dtype=torch.int32) for k in range(world)]
    dist.all_to_all(outs, [piece(rank, k) for k in range(world)])
    for k in range(world):
        chk.equal(f"all_to_all piece from rank {k}", outs[k], piece(k, rank))


def _check_p2p(chk: Checker, rank: int, world: int) -> None:
    import torch.distributed as dist

    right, left = (rank + 1) % world, (rank - 1) % world
    got = torch.zeros(3, 4)
    reqs = [dist.isend(rank_input(rank, world, 12, torch.float32, shape=(3, 4)), right),
            dist.irecv(got, left)]
    for r in reqs:
        r.wait()
    chk.equal("isend/irecv around the ring", got, rank_input(left, world, 12, torch.float32, shape=(3, 4)))
    # Blocking send/recv between rank 0 and every other rank, both ways, with tags.
    for peer in range(1, world):
        if rank == 0:
            dist.send(rank_input(peer, world, 5, torch.int64), peer, tag=peer)
            back = torch.zeros(5, dtype=torch.int64)
            dist.recv(back, peer, tag=100 + peer)
            chk.equal(f"recv from rank {peer}", back, rank_input(peer, world, 5, torch.int64) * 2)
        elif rank == peer:
            t = torch.zeros(5, dtype=torch.int64)
            dist.recv(t, 0, tag=peer)
            chk.equal("recv from rank 0", t, rank_input(peer, world, 5, torch.int64))
            dist.send(t * 2, 0, tag=100 + peer)
    # batch_isend_irecv: the ring the other way.
    got = torch.zeros(6, dtype=torch.int32)
    ops = [dist.P2POp(dist.isend, rank_input(rank, world, 6, torch.int32), left),
           dist.P2POp(dist.irecv, got, right)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    chk.equal("batch_isend_irecv", got, rank_input(right, world, 6, torch.int32))
    # recv from any source: dist.recv returns the sender, irecv's Work names it (_source_rank()),
    # and each sender's messages come in the order sent.
    if rank == 0:
        seen: dict[int, list[int]] = {}
        for i in range(2 * (world - 1)):
            t = torch.zeros(4, dtype=torch.int64)
            if i % 2 == 0:
                src = dist.recv(t, tag=77)
            else:
                work = dist.irecv(t, tag=77)
                work.wait()
                src = work._source_rank()
            chk.true(f"recv(src=None) #{i}: sender", 0 < src < world and int(t[0]) // 10 == src, f"{src}, {t}")
            seen.setdefault(src, []).append(int(t[0]) % 10)
        chk.true("recv(src=None): every message once, in order per sender",
                 seen == {r: [0, 1] for r in range(1, world)}, f"{seen}")
    else:
        for n in range(2):
            dist.send(torch.full((4,), 10 * rank + n, dtype=torch.int64), 0, tag=77)
    dist.barrier()


def _check_async(chk: Checker, rank: int, world: int) -> None:
    import torch.distributed as dist

    t = rank_input(rank, world, 8, torch.float32)
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    chained = fut.then(lambda f: f.value()[0] * 2)
    chk.true("Work.wait()", work.wait() is True, "did not return True")
    chk.true("Work.is_completed() after wait", work.is_completed())
    want = expected_allreduce(world, 8, torch.float32, "SUM")
    chk.equal("all_reduce(async_op=True) result", t, want)
    value = fut.wait()
    chk.true("all_reduce future value", isinstance(value, list) and len(value) == 1, f"got {value!r}")
    if isinstance(value, list) and value:
        chk.equal("all_reduce future wait()[0]", value[0], want)
        chk.equal("all_reduce future value()[0]", fut.value()[0], want)
    chk.equal("fut.then(...) chained value", chained.wait(), want * 2)
    outs = [torch.zeros(3, dtype=torch.int64) for _ in range(world)]
    work = dist.all_gather(outs, rank_input(rank, world, 3, torch.int64), async_op=True)
    work.wait()
    value = work.get_future().value()
    flat = value[0] if value and isinstance(value[0], list) else value
    chk.true("all_gather future value", len(flat) == world and all(
        torch.equal(flat[r], rank_input(r, world, 3, torch.int64)) for r in range(world)), f"got {value!r}")
    # Many in flight at once, waited in reverse order.
    ts = [rank_input(rank + i, world, 4, torch.int32) for i in range(16)]
    works = [dist.all_reduce(x, async_op=True) for x in ts]
    for w in reversed(works):
        w.wait()
    for i, x in enumerate(ts):
        want = reference([rank_input(r + i, world, 4, torch.int32) for r in range(world)], "SUM")
        chk.equal(f"async all_reduce #{i} of 16 in flight", x, want)
    work = dist.barrier(async_op=True)
    work.wait()
    chk.true("barrier(async_op=True).is_completed()", work.is_completed())


def _check_groups(chk: Checker, rank: int, world: int) -> None:
    import torch.distributed as dist

    ends = [0, world - 1]
    tail = list(range(1, world))
    g_ends = dist.new_group(ends)
    g_tail = dist.new_group(tail)
    g_all = dist.new_group(list(range(world)))
    if rank in ends:
        t = rank_input(rank, world, 6, torch.float32)
        dist.all_reduce(t, group=g_ends)
        want = reference([rank_input(r, world, 6, torch.float32) for r in ends], "SUM")
        chk.equal(f"all_reduce in group {ends}", t, want)
        objs = [None] * len(ends)
        dist.all_gather_object(objs, {"rank": rank}, group=g_ends)
        chk.true(f"all_gather_object in group {ends}", objs == [{"rank": r} for r in ends], f"got {objs}")
    if rank in tail:
        t = rank_input(rank, world, 4, torch.int64)
        dist.broadcast(t, group_src=len(tail) - 1, group=g_tail)
        chk.equal(f"broadcast in group {tail} from its last rank", t, rank_input(tail[-1], world, 4, torch.int64))
        chk.true("get_rank(group)", dist.get_rank(g_tail) == tail.index(rank))
    t = rank_input(rank, world, 5, torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=g_all)
    chk.equal("all_reduce MIN in a new group of every rank", t, expected_allreduce(world, 5, torch.int32, "MIN"))
    # new_subgroups_by_enumeration: evens and odds (world 2: two groups of one rank).
    sub, _ = dist.new_subgroups_by_enumeration([list(range(0, world, 2)), list(range(1, world, 2))])
    members = list(range(rank % 2, world, 2))
    t = rank_input(rank, world, 3, torch.float64)
    dist.all_reduce(t, group=sub)
    want = reference([rank_input(r, world, 3, torch.float64) for r in members], "SUM")
    chk.equal(f"all_reduce in subgroup {members}", t, want)
    # The default group still works after the sub-groups' traffic.
    t = rank_input(rank, world, 3, torch.int64)
    dist.all_reduce(t)
    chk.equal("all_reduce on the default group after sub-groups", t, expected_allreduce(world, 3, torch.int64, "SUM"))


def _check_objects(chk: Checker, rank: int, world: int) -> None:
    import torch.distributed as dist

    def obj(r: int) -> object:
        return {"rank": r, "text": "x" * (r * 37), "t": torch.arange(r + 1), "nested": [r, (r, str(r))]}

    def same(a: object, b: object) -> bool:
        return a["rank"] == b["rank"] and a["text"] == b["text"] and torch.equal(a["t"], b["t"]) and \
            a["nested"] == b["nested"]

    out = [None] * world
    dist.all_gather_object(out, obj(rank))
    chk.true("all_gather_object", all(same(out[r], obj(r)) for r in range(world)), f"got {out}")
    for src in range(world):
        lst = [obj(src), "tail"] if rank == src else [None, None]
        dist.broadcast_object_list(lst, src=src)
        chk.true(f"broadcast_object_list(src={src})", same(lst[0], obj(src)) and lst[1] == "tail", f"got {lst}")
        gathered = [None] * world if rank == src else None
        dist.gather_object(obj(rank), gathered, dst=src)
        if rank == src:
            chk.true(f"gather_object(dst={src})", all(same(gathered[r], obj(r)) for r in range(world)),
                     f"got {gathered}")
        got = [None]
        dist.scatter_object_list(got, [obj(10 * src + r) for r in range(world)] if rank == src else None, src=src)
        chk.true(f"scatter_object_list(src={src})", same(got[0], obj(10 * src + rank)), f"got {got}")
    if rank == 0:
        dist.send_object_list([obj(5), {"k": 1}], dst=world - 1)
    elif rank == world - 1:
        got = [None, None]
        dist.recv_object_list(got, src=0)
        chk.true("send_object_list/recv_object_list", same(got[0], obj(5)) and got[1] == {"k": 1}, f"got {got}")


def _check_checkpoint(chk: Checker, rank: int, world: int, path: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))
    with torch.no_grad():
        for i, t in enumerate(model.state_dict().values()):
            t.copy_(torch.arange(t.numel()).view(t.shape) + i)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    dist.barrier()
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state["model"])
    for k, v in fresh.state_dict().items():
        chk.equal(f"dcp.load of {k}", v, saved[k])
    chk.true("dcp wrote its metadata", os.path.exists(os.path.join(path, ".metadata")))


def _all_checks(rank: int, world: int, init_method: str | None, ckpt: str) -> list[str]:
    import torch.distributed as dist

    init_pg(init_method=init_method)
    chk = Checker(rank)
    try:
        chk.true("get_backend()", dist.get_backend() == "torchring", f"got {dist.get_backend()!r}")
        chk.true("(get_rank, get_world_size)", (dist.get_rank(), dist.get_world_size()) == (rank, world))
        for check in (_check_all_reduce, _check_broadcast_reduce, _check_gathers, _check_reduce_scatter,
                      _check_coalesced, _check_all_to_all, _check_p2p, _check_async, _check_groups, _check_objects):
            check(chk, rank, world)
            dist.barrier()
        _check_checkpoint(chk, rank, world, ckpt)
    finally:
        finish()
    return chk.failures


@pytest.mark.parametrize("world,init,hosts", [(2, "env", None), (3, "env", None), (2, "file", None),
                                              (3, "file", None), (3, "env", ["a", "a", "b"])])
def test_every_op(world: int, init: str, hosts: list[str] | None, tmp_path) -> None:
    """Every op, reduce op and dtype at worlds 2 and 3, the group made through env:// or file://
    (and once over two fake hosts: shared memory within one, TCP between them)."""
    method = "env://" if init == "env" else f"file://{tmp_path / 'rendezvous'}"
    assert_no_failures(spawn(world, _all_checks, world, method, str(tmp_path / "ckpt"), timeout=120,
                             rank_env=hybrid_env(hosts) if hosts else None))


def _avg_on_integers(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    init_pg()
    chk = Checker(rank)

    def inp(r: int) -> torch.Tensor:  # rank r's input: 2 elements per rank
        return rank_input(r, world, 2 * world, torch.int32, "AVG") + 40

    def mean(rows: list[torch.Tensor]) -> torch.Tensor:
        return torch.div(sum(rows), world, rounding_mode="trunc").to(torch.int32)

    try:
        mine = slice(2 * rank, 2 * rank + 2)
        avg = dist.ReduceOp.AVG
        everyone = mean([inp(r) for r in range(world)])
        cases = [("all_reduce", lambda t: dist.all_reduce(t, op=avg), everyone),
                 ("reduce", lambda t: dist.reduce(t, dst=0, op=avg), everyone if rank == 0 else None),
                 ("reduce_scatter_tensor", lambda t: dist.reduce_scatter_tensor(t[mine], t.clone(), op=avg), None)]
        for name, call, want in cases:
            t = inp(rank)
            try:
                call(t)
            except Exception as e:  # noqa: BLE001 - refusing is fine if it says why
                chk.true(f"{name}(int32, AVG) refused by name", "AVG" in str(e), f"says {e}")
                continue
            if name == "reduce_scatter_tensor":
                t, want = t[mine], mean([inp(r)[mine] for r in range(world)])
            if want is not None:
                chk.equal(f"{name}(int32, AVG): the truncated mean, or an error", t, want)
    finally:
        finish()
    return chk.failures


def test_avg_on_integers_is_refused_or_right() -> None:
    """AVG of int32 tensors: never the sum (a silently wrong result)."""
    assert_no_failures(spawn(2, _avg_on_integers, 2, timeout=60))
