"""``torchring.wrap``: parameters without a gradient in a synchronized step: frozen right after
wrap, unfrozen later (the wrapper re-buckets; bucket_stats() keeps the last sync's until the
next one), frozen after the buckets were rebuilt, and one used only inside no_sync micro-steps
(it counts as used). References: see _parity.py.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F

from _checks import Checker, assert_no_failures
from _dist import spawn
from _parity import (LR, MLP, PER_RANK, SMALL, STEPS, BranchNet, check_buckets, checked, grads,
                     grads_close, regression, same_on_all_ranks, shard, train_mlp)


def _frozen_after_wrap_job(rank: int) -> list[str]:
    import torchring

    def body(chk: Checker, rank: int, world: int) -> None:
        torch.manual_seed(51)
        model = MLP()
        ref = copy.deepcopy(model)
        ddp = torchring.wrap(model, **SMALL)
        for m in (model, ref):
            m.fc2.weight.requires_grad_(False)
        frozen = model.fc2.weight.detach().clone()
        opts = torch.optim.SGD(ddp.parameters(), lr=LR), torch.optim.SGD(ref.parameters(), lr=LR)
        train_mlp(chk, "fc2.weight frozen right after wrap", ddp, ref, opts, rank, world, 0, STEPS)
        chk.true("frozen fc2.weight.grad", model.fc2.weight.grad is None, "is not None")
        chk.equal("frozen fc2.weight unchanged", model.fc2.weight.detach(), frozen)
    return checked(rank, body)


def test_frozen_after_wrap() -> None:
    assert_no_failures(spawn(2, _frozen_after_wrap_job))


def _unfreeze_job(rank: int) -> list[str]:
    import torchring

    def body(chk: Checker, rank: int, world: int) -> None:
        torch.manual_seed(52)
        model = MLP()
        model.fc1.weight.requires_grad_(False)
        ref = copy.deepcopy(model)
        ddp = torchring.wrap(model, **SMALL)
        opts = torch.optim.SGD(ddp.parameters(), lr=LR), torch.optim.SGD(ref.parameters(), lr=LR)
        train_mlp(chk, "fc1.weight frozen at wrap", ddp, ref, opts, rank, world, 0, 2)
        chk.true("fc1.weight.grad while frozen", model.fc1.weight.grad is None, "is not None")
        for m in (model, ref):
            m.fc1.weight.requires_grad_(True)
        before = ddp.bucket_stats()
        ddp(shard(regression(2, PER_RANK * world)[0], rank))  # re-buckets; no backward follows
        chk.true("bucket_stats() after re-bucketing, before the next synced backward",
                 bool(before) and ddp.bucket_stats() == before, f"{ddp.bucket_stats()}, expected {before}")
        train_mlp(chk, "fc1.weight unfrozen", ddp, ref, opts, rank, world, 2, 3)
        chk.true("fc1.weight.grad after unfreezing", model.fc1.weight.grad is not None, "is None")
        check_buckets(chk, "after unfreezing", ddp, 3)
        for m in (model, ref):  # frozen after the buckets were rebuilt
            m.fc3.bias.requires_grad_(False)
        bias = model.fc3.bias.detach().clone()
        train_mlp(chk, "fc3.bias frozen later", ddp, ref, opts, rank, world, 5, 2)
        chk.true("fc3.bias.grad after freezing", model.fc3.bias.grad is None, "is not None")
        chk.equal("frozen fc3.bias unchanged", model.fc3.bias.detach(), bias)
    return checked(rank, body)


def test_unfrozen_later_and_frozen_later() -> None:
    assert_no_failures(spawn(2, _unfreeze_job))


def _nosync_branch_job(rank: int) -> list[str]:
    """A parameter used (on rank 1) only inside no_sync micro-steps, not in the synced step."""
    import torchring

    def body(chk: Checker, rank: int, world: int) -> None:
        torch.manual_seed(41)
        model = BranchNet()
        ref = copy.deepcopy(model)
        ddp = torchring.wrap(model, **SMALL)
        plan = [(True, lambda r: r == 1), (True, lambda r: False), (False, lambda r: False)]
        for k, (local_only, uses_extra) in enumerate(plan):
            x, y = regression(k, PER_RANK * world)
            with ddp.no_sync() if local_only else contextlib.nullcontext():
                F.mse_loss(ddp(shard(x, rank), use_extra=uses_extra(rank)), shard(y, rank)).backward()
            (sum(F.mse_loss(ref(shard(x, r), use_extra=uses_extra(r)), shard(y, r))
                 for r in range(world)) / world).backward()
        grads_close(chk, "after the synced step", model, ref)
        same_on_all_ranks(chk, "after the synced step", grads(model))
    return checked(rank, body)


def test_no_sync_param_used_only_in_micro_steps() -> None:
    """Expected extra.grad = rank 1's accumulated grad / world on every rank (DDP keeps the
    used-map across no_sync iterations)."""
    assert_no_failures(spawn(2, _nosync_branch_job))
