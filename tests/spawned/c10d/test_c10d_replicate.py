"""FSDP2's ``replicate()`` and ``fully_shard`` on the "torchring" backend train as on gloo.

``replicate`` here is the FSDP2-based one, ``torch.distributed._composable.replicate_with_fsdp``
(torch's successor to DDP; ``torch.distributed._composable.replicate`` is the older DDP-based
one). In each spawned rank the default group is torchring and a second group of every rank is
gloo; every case builds two copies of one model (the same seed on every rank: FSDP2 does not
broadcast rank 0's parameters as DDP does), applies the API per Linear and at the root, once on a
1-D mesh over the torchring group and once on a mesh over the gloo group, trains both for STEPS
SGD steps on the same integer-valued per-rank batches and compares each step's loss and the final
full parameters. At world 2 every reduction adds two numbers and halves the sum exactly, the same
whichever backend does it, so losses and parameters must be bitwise equal; at world 3 the backends
may add in different orders, so they must agree within rtol 1e-5. A spy on ``dist.all_reduce``
and ``dist.reduce_scatter_single`` checks which op FSDP2 sent to which backend; each case also
checks that training moved every parameter and that every rank holds the same parameters.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from _c10d import compare, finish, init_pg
from _checks import Checker, assert_no_failures
from _dist import spawn

STEPS = 4
RTOL = 1e-5

# name: (API, parameter dtype, mixed-precision param dtype or None, force SUM reductions, the op
# FSDP2 should send: all_reduce for replicate, reduce_scatter_single for fully_shard)
CASES = {
    "replicate": ("replicate", torch.float32, None, False, "AVG"),
    "replicate_force_sum": ("replicate", torch.float32, None, True, "SUM"),
    "replicate_float64": ("replicate", torch.float64, None, False, "SUM"),
    "replicate_bf16_params": ("replicate", torch.float32, torch.bfloat16, False, "AVG"),
    "fully_shard": ("fully_shard", torch.float32, None, False, "AVG"),
    "fully_shard_float64": ("fully_shard", torch.float64, None, False, "SUM"),
}


def _batch(rank: int, step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch for ``step``: small integers, different on every rank."""
    g = torch.Generator().manual_seed(100 * rank + step)
    return (torch.randint(-3, 4, (4, 6), generator=g).to(dtype), torch.randint(-2, 3, (4, 4), generator=g).to(dtype))


def _model(dtype: torch.dtype) -> torch.nn.Module:
    """A small MLP, the same on every rank; 17 rows make fully_shard's shards uneven."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 17), torch.nn.ReLU(), torch.nn.Linear(17, 8), torch.nn.ReLU(),
                               torch.nn.Linear(8, 4)).to(dtype)


def _apply(api: str, model: torch.nn.Module, mesh: Any, mp_dtype: torch.dtype | None,
           force_sum: bool) -> torch.nn.Module:
    """``replicate`` or ``fully_shard`` on each Linear, then on the root, over ``mesh``."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    fn = replicate if api == "replicate" else fully_shard
    kw = {} if mp_dtype is None else dict(mp_policy=MixedPrecisionPolicy(param_dtype=mp_dtype,
                                                                         reduce_dtype=torch.float32))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fn(layer, mesh=mesh, **kw)
    fn(model, mesh=mesh, **kw)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(force_sum)
    return model


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's full parameters (a replicated DTensor's local copy, a sharded one gathered)."""
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _train(model: torch.nn.Module, rank: int, dtype: torch.dtype, ops: list[tuple[str, str]]) -> torch.Tensor:
    """STEPS SGD steps on this rank's batches; the losses, and in ``ops`` what went to which backend."""
    import torch.distributed as dist

    spied = {name: getattr(dist, name) for name in ("all_reduce", "reduce_scatter_single")}

    def spy(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            op = str(getattr(kwargs.get("op"), "op", kwargs.get("op"))).split(".")[-1]
            ops.append((name, op, dist.get_backend(kwargs.get("group"))))
            return spied[name](*args, **kwargs)
        return call

    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    losses = []
    try:
        for name in spied:
            setattr(dist, name, spy(name))
        for step in range(STEPS):
            x, y = _batch(rank, step, dtype)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y, reduction="sum")
            loss.backward()
            opt.step()
            losses.append(loss.detach().to(torch.float64))
    finally:
        for name, fn in spied.items():
            setattr(dist, name, fn)
    return torch.stack(losses)


def _run_case(chk: Checker, rank: int, world: int, name: str, gloo: Any) -> None:
    """One case: the API over torchring and over gloo, losses and parameters compared."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    api, dtype, mp_dtype, force_sum, op = CASES[name]
    what = f"{name} at world {world}"
    ref = _model(dtype)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    meshes = {"torchring": init_device_mesh("cpu", (world,)), "gloo": DeviceMesh.from_group(gloo, "cpu")}
    losses, params = {}, {}
    for backend, mesh in meshes.items():
        model = _apply(api, copy.deepcopy(ref), mesh, mp_dtype, force_sum)
        ops: list[tuple[str, str]] = []
        losses[backend] = _train(model, rank, dtype, ops)
        params[backend] = _full(model)
        collective = "all_reduce" if api == "replicate" else "reduce_scatter_single"
        want = {(collective, op, backend)}
        chk.true(f"{what}: {backend} run's gradient reductions", set(ops) == want, f"got {set(ops)}, expected {want}")
    exact = world == 2
    compare(chk, f"{what}: losses per step, torchring vs gloo", {"loss": losses["torchring"]},
            {"loss": losses["gloo"]}, exact=exact, rtol=RTOL, atol=0)
    compare(chk, f"{what}: parameters, torchring vs gloo", params["torchring"], params["gloo"], exact=exact,
            rtol=RTOL, atol=1e-6 if dtype == torch.float32 else 1e-12)
    for n, p in params["torchring"].items():
        chk.true(f"{what}: {n} moved", not torch.equal(p, start[n]))
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, params["torchring"], group=gloo)
    for r in range(world):
        compare(chk, f"{what}: rank {r}'s torchring parameters", everyone[r], params["torchring"], exact=True)


def _cases(rank: int, world: int, names: list[str]) -> list[str]:
    """In a rank: the torchring default group, a gloo group, every case in ``names``."""
    import torch.distributed as dist

    init_pg()
    chk = Checker(rank)
    try:
        gloo = dist.new_group(backend="gloo")
        for name in names:
            _run_case(chk, rank, world, name, gloo)
    finally:
        finish()
    return chk.failures


@pytest.mark.parametrize("world", [2, 3])
def test_replicate_and_fully_shard_match_gloo(world: int) -> None:
    """FSDP2 replicate() and fully_shard on torchring: gloo's losses and parameters (bitwise at world 2)."""
    assert_no_failures(spawn(world, _cases, world, list(CASES), timeout=150))
