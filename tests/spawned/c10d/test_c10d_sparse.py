"""Sparse COO tensors on the "torchring" backend, against gloo in the same processes.

``dist.all_reduce`` of a sparse tensor (every dtype gloo takes, and float16, which gloo cannot
add at world 3; dense dims; a different number
of non-zeros per rank, none on one rank; duplicate indices in an uncoalesced input) gives
gloo's result: the same coalesced indices and the same summed values, bitwise, written into the
tensor in place and completing the Future. Tensors of different sizes fail every rank, naming
the rank; ops other than SUM are refused by name. DDP with ``nn.Embedding(sparse=True)`` and
``nn.EmbeddingBag(sparse=True)`` trains to gloo's parameters, and so does torchring.wrap;
torchring.allreduce does the same sum outside torch.distributed.
"""

from __future__ import annotations

import copy

import pytest
import torch

from _c10d import compare, finish, init_pg, moved, state_of
from _checks import Checker, assert_no_failures
from _dist import spawn

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int8,
          torch.uint8]


def _sparse(rank: int, world: int, dtype: torch.dtype, dense: tuple[int, ...] = ()) -> torch.Tensor:
    """Rank `rank`'s uncoalesced COO tensor of size [13, 4, *dense]: 3 * rank entries (none on
    rank 0), some indices repeated on the rank and shared with the others; small integer values."""
    g = torch.Generator().manual_seed(rank * 31 + len(dense))
    nnz = 3 * rank
    idx = torch.stack([torch.randint(0, 13, (nnz,), generator=g), torch.randint(0, 4, (nnz,), generator=g)])
    if nnz >= 2:
        idx[:, 1] = idx[:, 0]  # a duplicate within the rank
    vals = torch.randint(1, 5, (nnz, *dense), generator=g).to(dtype)
    return torch.sparse_coo_tensor(idx, vals, (13, 4, *dense))


def _all_reduce_job(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    init_pg()
    chk = Checker(rank)
    try:
        gloo = dist.new_group(backend="gloo")
        for dtype in DTYPES:
            for dense in ((), (3,)):
                what = f"all_reduce(sparse {dtype}, dense dims {list(dense)})"
                ours, theirs = _sparse(rank, world, dtype, dense), _sparse(rank, world, dtype, dense)
                work = dist.all_reduce(ours, async_op=True)
                work.wait()
                chk.true(f"{what}: coalesced", ours.is_coalesced(), "the result is not coalesced")
                # gloo adds float16 sparse tensors with an op torch lacks ("cadd_sparse" not
                # implemented for 'Half') once three ranks hold entries; torchring sums them.
                if dtype != torch.float16 or world == 2:
                    dist.all_reduce(theirs, group=gloo)
                    theirs = theirs.coalesce()
                    chk.equal(f"{what}: indices", ours.indices(), theirs.indices())
                    chk.equal(f"{what}: values", ours.values(), theirs.values())
                want = sum(_sparse(r, world, dtype, dense).to_dense() for r in range(world))
                chk.equal(f"{what}: the dense sum", ours.to_dense(), want.to(dtype))
                value = work.get_future().value()[0]
                chk.true(f"{what}: the Future holds the tensor", value is ours or torch.equal(value.to_dense(),
                                                                                            want.to(dtype)))
        # Sizes that differ between ranks fail every rank, naming the other rank's sizes.
        odd = torch.sparse_coo_tensor(torch.zeros(2, 1, dtype=torch.int64), torch.ones(1), (13 + (rank == 1), 4))
        try:
            dist.all_reduce(odd)
            chk.fail("all_reduce of sparse tensors of different sizes", "did not raise")
        except Exception as e:  # noqa: BLE001 - the words are what is checked
            other = 0 if rank == 1 else 1  # the first rank whose sizes differ from this rank's
            chk.true("different sizes: the message", f"rank {other}'s sparse tensor is [" in str(e)
                     and "of the same sizes" in str(e), str(e))
        try:
            dist.all_reduce(_sparse(rank, world, torch.float32), op=dist.ReduceOp.MAX)
            chk.fail("all_reduce(sparse, MAX)", "did not raise")
        except ValueError as e:
            chk.true("all_reduce(sparse, MAX): the message", "SUM only" in str(e), str(e))
        # The group still works: a dense all_reduce after the failures.
        t = torch.full((3,), float(rank))
        dist.all_reduce(t)
        chk.equal("dense all_reduce after", t, torch.full((3,), float(sum(range(world)))))
    finally:
        finish()
    return chk.failures


@pytest.mark.parametrize("world", [2, 3])
def test_sparse_all_reduce_equals_gloo(world: int) -> None:
    assert_no_failures(spawn(world, _all_reduce_job, world, timeout=120))


class _Recommender(torch.nn.Module):
    """A DLRM-like toy: a sparse embedding and a sparse embedding bag feeding a dense MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 4, sparse=True)
        self.bag = torch.nn.EmbeddingBag(40, 4, mode="sum", sparse=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 1))

    def forward(self, ids: torch.Tensor, bags: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.emb(ids), self.bag(bags)], dim=1))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return (torch.randint(0, 50, (6,), generator=g), torch.randint(0, 40, (6, 3), generator=g),
            torch.randint(-2, 3, (6, 1), generator=g).float())


def _ddp_job(rank: int, world: int) -> list[str]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import torchring

    init_pg()
    torchring.init()
    chk = Checker(rank)
    try:
        gloo = dist.new_group(backend="gloo")
        torch.manual_seed(rank)  # DDP and wrap start every rank from rank 0's weights
        model = _Recommender()
        copies = {"torchring": model, "gloo": copy.deepcopy(model), "wrap": copy.deepcopy(model)}
        runs, start = {}, {}
        for backend, m in copies.items():
            wrapped = (torchring.wrap(m) if backend == "wrap"
                       else DDP(m, process_group=gloo if backend == "gloo" else None))
            opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
            start[backend] = state_of(m)
            for step in range(4):
                ids, bags, y = _batch(rank, step)
                opt.zero_grad()
                torch.nn.functional.mse_loss(wrapped(ids, bags), y).backward()
                chk.true(f"{backend} step {step}: the embedding's gradient is sparse", m.emb.weight.grad.is_sparse)
                opt.step()
            runs[backend] = state_of(m)
        for backend in ("torchring", "wrap"):
            compare(chk, f"sparse embeddings, {backend}: start", start[backend], start["gloo"], exact=True)
            compare(chk, f"sparse embeddings at world {world}: {backend} vs DDP on gloo", runs[backend],
                    runs["gloo"], exact=world == 2, rtol=1e-6, atol=1e-7)
        moved(chk, "DDP with sparse embeddings", start["torchring"], runs["torchring"])
        # torchring.allreduce of a sparse tensor, outside torch.distributed: the same sum.
        mine = _sparse(rank, world, torch.float32, (2,))
        got = torchring.allreduce(mine)
        want = sum(_sparse(r, world, torch.float32, (2,)).to_dense() for r in range(world))
        chk.true("torchring.allreduce(sparse): in place, coalesced", got is mine and got.is_coalesced())
        chk.equal("torchring.allreduce(sparse)", got.to_dense(), want)
        avg = torchring.allreduce_async(_sparse(rank, world, torch.float64), torchring.ReduceOp.AVG).wait()
        chk.equal("torchring.allreduce_async(sparse, AVG)", avg.to_dense(),
                  sum(_sparse(r, world, torch.float64).to_dense() for r in range(world)) / world)
    finally:
        torchring.shutdown()
        finish()
    return chk.failures


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_with_sparse_embeddings_equals_gloo(world: int) -> None:
    assert_no_failures(spawn(world, _ddp_job, world, timeout=150))
