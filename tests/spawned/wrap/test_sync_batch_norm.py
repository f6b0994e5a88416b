"""``torchring.SyncBatchNorm`` and ``hvd.SyncBatchNorm`` against one ``nn.BatchNorm`` on the
concatenation of every rank's batch.

Every rank builds the whole global batch (small integers, float64) and a reference BatchNorm
with the same initial state; rank r feeds rows ``[offsets[r], offsets[r+1])`` to the
synchronized layer, with batch sizes that differ per rank (one rank has a single row, one has
none). The loss is ``sum(out * g)`` with integer weights g, so the sum of the ranks' losses is
the reference's loss: outputs and input gradients must match the reference's rows, the
weight/bias gradients summed over the ranks the reference's, and the running statistics (and
num_batches_tracked) the reference's, after each of two steps. Eval mode uses the running
statistics and no communication, so it is compared row by row too.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _checks import Checker, assert_no_failures
from _dist import spawn
from _parity import CNN, PER_RANK, close, grads_close, images, shard

SIZES = {2: [3, 5], 3: [4, 1, 0]}
TOL = dict(rtol=1e-9, atol=1e-9)


def _ints(step: int, salt: int, shape: tuple[int, ...], lo: int = -3, hi: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * salt + step)
    return torch.randint(lo, hi, shape, generator=g).double()


# (name, BatchNorm class, kwargs, per-sample shape, channels_last)
CASES = [
    ("2d affine", nn.BatchNorm2d, dict(num_features=3), (3, 2, 3), False),
    ("2d channels_last", nn.BatchNorm2d, dict(num_features=3, momentum=0.3), (3, 2, 2), True),
    ("1d no affine, cumulative", nn.BatchNorm1d, dict(num_features=4, affine=False, momentum=None),
     (4,), False),
    ("1d weight without bias", nn.BatchNorm1d, dict(num_features=2, bias=False), (2, 5), False),
    ("3d no running stats", nn.BatchNorm3d, dict(num_features=2, track_running_stats=False),
     (2, 2, 1, 2), False),
]


def _run_case(chk: Checker, name: str, sync: nn.Module, ref: nn.Module, sizes: list[int],
              rank: int, sample: tuple[int, ...], channels_last: bool, group: Any = None) -> None:
    """Two training steps and one eval forward of `sync` (this rank's rows) against `ref`."""
    import torchring

    lo, hi = sum(sizes[:rank]), sum(sizes[:rank + 1])
    for step in range(2):
        x_all = _ints(step, 1, (sum(sizes),) + sample)
        g_all = _ints(step, 2, x_all.shape, -2, 3)
        if channels_last:
            x_all = x_all.contiguous(memory_format=torch.channels_last)
        x = x_all[lo:hi].clone().requires_grad_()
        xr = x_all.clone().requires_grad_()
        out = sync(x)
        want = ref(xr)
        (out * g_all[lo:hi]).sum().backward()
        (want * g_all).sum().backward()
        what = f"{name} step {step}"
        close(chk, f"{what}: output", out, want[lo:hi], **TOL)
        close(chk, f"{what}: input grad", x.grad, xr.grad[lo:hi], **TOL)
        for (pname, p), (_, q) in zip(sync.named_parameters(), ref.named_parameters()):
            total = torchring.allreduce(p.grad.clone(), group=group)
            close(chk, f"{what}: {pname}.grad summed over the ranks", total, q.grad, **TOL)
            p.grad, q.grad = None, None
        for (bname, b), (_, c) in zip(sync.named_buffers(), ref.named_buffers()):
            close(chk, f"{what}: {bname}", b, c, **TOL)
    if ref.track_running_stats and hi > lo:
        sync.eval(), ref.eval()
        x_all = _ints(5, 3, (sum(sizes),) + sample)
        with torch.no_grad():
            close(chk, f"{name} eval", sync(x_all[lo:hi]), ref(x_all)[lo:hi], **TOL)
        sync.train(), ref.train()


def _layers_job(rank: int) -> list[str]:
    import torchring
    from _parity import checked

    def body(chk: Checker, rank: int, world: int) -> None:
        sizes = SIZES[world]
        for name, cls, kw, sample, channels_last in CASES:
            torch.manual_seed(7)
            ref = cls(**kw).double()
            if ref.affine:  # weights and biases that are not 1 and 0
                with torch.no_grad():
                    ref.weight.copy_(_ints(0, 9, ref.weight.shape, 1, 4))
                    if ref.bias is not None:
                        ref.bias.copy_(_ints(0, 8, ref.bias.shape))
            sync = torchring.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ref))
            chk.true(f"{name}: converted", type(sync) is torchring.SyncBatchNorm, type(sync).__name__)
            _run_case(chk, name, sync, ref, sizes, rank, sample, channels_last)
        if world == 3:
            _group_case(chk, rank)
        else:
            _wrapped_cnn_case(chk, rank, world)
    return checked(rank, body)


def _group_case(chk: Checker, rank: int) -> None:
    """World 3: ranks 0 and 2 share statistics in a group, rank 1 is alone in its own."""
    import torchring

    pair, alone = torchring.new_group([0, 2]), torchring.new_group([1])
    group = alone if rank == 1 else pair
    ref = nn.BatchNorm2d(3).double()
    sync = torchring.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ref), group)
    chk.true("group kept", sync.group is group, f"{sync.group!r}")
    chk.true("deepcopy shares the group", copy.deepcopy(sync).group is group, "a copy")
    sizes = [2] if rank == 1 else [3, 4]
    _run_case(chk, "group of world ranks [0, 2]" if rank != 1 else "group of rank 1 alone",
              sync, ref, sizes, group.rank(), (3, 2, 2), False, group=group)


def _wrapped_cnn_case(chk: Checker, rank: int, world: int) -> None:
    """torchring.wrap over a converted CNN on equal shards: the gradients of one model on the
    global batch (SyncBatchNorm makes every rank normalize as that model does)."""
    import torchring

    torch.manual_seed(3)
    ref = CNN().double()
    ddp = torchring.wrap(torchring.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ref)))
    for step in range(2):
        x, y = images(step, PER_RANK * world)
        x, y = x.double(), y
        ddp.zero_grad(), ref.zero_grad()
        F.cross_entropy(ddp(shard(x, rank)), shard(y, rank)).backward()
        F.cross_entropy(ref(x), y).backward()
        grads_close(chk, f"wrapped CNN step {step}", ddp.module, ref, **TOL)
        close(chk, f"wrapped CNN step {step}: running_var", ddp.module.bn.running_var,
              ref.bn.running_var, **TOL)


@pytest.mark.parametrize("world", [2, 3])
def test_sync_batch_norm_matches_one_batch_norm(world: int) -> None:
    assert_no_failures(spawn(world, _layers_job))


def _horovod_job(rank: int) -> list[str]:
    """Horovod's own test_horovod_sync_batch_norm expectations, on CPU: one sample per rank (4
    channels of length 2, then of length 1), training outputs and running statistics equal to a
    BatchNorm1d on all ranks' samples, and averaged gradients equal to the reference's of the
    batch-mean loss. Then eval mode: with running stats local, without them synchronized."""
    import torchring
    import torchring.horovod as hvd

    hvd.init()
    chk = Checker(rank)
    try:
        world = hvd.size()
        for length in (2, 1):
            ts = torch.stack([torch.tensor([[r * k + j + (length == 1) for j in range(length)]
                                            for k in (1, 2, 3, 4)]) for r in range(world)]).double()
            sync, bn = hvd.SyncBatchNorm(num_features=4).double(), nn.BatchNorm1d(4).double()
            ts1, ts2 = ts.clone().requires_grad_(), ts.clone().requires_grad_()
            out, want = sync(ts1[rank].unsqueeze(0)), bn(ts2)
            what = f"length {length}"
            close(chk, f"{what}: output", out, want[rank].unsqueeze(0), **TOL)
            close(chk, f"{what}: running_mean", sync.running_mean, bn.running_mean, **TOL)
            close(chk, f"{what}: running_var", sync.running_var, bn.running_var, **TOL)
            out.sum().backward()
            want.mean(dim=0).sum().backward()
            for got, ref, name in ((sync.weight.grad, bn.weight.grad, "weight"),
                                   (sync.bias.grad, bn.bias.grad, "bias"), (ts1.grad, ts2.grad, "input")):
                averaged = torchring.allreduce(got.clone(), torchring.ReduceOp.AVG)
                close(chk, f"{what}: averaged {name} grad", averaged, ref, **TOL)
        x = torch.stack([torch.arange(6.0).view(2, 3) * (r + 1) for r in range(world)]).double()
        free, bn = hvd.SyncBatchNorm(2, track_running_stats=False).double().eval(), nn.BatchNorm1d(
            2, track_running_stats=False).double()
        close(chk, "eval without running stats: synchronized", free(x[rank:rank + 1]),
              bn(x)[rank:rank + 1], **TOL)
    finally:
        hvd.shutdown()
    return chk.failures


@pytest.mark.parametrize("world", [2, 3])
def test_horovod_sync_batch_norm(world: int) -> None:
    assert_no_failures(spawn(world, _horovod_job))


def test_convert_sync_batchnorm_keeps_state_and_nesting() -> None:
    """convert_sync_batchnorm replaces every BatchNorm*d, nested too, sharing parameters and
    buffers; without torchring.init() the layer is a plain BatchNorm."""
    import torchring

    model = nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3),
                          nn.Sequential(nn.Flatten(), nn.BatchNorm1d(12, affine=False, momentum=None)))
    model[1].eval()
    ref = copy.deepcopy(model).double()
    before = {n: t for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    converted = torchring.SyncBatchNorm.convert_sync_batchnorm(model)
    assert type(converted[1]) is torchring.SyncBatchNorm
    assert type(converted[2][1]) is torchring.SyncBatchNorm
    assert type(converted[0]) is nn.Conv2d and type(converted[2][0]) is nn.Flatten
    after = dict(list(converted.named_parameters()) + list(converted.named_buffers()))
    assert before.keys() == after.keys()
    assert all(after[n] is t for n, t in before.items())
    assert not converted[1].training and converted[2][1].training
    assert converted[2][1].momentum is None and not converted[2][1].affine
    x = _ints(0, 4, (5, 2, 2, 2))
    torch.testing.assert_close(converted.double()(x), ref(x))
    torch.testing.assert_close(converted[2][1].running_var, ref[2][1].running_var)
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        torchring.SyncBatchNorm(3)(torch.zeros(3))
    with pytest.raises(TypeError, match="torchring.Group"):
        torchring.SyncBatchNorm(3, group=object())
