"""``torchring.wrap`` with reduced precision: an autocast(bf16) forward with a GradScaler, fp16
and bf16 gradient compression on the wire, and the argument checks of wrap(). References: see
_parity.py.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from _checks import Checker, assert_no_failures
from _dist import spawn
from _parity import (LR, MLP, PER_RANK, SMALL, STEPS, check_buckets, checked, grads, grads_close,
                     regression, same_on_all_ranks, shard)


def _precision_job(rank: int) -> list[str]:
    import torchring

    def body(chk: Checker, rank: int, world: int) -> None:
        # autocast(bf16) forward + GradScaler: finite float32 grads, equal on every rank, close to
        # the same autocast computation on the global batch (bf16 rounding differs with batch split)
        torch.manual_seed(61)
        model = MLP()
        ref = copy.deepcopy(model)
        ddp = torchring.wrap(model, **SMALL)
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        for step in range(STEPS):
            what = f"autocast+GradScaler step {step}"
            x, y = regression(step, PER_RANK * world)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = ddp(shard(x, rank))
            chk.true(f"{what}: autocast output dtype", out.dtype == torch.bfloat16, f"{out.dtype}")
            scaler.scale(F.mse_loss(out.float(), shard(y, rank))).backward()
            scale = scaler.get_scale()
            for name, p in model.named_parameters():
                chk.true(f"{what}: {name}.grad finite float32", p.grad is not None and p.grad.dtype ==
                         torch.float32 and bool(torch.isfinite(p.grad).all()), f"{p.grad}")
            same_on_all_ranks(chk, what, grads(model))
            ref.load_state_dict(model.state_dict())
            ref.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                ref_out = ref(x)
            (F.mse_loss(ref_out.float(), y) * scale).backward()
            grads_close(chk, what, model, ref, rtol=2e-2, atol=2e-2)
            scaler.step(opt)
            scaler.update()
            same_on_all_ranks(chk, what + " params", dict(model.named_parameters()))

        # gradient compression: equal on every rank, within 1e-2 (relative, atol 1e-2 * max|g|)
        # of the fp32 gradient at the same parameters; 2 bytes per element on the wire
        for comp in ("fp16", "bf16"):
            torch.manual_seed(62)
            model = MLP()
            ref = copy.deepcopy(model)
            ddp = torchring.wrap(model, compression=comp, **SMALL)
            opt = torch.optim.SGD(ddp.parameters(), lr=LR)
            for step in range(STEPS):
                what = f"compression={comp} step {step}"
                x, y = regression(step, PER_RANK * world)
                opt.zero_grad()
                F.mse_loss(ddp(shard(x, rank)), shard(y, rank)).backward()
                ref.load_state_dict(model.state_dict())
                ref.zero_grad()
                F.mse_loss(ref(x), y).backward()
                grads_close(chk, what, model, ref, rtol=1e-2, atol=1e-2)
                same_on_all_ranks(chk, what, grads(model))
                check_buckets(chk, what, ddp, 3, wire_bytes=2)
                opt.step()
            same_on_all_ranks(chk, f"compression={comp} params", dict(model.named_parameters()))

        for kwargs in ({"compression": "fp8"}, {"compression": "int8"}, {"compression": 16},
                       {"bucket_cap_mb": 0}, {"first_bucket_mb": -1.0}):
            try:
                torchring.wrap(MLP(), **kwargs)
            except ValueError as e:
                key = next(iter(kwargs))
                chk.true(f"wrap(**{kwargs}) message", key.split("_")[0] in str(e), str(e))
            else:
                chk.fail(f"wrap(**{kwargs})", "did not raise ValueError")
    return checked(rank, body)


def test_autocast_and_compression() -> None:
    assert_no_failures(spawn(2, _precision_job))
