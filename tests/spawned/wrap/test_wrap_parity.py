"""``torchring.wrap``: gradients and parameters match single-process training on worlds 1-4
(MLP, BatchNorm CNN, channels_last CNN, embedding, tied weights, a branch some ranks skip),
and reentrant activation checkpointing syncs once per backward. References: see _parity.py.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _checks import Checker, assert_no_failures
from _dist import session, spawn
from _parity import (CNN, LR, MLP, PER_RANK, SMALL, STEPS, BranchNet, EmbedNet, TiedLM, bn_after,
                     buffers, check_buckets, checked, close, grads, grads_close, images, images_cl,
                     lm_loss, lm_tokens, params_close, regression, same_on_all_ranks, shard, tokens)


@dataclasses.dataclass
class Case:
    name: str
    make: Callable[[], nn.Module]
    batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    wrap: dict = dataclasses.field(default_factory=dict)
    set_to_none: bool = True
    per_shard: bool = False            # reference = mean_r loss(model(shard_r)), see module doc
    rank_kwargs: Callable[[int], dict] = lambda r: {}
    check_buffers: bool = False        # running stats follow rank 0's chain (broadcast_buffers)
    min_buckets: int = 1
    eval: bool = False                 # whole model in eval() (BatchNorm uses fixed statistics)
    channels_last: bool = False


def _cases() -> list[Case]:
    mse, ce = F.mse_loss, F.cross_entropy
    return [
        Case("mlp", MLP, regression, mse),
        # fc2's 512x512 gradient (1 MiB) comes from the gradient pool (256 KiB and up).
        Case("wide mlp (pooled gradients)", lambda: MLP(hidden=512), regression, mse),
        Case("mlp small buckets, zero_grad(set_to_none=False)", MLP, regression, mse, SMALL,
             set_to_none=False, min_buckets=3),
        Case("cnn+batchnorm (train mode, per-shard stats)", CNN, images, ce, SMALL, per_shard=True,
             check_buffers=True, min_buckets=3),
        Case("channels_last cnn (eval-mode batchnorm)",
             lambda: CNN().to(memory_format=torch.channels_last), images_cl, ce, SMALL, eval=True,
             channels_last=True, min_buckets=3, set_to_none=False),
        Case("embedding", EmbedNet, tokens, ce, SMALL, min_buckets=2),
        Case("tied weights", TiedLM, lm_tokens, lm_loss, SMALL, min_buckets=2, set_to_none=False),
        Case("branch on odd ranks + never-used layer", BranchNet, regression, mse, SMALL,
             per_shard=True, rank_kwargs=lambda r: {"use_extra": r % 2 == 1}, min_buckets=2),
    ]


def _run_case(chk: Checker, case: Case, rank: int, world: int, steps: int = STEPS) -> None:
    import torchring

    torch.manual_seed(11)
    model = case.make()
    ref = copy.deepcopy(model)
    ddp = torchring.wrap(model, **case.wrap)
    if case.eval:
        ddp.eval()
        ref.eval()
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    chain = buffers(ref)  # rank 0's buffers at the start of the step
    for step in range(steps):
        what = f"{case.name} (world {world}) step {step}"
        x, y = case.batch(step, PER_RANK * world)
        opt.zero_grad(set_to_none=case.set_to_none)
        loss = case.loss(ddp(shard(x, rank), **case.rank_kwargs(rank)), shard(y, rank))
        loss.backward()

        ref_opt.zero_grad(set_to_none=case.set_to_none)
        if case.per_shard:
            ref_loss = sum(case.loss(ref(shard(x, r), **case.rank_kwargs(r)), shard(y, r))
                           for r in range(world)) / world
        else:
            ref_loss = case.loss(ref(x), y)
        ref_loss.backward()

        grads_close(chk, what, ddp.module, ref)
        same_on_all_ranks(chk, what + " grads", grads(ddp.module))
        check_buckets(chk, what, ddp, case.min_buckets)
        if case.channels_last:
            for name, p in ddp.module.named_parameters():
                if p.dim() == 4:
                    chk.true(f"{what}: {name}.grad strides", p.grad.stride() == p.stride(),
                             f"grad {p.grad.stride()} vs param {p.stride()}")
        if case.check_buffers:
            want = bn_after(ref, chain, shard(x, rank), **case.rank_kwargs(rank))
            for name, b in ddp.module.named_buffers():
                close(chk, f"{what}: buffer {name} (rank 0's, updated by this rank's shard)", b,
                      want[name])
            chain = bn_after(ref, chain, shard(x, 0), **case.rank_kwargs(0))
        opt.step()
        ref_opt.step()
        params_close(chk, what + " after SGD", ddp.module, ref)
        same_on_all_ranks(chk, what + " params", dict(ddp.module.named_parameters()))
    if isinstance(model, BranchNet):
        chk.true(f"{case.name}: never.weight.grad", model.never.weight.grad is None, "not None")
        chk.true(f"{case.name}: extra.weight.grad is None iff no rank uses it",
                 (model.extra.weight.grad is None) == (world == 1), f"{model.extra.weight.grad}")
    if isinstance(model, TiedLM):
        chk.true("tied weights stay tied", model.out.weight is model.emb.weight, "untied")
    if case.channels_last:
        chk.true("channels_last params stay channels_last",
                 model.conv1.weight.is_contiguous(memory_format=torch.channels_last), "not")


def _parity_job(rank: int) -> list[str]:
    def body(chk: Checker, rank: int, world: int) -> None:
        for case in _cases():
            _run_case(chk, case, rank, world)
    return checked(rank, body)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_parity(world: int) -> None:
    """MLP, BN CNN, channels_last CNN, embedding, tied weights, rank-dependent branch."""
    assert_no_failures(spawn(world, _parity_job))


def _checkpointed(rank: int) -> list[str]:
    """Reentrant activation checkpointing: parity, and one sync per backward (not per segment)."""
    import torch.utils.checkpoint as cp
    import torchring

    with session():
        world = torchring.size()

        class Segmented(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                # Every parameter sits in a checkpointed segment, the output layer too, so each
                # parameter hook fires inside an inner (reentrant) backward.
                self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(6, 6), nn.Tanh()),
                                             nn.Sequential(nn.Linear(6, 6), nn.Tanh()),
                                             nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))])

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                for block in self.blocks:
                    x = cp.checkpoint(block, x, use_reentrant=True)
                return x

        torch.manual_seed(0)
        ref = Segmented()
        # Every allreduce the wrapper launches, by op: one AVG per bucket, then one MAX (the
        # used-flags) per sync. The wrapper's Reducer takes the function when it is built.
        ops: list[str] = []
        launch = torchring.collectives.basic.allreduce_async
        torchring.collectives.basic.allreduce_async = lambda t, op: (ops.append(op.name), launch(t, op))[1]
        model = torchring.wrap(copy.deepcopy(ref), bucket_cap_mb=0.0002, first_bucket_mb=0.0001)
        bad = []
        g = torch.Generator().manual_seed(3)
        for step in range(3):
            x = torch.randint(-2, 3, (2 * world, 6), generator=g).float().requires_grad_()
            y = torch.randint(-2, 3, (2 * world, 2), generator=g).float()
            ref.zero_grad()
            nn.functional.mse_loss(ref(x), y).backward()
            model.zero_grad()
            ops.clear()
            nn.functional.mse_loss(model(x[rank * 2:(rank + 1) * 2]), y[rank * 2:(rank + 1) * 2]).backward()
            buckets = len(model.bucket_stats())
            if ops != ["AVG"] * buckets + ["MAX"]:
                bad.append(f"step {step}: allreduces {ops} in one backward, expected {buckets} "
                           "AVG (one per bucket) then one MAX (one sync)")
            for (name, a), b in zip(model.module.named_parameters(), ref.parameters()):
                if not torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6):
                    bad.append(f"step {step}: {name}.grad differs from single-process training")
        out = model(torch.ones(1, 6))
        out += 1  # outputs may be modified in place (the sink returns clones, not views)
        return bad


def test_reentrant_checkpointing_syncs_once_per_backward() -> None:
    for failures in spawn(2, _checkpointed):
        assert failures == []
