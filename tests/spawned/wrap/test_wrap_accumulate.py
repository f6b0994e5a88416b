"""``torchring.wrap``: gradient accumulation without communication (``no_sync()``, the
``require_backward_grad_sync`` flag, ``no_sync(enabled=...)``) and forwards that do not train
(no_grad, eval, inference_mode) on some ranks only. References: see _parity.py.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F

from _checks import Checker, assert_no_failures
from _dist import spawn
from _parity import (LR, MLP, PER_RANK, SMALL, check_buckets, checked, grads, grads_close,
                     params_close, regression, same_on_all_ranks, shard)


def _accumulate(chk: Checker, rank: int, world: int, mode: str, micro: int = 3) -> None:
    """``micro - 1`` local micro-steps then one synced step, two rounds (set_to_none True, False)."""
    import torchring

    torch.manual_seed(21)
    model = MLP()
    ref, local = copy.deepcopy(model), copy.deepcopy(model)
    ddp = torchring.wrap(model, **SMALL)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for rnd in range(2):
        set_to_none = rnd == 0
        opt.zero_grad(set_to_none=set_to_none)
        ref_opt.zero_grad(set_to_none=set_to_none)
        local.load_state_dict(ref.state_dict())
        local.zero_grad(set_to_none=set_to_none)
        for k in range(micro):
            what = f"{mode} round {rnd} micro-step {k}"
            synced = k == micro - 1
            x, y = regression(10 * rnd + k, PER_RANK * world)
            xs, ys = shard(x, rank), shard(y, rank)
            if mode == "no_sync":
                ctx = ddp.no_sync() if not synced else contextlib.nullcontext()
                with ctx:
                    F.mse_loss(ddp(xs), ys).backward()
            elif mode == "flag":
                ddp.require_backward_grad_sync = synced
                F.mse_loss(ddp(xs), ys).backward()
            else:  # no_sync(enabled=cond)
                with ddp.no_sync(enabled=not synced):
                    F.mse_loss(ddp(xs), ys).backward()
            chk.true(f"{what}: require_backward_grad_sync restored",
                     ddp.require_backward_grad_sync is True or mode == "flag", "not True")
            F.mse_loss(ref(x), y).backward()
            F.mse_loss(local(xs), ys).backward()
            if synced:
                grads_close(chk, what + " (accumulated global)", ddp.module, ref)
                same_on_all_ranks(chk, what, grads(ddp.module))
            else:
                grads_close(chk, what + " (local only, no communication)", ddp.module, local)
        opt.step()
        ref_opt.step()
        params_close(chk, f"{mode} round {rnd} after SGD", ddp.module, ref)
    check_buckets(chk, mode, ddp, 3)


def _accumulation_job(rank: int) -> list[str]:
    def body(chk: Checker, rank: int, world: int) -> None:
        for mode in ("no_sync", "flag", "no_sync(enabled=cond)"):
            _accumulate(chk, rank, world, mode)
    return checked(rank, body)


def test_no_sync_accumulation() -> None:
    """no_sync(), require_backward_grad_sync=False/True and no_sync(enabled=cond) accumulate."""
    assert_no_failures(spawn(3, _accumulation_job))


def _inference_job(rank: int) -> list[str]:
    """Some ranks run extra no_grad / eval / inference_mode forwards; training parity holds."""
    import torchring

    def body(chk: Checker, rank: int, world: int) -> None:
        torch.manual_seed(31)
        model = MLP(bn=True)
        ref = copy.deepcopy(model)
        ddp = torchring.wrap(model, **SMALL)
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
        for step in range(4):
            what = f"step {step}"
            x, y = regression(step, PER_RANK * world)
            probe = regression(100 + step, 2)[0]
            with ddp.no_sync(), torch.no_grad():  # every rank: a no_sync forward under no_grad
                ddp(probe)
            if rank == 1:  # eval-mode forward with grad enabled, output dropped
                ddp.eval()
                ddp(probe)
                ddp.train()
            if rank == 2:
                with torch.inference_mode():
                    ddp(probe)
            opt.zero_grad()
            out = ddp(shard(x, rank))
            if rank == 0:  # a train-mode no_grad forward between forward and backward
                with torch.no_grad():
                    ddp(probe)
            F.mse_loss(out, shard(y, rank)).backward()
            if rank == world - 1:  # a validation pass on the last rank only
                ddp.eval()
                with torch.no_grad():
                    ddp(probe)
                ddp.train()
            ref_opt.zero_grad()
            (sum(F.mse_loss(ref(shard(x, r)), shard(y, r)) for r in range(world)) / world).backward()
            grads_close(chk, what, model, ref)
            same_on_all_ranks(chk, what, grads(model))
            opt.step()
            ref_opt.step()
            params_close(chk, what + " after SGD", model, ref)
    return checked(rank, body)


def test_inference_on_some_ranks_does_not_hang() -> None:
    assert_no_failures(spawn(3, _inference_job, timeout=90))
