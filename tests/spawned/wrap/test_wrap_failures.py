"""``torchring.wrap`` when something is wrong: ranks built different models (every rank raises,
naming the parameter and the ranks), wrap() before init(), and a backward that raised before its
gradients were averaged (reported by the next forward; the step after it trains normally).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _checks import Checker, assert_no_failures
from _dist import run_alone, session, spawn
from _parity import LR, MLP, PER_RANK, SMALL, Pair, checked, regression, shard, train_mlp


def _mismatch_job(rank: int, variant: str) -> str:
    import torchring

    with session():
        if variant == "out_features":
            model = Pair(out=4 if rank == 1 else 3)
        else:
            model = Pair(extra=rank == 2)
        torchring.wrap(model)
        return "wrapped"


@pytest.mark.parametrize("variant,world,bad_rank,param", [
    ("out_features", 2, 1, "is 'fc2.weight' float32[3, 6] strides [6, 1] on rank 0 but "
                           "'fc2.weight' float32[4, 6] strides [6, 1] on rank 1"),
    ("extra_layer", 3, 2, "is 'fc2.weight' float32[3, 6] strides [6, 1] on rank 0 but "
                          "'extra.weight' float32[6, 6] strides [6, 1] on rank 2")])
def test_model_mismatch(variant: str, world: int, bad_rank: int, param: str) -> None:
    """Every rank raises TorchringError naming the first differing entry (name, dtype, shape,
    strides) on rank 0 and on the differing rank."""
    outcomes = spawn(world, _mismatch_job, variant, expect_fail=True)
    problems = []
    for o in outcomes:
        if o.error is None:
            problems.append(o.describe())
            continue
        last = o.error.strip().splitlines()[-1]
        wanted = ("TorchringError", param, f"rank {bad_rank}", "rank 0")
        if not all(w in last for w in wanted):
            problems.append(f"rank {o.rank}: {last}")
    assert not problems, "\n".join(problems)


def _wrap_before_init(rank: int) -> tuple[str, str] | None:
    import torchring

    try:
        torchring.wrap(nn.Linear(2, 2))
    except RuntimeError as e:
        return type(e).__name__, str(e)
    return None


def test_wrap_before_init() -> None:
    got = run_alone(_wrap_before_init)
    assert got is not None, "torchring.wrap before torchring.init() did not raise RuntimeError"
    assert "init()" in got[1], got


def _failed_backward_job(rank: int) -> list[str]:
    """Step 1's backward raises on every rank (a user hook): the next forward raises a clear
    TorchringError, and the step after it averages gradients again (parity with one process)."""
    import torchring

    def body(chk: Checker, rank: int, world: int) -> None:
        torch.manual_seed(8)
        model = MLP()
        ref = copy.deepcopy(model)
        ddp = torchring.wrap(model, **SMALL)
        opts = torch.optim.SGD(ddp.parameters(), lr=LR), torch.optim.SGD(ref.parameters(), lr=LR)
        train_mlp(chk, "before the failure", ddp, ref, opts, rank, world, 0, 1)

        def fail(grad: torch.Tensor) -> None:
            raise ValueError("hook failed on purpose")
        handle = model.fc1.weight.register_hook(fail)
        x, y = regression(1, PER_RANK * world)
        try:
            F.mse_loss(ddp(shard(x, rank)), shard(y, rank)).backward()
            chk.fail("failing backward", "did not raise")
        except ValueError:
            pass
        handle.remove()
        try:
            ddp(shard(x, rank))
            chk.fail("forward after a failed backward", "did not raise")
        except torchring.TorchringError as e:
            chk.true("forward after a failed backward: message", f"rank {rank}" in str(e)
                     and "previous backward raised" in str(e), str(e))
        train_mlp(chk, "after the failure", ddp, ref, opts, rank, world, 2, 2)
    return checked(rank, body)


def test_failed_backward_is_reported_then_training_resumes() -> None:
    assert_no_failures(spawn(2, _failed_backward_job))
