"""FSDP2 (``fully_shard``) on a CPU DeviceMesh over the "torchring" backend matches one process.

Each spawned rank shards one model over ``init_device_mesh("cpu", (world,))`` (all-gathers and
reduce-scatters on torchring) and trains it on its own integer-valued batches; it also trains an
unsharded copy on every rank's batches, the loss summed over ranks and divided as FSDP divides
the gradients, and compares the full parameters. The gradient reduction is exercised in each form
FSDP picks: AVG (float32), PREMUL_SUM (a custom divide factor), SUM with a division after it
(``set_force_sum_reduction_for_comms``) and SUM with pre- and post-division (float64). The trained
sharded state then goes through ``torch.distributed.checkpoint`` into a freshly sharded model.
"""

from __future__ import annotations

import copy

import pytest
import torch

from _c10d import finish, init_pg
from _checks import Checker, assert_no_failures
from _dist import spawn

STEPS = 3

# name: (parameter dtype, divide factor given to FSDP or None, force SUM reductions, the reduce op
# FSDP should then hand to reduce_scatter)
CASES = {
    "avg": (torch.float32, None, False, "AVG"),
    "premul_sum": (torch.float32, 5.0, False, "PREMUL_SUM"),
    "force_sum": (torch.float32, None, True, "SUM"),
    "float64_sum": (torch.float64, None, False, "SUM"),
}


def _batch(rank: int, step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return (torch.randint(-3, 4, (4, 6), generator=g).to(dtype), torch.randint(-2, 3, (4, 4), generator=g).to(dtype))


def _model(dtype: torch.dtype, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    # 17 rows: not a multiple of 2 or 3, so the shards are uneven (the last may be empty)
    return torch.nn.Sequential(torch.nn.Linear(6, 17), torch.nn.ReLU(), torch.nn.Linear(17, 8), torch.nn.ReLU(),
                               torch.nn.Linear(8, 4)).to(dtype)


def _shard(model: torch.nn.Module, mesh: object) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _run_case(chk: Checker, rank: int, world: int, name: str, mesh: object, ckpt: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    dtype, factor, force_sum, op = CASES[name]
    ref = _model(dtype, seed=0)
    model = _shard(copy.deepcopy(ref), mesh)
    shard = next(model.parameters())
    chk.true(f"{name}: parameters are DTensors", isinstance(shard, DTensor), f"got {type(shard).__name__}")
    for m in model.modules():  # each setter applies to its own module's parameters only
        if isinstance(m, FSDPModule):
            if factor is not None:
                m.set_gradient_divide_factor(factor)
            m.set_force_sum_reduction_for_comms(force_sum)
    ops_seen = set()
    reduce_scatter = dist.reduce_scatter_single

    def spy(*args, **kwargs):
        ops_seen.add(str(getattr(kwargs.get("op"), "op", kwargs.get("op"))).split(".")[-1])
        return reduce_scatter(*args, **kwargs)

    dist.reduce_scatter_single = spy
    divide = factor if factor is not None else world
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    for step in range(STEPS):
        x, y = _batch(rank, step, dtype)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y, reduction="sum").backward()
        opt.step()
        ref_opt.zero_grad()
        total = sum(torch.nn.functional.mse_loss(ref(bx), by, reduction="sum")
                    for bx, by in (_batch(r, step, dtype) for r in range(world)))
        (total / divide).backward()
        ref_opt.step()
    dist.reduce_scatter_single = reduce_scatter
    chk.true(f"{name}: FSDP's reduce-scatter ops", ops_seen == {op}, f"got {ops_seen}, expected {{{op!r}}}")
    got = _full(model)
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-12, 1e-12)
    for n, p in ref.named_parameters():
        try:
            torch.testing.assert_close(got[n], p.detach(), rtol=rtol, atol=atol)
        except AssertionError as e:
            chk.fail(f"{name} at world {world}: {n} vs one process", " ".join(str(e).split()))
        chk.true(f"{name}: {n} moved", not torch.equal(p.detach(), start[n]))
    # Checkpoint the sharded state, load it into a model sharded from a different init.
    path = f"{ckpt}/{name}"
    dcp.save(model.state_dict(), checkpoint_id=path)
    fresh = _shard(_model(dtype, seed=1), mesh)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state)
    for n, t in _full(fresh).items():
        chk.equal(f"{name}: {n} after dcp.save/dcp.load", t, got[n])


def _fsdp_cases(rank: int, world: int, ckpt: str) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    init_pg()
    chk = Checker(rank)
    try:
        mesh = init_device_mesh("cpu", (world,))
        for name in CASES:
            _run_case(chk, rank, world, name, mesh, ckpt)
    finally:
        finish()
    return chk.failures


@pytest.mark.parametrize("world", [2, 3])
def test_fully_shard_matches_one_process(world: int, tmp_path) -> None:
    """FSDP2 on torchring: AVG, PREMUL_SUM and SUM reductions, then a DCP round trip of the shards."""
    assert_no_failures(spawn(world, _fsdp_cases, world, str(tmp_path), timeout=150))
