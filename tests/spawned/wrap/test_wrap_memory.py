"""``torchring.wrap`` and the gradient pool (memory.py): large allocations of a wrapped backward
come from blocks kept between steps, nothing else does; a full pool evicts its oldest blocks;
TORCHRING_GRAD_POOL_MB turns it off or is rejected with a clear message.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from _dist import session, spawn
from _parity import LR, MLP, PER_RANK, regression, shard


WIDE = 512  # MLP(hidden=512): fc2.weight's gradient is 1 MiB, above the pool's 256 KiB floor


def _pool_step(ddp: Any, opt: Any, rank: int, step: int) -> None:
    x, y = regression(step, PER_RANK * _world())
    opt.zero_grad()
    F.mse_loss(ddp(shard(x, rank)), shard(y, rank)).backward()


def _world() -> int:
    import torchring
    return torchring.size()


def _pooled_count(stats: dict[str, Any]) -> int:
    return stats["hits"] + stats["misses"]


def _pool_job(rank: int) -> dict[str, Any]:
    """Steps of a wide MLP with the pool's counters after each; a no_sync step; a backward
    that raises; allocations outside backward; gradients a user hook kept from step 0."""
    import torchring
    from torchring._wrap import memory

    with session():
        torch.manual_seed(5)
        ddp = torchring.wrap(MLP(hidden=WIDE))
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)
        kept: list[torch.Tensor] = []
        hook = ddp.module.fc2.weight.register_hook(lambda g: kept.append(g))
        counters = []
        for step in range(3):
            _pool_step(ddp, opt, rank, step)
            counters.append(memory.grad_pool_stats())
            if step == 0:
                hook.remove()
                kept_copy = kept[0].clone()
        with ddp.no_sync():  # a micro-step of gradient accumulation
            _pool_step(ddp, opt, rank, 3)
        counters.append(memory.grad_pool_stats())

        before = memory.grad_pool_stats()
        outside = torch.ones(1 << 20)  # 4 MiB after backward: torch's own allocator
        after_outside = memory.grad_pool_stats()
        del outside

        def fail(grad: torch.Tensor) -> None:
            raise RuntimeError("hook failed on purpose")
        failing = ddp.module.fc1.weight.register_hook(fail)
        x, y = regression(4, PER_RANK * torchring.size())
        try:
            F.mse_loss(ddp(shard(x, rank)), shard(y, rank)).backward()
            raised = False
        except RuntimeError:
            raised = True
        failing.remove()
        after_failure = memory.grad_pool_stats()
        big = torch.ones(1 << 20)  # after a failed backward: still torch's own allocator
        after_big = memory.grad_pool_stats()
        del big
        grad_bytes = sum(p.numel() * 4 for p in ddp.parameters())
        limits = [after_big["limit_bytes"]]
        wrapper = weakref.ref(ddp)
        del ddp, opt, failing, hook
        gc.collect()  # the wrapped model is gone: the pool keeps nothing
        limits.append(memory.grad_pool_stats()["limit_bytes"])
        return dict(counters=counters, outside=_pooled_count(after_outside) - _pooled_count(before),
                    limits=limits, grad_bytes=grad_bytes, collected=wrapper() is None, raised=raised,
                    after_failure=_pooled_count(after_big) - _pooled_count(after_failure),
                    kept_intact=torch.equal(kept[0], kept_copy), kept_len=len(kept))


def test_gradient_pool_serves_backward_only() -> None:
    """Large allocations of a wrapped backward (synchronized or no_sync) reuse the pool's blocks
    from step 1 on; nothing outside backward is pooled, also after a backward that raised; a
    gradient a user kept is never handed out again."""
    for rank, got in enumerate(spawn(2, _pool_job)):
        c = got["counters"]
        assert c[0]["installed"], f"rank {rank}: pool not installed: {c[0]}"
        assert c[0]["misses"] > 0, f"rank {rank}: step 0 mapped no blocks: {c[0]}"
        # From step 1 on the same sizes come back: hits grow, no new blocks are mapped.
        assert c[2]["hits"] > c[1]["hits"] > c[0]["hits"], f"rank {rank}: no reuse: {c}"
        assert c[2]["misses"] == c[1]["misses"], f"rank {rank}: step 2 still mapped new blocks: {c}"
        assert c[3]["hits"] > c[2]["hits"], f"rank {rank}: a no_sync backward did not use the pool: {c}"
        assert all(x["active_tasks"] == 0 for x in c), f"rank {rank}: a backward stayed registered: {c}"
        assert got["outside"] == 0, f"rank {rank}: an allocation after backward was pooled: {got}"
        assert got["raised"] and got["after_failure"] == 0, (
            f"rank {rank}: allocations after a failed backward were pooled: {got}")
        assert got["kept_len"] == 1 and got["kept_intact"], (
            f"rank {rank}: a gradient kept from step 0 changed after later steps: {got}")
        assert got["collected"], f"rank {rank}: a dropped wrapper was never garbage-collected"
        slack = 64 << 20
        assert got["limits"] == [got["grad_bytes"] + slack, 0], (
            f"rank {rank}: the pool's limit does not follow the live wrapped models: {got['limits']}")


def _pool_churn_job(rank: int) -> list[dict[str, Any]]:
    """With an 8 MiB pool, step 0's backward also frees two 4 MiB blocks of a size that never
    comes back, before fc2's 1 MiB gradient returns to the pool."""
    import torchring
    from torchring._wrap import memory

    with session():
        torch.manual_seed(6)
        ddp = torchring.wrap(MLP(hidden=WIDE))
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)
        churn = [True]

        def stale_blocks(grad: torch.Tensor) -> None:  # runs after fc3's backward, before fc2's
            if churn[0]:
                blocks = [torch.ones(1 << 20) for _ in range(2)]
                del blocks
        def on_fc3_input(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            inputs[0].register_hook(stale_blocks)
        ddp.module.fc3.register_forward_hook(on_fc3_input)
        counters = []
        for step in range(3):
            _pool_step(ddp, opt, rank, step)
            churn[0] = False
            counters.append(memory.grad_pool_stats())
        return counters


def test_gradient_pool_evicts_sizes_that_stop_recurring() -> None:
    """A full cache makes room by unmapping its oldest blocks, so the gradient that comes back
    every step stays cached (and is not mapped afresh every step)."""
    for rank, c in enumerate(spawn(1, _pool_churn_job, env={"TORCHRING_GRAD_POOL_MB": "8"})):
        assert c[0]["limit_bytes"] == 8 << 20 and c[0]["evicted"] > 0, f"rank {rank}: {c[0]}"
        assert c[2]["misses"] == c[1]["misses"] and c[2]["hits"] > c[1]["hits"], (
            f"rank {rank}: the recurring gradient was mapped afresh in step 2: {c}")
        assert all(x["cached_bytes"] <= x["limit_bytes"] for x in c), f"rank {rank}: over limit: {c}"


def _pool_off_job(rank: int) -> dict[str, Any]:
    import torchring
    from torchring._wrap import memory

    with session():
        ddp = torchring.wrap(MLP(hidden=WIDE))
        x, y = regression(0, PER_RANK)
        F.mse_loss(ddp(x), y).backward()
        return memory.grad_pool_stats()


def _pool_bad_setting_job(rank: int) -> str:
    """The setting is rejected before any collective: by init() or by wrap()."""
    import torchring

    try:
        with session():
            torchring.wrap(MLP(hidden=WIDE))
    except ValueError as e:
        return str(e)
    return "no error"


def test_gradient_pool_can_be_turned_off_and_checks_its_setting() -> None:
    for off in ("0", "off"):
        stats = spawn(1, _pool_off_job, env={"TORCHRING_GRAD_POOL_MB": off})[0]
        assert not stats["installed"] and stats["hits"] == stats["misses"] == 0, (off, stats)
    message = spawn(1, _pool_bad_setting_job, env={"TORCHRING_GRAD_POOL_MB": "-5"})[0]
    assert "rank 0" in message and "TORCHRING_GRAD_POOL_MB='-5'" in message, message
