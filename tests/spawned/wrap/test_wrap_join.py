"""``with model.join():`` for ``torchring.wrap``: ranks with different numbers of batches.

Rank r trains on ``COUNTS[world][r]`` batches (integer-valued, float64, an MLP with BatchNorm,
several buckets); a rank out of batches leaves its loop and answers the others until all are
done. The reference, computed in every rank, replays the job in one process: at step t the
ranks with a t-th batch are active; each starts from the buffers of the lowest active rank
(broadcast_buffers), runs its batch and keeps its own updated buffers; the gradients of the
active ranks are summed and divided by the world size (joined ranks count as zeros), and one
SGD step follows. At the end every rank must hold the reference's parameters and the buffers
of the highest rank among those with the most batches, bit-identical across ranks, and have
shadowed one step per batch it lacked. A second case has a rank with no batch at all (it
shadows the first sync and the bucket rebuild); then throw_on_early_termination=True makes
every rank raise once one runs out, and the next collective is exact.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from _checks import Checker, assert_no_failures
from _dist import spawn
from _parity import (LR, MLP, PER_RANK, SMALL, buffers, checked, close, params_close, regression,
                     same_on_all_ranks)

COUNTS = {2: [[3, 5], [0, 2]], 3: [[3, 5, 4]]}
TOL = dict(rtol=1e-9, atol=1e-9)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = regression(100 * rank + step, PER_RANK)
    return x.double(), y.double()


def _reference(model: torch.nn.Module, counts: list[int]) -> tuple[torch.nn.Module, dict]:
    """The single-process replay (see the module docstring): final model, final buffers."""
    ref = copy.deepcopy(model)
    world = len(counts)
    bufs = [buffers(ref) for _ in range(world)]
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(max(counts)):
        active = [r for r in range(world) if counts[r] > step]
        start = bufs[active[0]]
        opt.zero_grad()
        for r in active:
            with torch.no_grad():
                for name, b in ref.named_buffers():
                    b.copy_(start[name])
            x, y = _batch(r, step)
            F.mse_loss(ref(x), y).backward()  # accumulates over the active ranks
            bufs[r] = buffers(ref)
        for p in ref.parameters():
            p.grad /= world
        opt.step()
    last = max(r for r in range(world) if counts[r] == max(counts))
    return ref, bufs[last]


def _train(chk: Checker, what: str, rank: int, counts: list[int]) -> None:
    import torchring

    torch.manual_seed(sum(counts))
    model = MLP(bn=True).double()
    ref, ref_buffers = _reference(model, counts)
    ddp = torchring.wrap(model, **SMALL)
    chk.true(f"{what}: several buckets", ddp._reducer.num_buckets > 2, str(ddp._reducer.num_buckets))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    with ddp.join() as join:
        for step in range(counts[rank]):
            x, y = _batch(rank, step)
            opt.zero_grad()
            F.mse_loss(ddp(x), y).backward()
            opt.step()
    chk.true(f"{what}: steps shadowed", join.shadowed == max(counts) - counts[rank],
             f"{join.shadowed}, expected {max(counts) - counts[rank]}")
    params_close(chk, f"{what}: final parameters", model, ref, **TOL)
    for name, b in model.named_buffers():
        close(chk, f"{what}: final buffer {name}", b, ref_buffers[name], **TOL)
    same_on_all_ranks(chk, what, {**dict(model.named_parameters()), **dict(model.named_buffers())})
    x, y = _batch(rank, 99)  # after join(): an ordinary synchronized step runs
    opt.zero_grad()
    F.mse_loss(ddp(x), y).backward()
    same_on_all_ranks(chk, f"{what}: a step after join()", {n: p.grad for n, p in model.named_parameters()})


def _throw_case(chk: Checker, rank: int) -> None:
    import torchring

    torch.manual_seed(5)
    ddp = torchring.wrap(MLP().double(), **SMALL)
    counts, raised = [2, 4], None
    try:
        with ddp.join(throw_on_early_termination=True):
            for step in range(counts[rank]):
                x, y = _batch(rank, step)
                F.mse_loss(ddp(x), y).backward()
    except torchring.TorchringError as e:
        raised = str(e)
    chk.true("throw_on_early_termination raised", raised is not None and "[0] ran out of inputs" in raised,
             f"{raised!r}")
    t = torch.full((3,), float(rank + 1))
    chk.equal("allreduce after the early termination", torchring.allreduce(t),
              torch.full((3,), float(sum(range(1, torchring.size() + 1)))))


def _job(rank: int) -> list[str]:
    def body(chk: Checker, rank: int, world: int) -> None:
        for counts in COUNTS[world]:
            _train(chk, f"batches {counts}", rank, counts)
        if world == 2:
            _throw_case(chk, rank)
    return checked(rank, body)


@pytest.mark.parametrize("world", [2, 3])
def test_join_with_uneven_batches(world: int) -> None:
    assert_no_failures(spawn(world, _job))
