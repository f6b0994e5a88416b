"""DistributedDataParallel on the "torchring" backend trains to the same parameters as on gloo.

In each spawned rank the default group is torchring and a second group of every rank is gloo
(``dist.new_group(backend="gloo")``); every case trains two copies of one model, one under DDP on
each group, on the same integer-valued per-rank batches, and compares them. At world 2 an
allreduce adds two numbers, the same whichever backend adds them, so the parameters must be
bitwise equal; at world 3 the backends may add in different orders, so they must agree to within
a few float32 roundings, far below what one step moves them. Each case also checks that training
moved the parameters and that every rank holds the same torchring parameters. The cases include
DDP's communication hooks: fp16 and bf16 compression and PowerSGD.

PowerSGD's hook runs unchanged: its Future callbacks start collectives and wait for them, which
the backend's completer serves with another thread (test_future_callback_may_wait_for_a_collective
shows it on a bare ``fut.then``).

The Lightning test (``Trainer.fit`` with ``DDPStrategy(process_group_backend="torchring")`` against
the same fit on gloo) needs Lightning, which the ``test`` extra installs.
"""

from __future__ import annotations

import copy

import pytest
import torch

from _c10d import compare, finish, init_pg, moved, state_of
from _checks import Checker, assert_no_failures
from _dist import spawn

STEPS = 4


def _batch(rank: int, step: int, rows: int = 6, cols: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch for ``step``: small integers as float32, different on every rank."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randint(-3, 4, (rows, cols), generator=g).float()
    y = torch.randint(-2, 3, (rows, 3), generator=g).float()
    return x, y


class _Branchy(torch.nn.Module):
    """A body and two heads; head b takes part when ``use_b``, head ``never`` (if made) never does."""

    def __init__(self, norm: bool = False, never: bool = False) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8) if norm else torch.nn.Identity(),
                                        torch.nn.ReLU())
        self.a = torch.nn.Linear(8, 3)
        self.b = torch.nn.Linear(8, 3)
        self.never = torch.nn.Linear(8, 3) if never else None  # no gradient, on any rank
        self.use_b = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.a(h) + (self.b(h) if self.use_b else 0)


# Each case: DDP's keyword arguments, and what the model and the training loop do differently.
CASES = {
    "plain": dict(ddp=dict(bucket_cap_mb=0.0005)),  # several buckets, so several allreduces per step
    "buffers": dict(norm=True, ddp=dict(broadcast_buffers=True)),
    "find_unused": dict(never=True, switch_b=True, ddp=dict(find_unused_parameters=True)),
    "static_graph": dict(never=True, ddp=dict(static_graph=True)),
    # At world 3 the hooks' half-precision sums round differently: torchring adds the three in
    # float32 and rounds once, gloo adds pairwise in half precision (in an order that depends on
    # the element's chunk of its ring), rounding twice: a few units in the last place of the
    # gradient (fp16 2**-11, bf16 2**-8), times the lr. At world 2 both round a + b once.
    "fp16_hook": dict(hook="fp16", atol=2e-4),
    "bf16_hook": dict(hook="bf16", atol=1.5e-3),
    # PowerSGD (rank 1, a fixed seed): 2 steps of plain allreduce, then 4 compressed ones (P and
    # Q allreduced, error feedback, warm start). Every weight here compresses: (rows + cols) * 2 <
    # rows * cols. At world 3 an ulp of difference in P or Q passes through the orthogonalization
    # and the product P Q^T, a relative error of a few float32 roundings: the default rtol 1e-5.
    "powersgd": dict(hook="powersgd", steps=6),
    "no_sync": dict(no_sync=True, ddp=dict(gradient_as_bucket_view=True)),
    "join": dict(join=True, norm=True),
}


def _train(case: dict, ddp: torch.nn.Module, model: _Branchy, rank: int) -> None:
    """STEPS SGD steps on this rank's batches (with Join: 2 more per rank, so rank 0 joins first)."""
    from torch.distributed.algorithms.join import Join

    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.5)
    steps = case.get("steps", STEPS) + (2 * rank if case.get("join") else 0)

    def step(s: int) -> None:
        # find_unused: head b is used on alternate ranks each step (at world 3 sometimes by none)
        model.use_b = not case.get("switch_b") or (rank + s) % 2 == 0
        opt.zero_grad()
        if case.get("no_sync"):
            with ddp.no_sync():  # two micro-batches accumulate locally, the third syncs all three
                for micro in range(2):
                    x, y = _batch(rank, 100 * s + micro)
                    torch.nn.functional.mse_loss(ddp(x), y).backward()
        x, y = _batch(rank, s)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()

    with Join([ddp], enable=bool(case.get("join"))):
        for s in range(steps):
            step(s)


def _bf16_hook(group, bucket):  # no annotations: DDP checks them, and this module's are strings
    """bf16_compress_hook under another name: DDP refuses that name unless torch has CUDA and NCCL."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(group, bucket)


def _hook(name: str, group: object) -> tuple[object, object]:
    """The comm hook ``name`` of CASES and its state for ``group`` (None: the default group)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "fp16":
        return group, default_hooks.fp16_compress_hook
    if name == "bf16":
        return group, _bf16_hook
    state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                        random_seed=0)
    # (batched_powerSGD_hook is left out: in torch 2.13 it hands a 2-D Q to _orthogonalize, which
    # asserts 3-D, on any backend)
    return state, powerSGD_hook.powerSGD_hook


def _run_case(rank: int, world: int, name: str, gloo: object, chk: Checker) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    case = CASES[name]
    torch.manual_seed(rank)  # different on every rank: DDP must start all from rank 0's
    model = _Branchy(norm=case.get("norm", False), never=case.get("never", False))
    twin = copy.deepcopy(model)
    start = {}
    runs = {}
    for backend, m, group in [("torchring", model, None), ("gloo", twin, gloo)]:
        ddp = DDP(m, process_group=group, **case.get("ddp", {}))
        if case.get("hook"):
            state, hook = _hook(case["hook"], group)
            ddp.register_comm_hook(state, hook)
        start[backend] = state_of(m)
        _train(case, ddp, m, rank)
        runs[backend] = state_of(m)
        if case.get("hook") == "powersgd":  # P and Q exist once a step compressed
            chk.true(f"{name} on {backend}: PowerSGD compressed", bool(state.p_memory_dict), f"iter {state.iter}")
    what = f"{name} at world {world}"
    compare(chk, f"{what}: start (rank 0's broadcast)", start["torchring"], start["gloo"], exact=True)
    atol = case.get("atol", 1e-6)
    compare(chk, f"{what}: torchring vs gloo", runs["torchring"], runs["gloo"], exact=world == 2,
            rtol=0 if "atol" in case else 1e-5, atol=atol)
    step = max(float((runs["torchring"][n] - start["torchring"][n]).abs().max()) for n in start["torchring"])
    chk.true(f"{what}: training moved some parameter by 20x the tolerance", step > 20 * atol, f"at most {step}")
    # body.0.bias feeds a BatchNorm, which cancels it: its gradient is zero.
    changed = [n for n in start["torchring"] if not n.startswith("never.")
               and not (case.get("norm") and n == "body.0.bias")]
    moved(chk, what, start["torchring"], runs["torchring"], changed)
    for n in start["torchring"]:
        if n.startswith("never."):
            chk.equal(f"{what}: {n} (never used) unchanged", runs["torchring"][n], start["torchring"][n])
    # Parameters are equal on every rank; buffers are not (each rank's last forward updated its own).
    params = {n: runs["torchring"][n] for n, _ in model.named_parameters()}
    everyone = [None] * world
    dist.all_gather_object(everyone, params, group=gloo)
    for r in range(world):
        compare(chk, f"{what}: rank {r}'s torchring parameters", everyone[r], params, exact=True)


def _ddp_cases(rank: int, world: int, names: list[str]) -> list[str]:
    import torch.distributed as dist

    init_pg()
    chk = Checker(rank)
    try:
        gloo = dist.new_group(backend="gloo")
        for name in names:
            _run_case(rank, world, name, gloo, chk)
    finally:
        finish()
    return chk.failures


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_matches_gloo(world: int) -> None:
    """Every DDP feature of CASES on torchring reaches gloo's parameters (bitwise at world 2)."""
    assert_no_failures(spawn(world, _ddp_cases, world, list(CASES), timeout=150))


def _callback_waits(rank: int, world: int) -> list[str]:
    """A Future callback that starts an allreduce and waits for it: on gloo, then on torchring."""
    import time

    import torch.distributed as dist

    init_pg()
    chk = Checker(rank)
    try:
        gloo = dist.new_group(backend="gloo")
        for backend, group in [("gloo", gloo), ("torchring", None)]:
            def then(fut: torch.futures.Future, group: object = group) -> torch.Tensor:
                second = torch.full((3,), float(rank + 1))
                return dist.all_reduce(second, group=group, async_op=True).get_future().wait()[0]

            if rank == 1:
                time.sleep(0.5)  # rank 0's first allreduce is still running when it attaches the callback
            first = torch.full((1000,), float(rank))
            got = dist.all_reduce(first, group=group, async_op=True).get_future().then(then).wait()
            chk.equal(f"{backend}: the first allreduce", first, torch.full((1000,), world * (world - 1) / 2))
            chk.equal(f"{backend}: the callback's allreduce", got, torch.full((3,), world * (world + 1) / 2))
    finally:
        finish()
    return chk.failures


def test_future_callback_may_wait_for_a_collective() -> None:
    """fut.then(callback) where the callback waits for a new allreduce, as PowerSGD's hooks do (gloo: fine)."""
    assert_no_failures(spawn(2, _callback_waits, 2, timeout=30))


# ---------------------------------------------------------------------------------------------
# Lightning


def _lightning_fit(rank: int, backend: str) -> dict[str, torch.Tensor]:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    import torchring  # noqa: F401 - registers the backend before the strategy sets up

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    torch.manual_seed(rank)  # DDP starts every rank from rank 0's weights
    xs, ys = zip(*(_batch(r, s) for s in range(3) for r in range(2)))
    data = torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    trainer = pl.Trainer(strategy=DDPStrategy(process_group_backend=backend), accelerator="cpu", devices=2,
                         max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    module = Module()
    start = state_of(module)
    trainer.fit(module, loader)
    import torch.distributed as dist

    got = dist.get_backend()
    finish()
    # numpy arrays: torch.multiprocessing (imported by Lightning) would send tensors as shared
    # memory that dies with this process
    return {"backend": got, "start": {k: v.numpy() for k, v in start.items()},
            **{k: v.numpy() for k, v in state_of(module).items()}}


def test_lightning_ddp_strategy_matches_gloo() -> None:
    """Trainer.fit with DDPStrategy(process_group_backend="torchring") ends at gloo's weights."""
    pytest.importorskip("lightning", reason="Lightning is in the test extra: pip install -e '.[test]'")
    runs = {b: spawn(2, _lightning_fit, b, timeout=150) for b in ("torchring", "gloo")}
    chk = Checker(-1)
    start = {k: torch.from_numpy(v) for k, v in runs["torchring"][0]["start"].items()}  # rank 0's init
    final = []
    for rank in range(2):
        ring, gloo = dict(runs["torchring"][rank]), dict(runs["gloo"][rank])
        backends = (ring.pop("backend"), gloo.pop("backend"))
        ring.pop("start"), gloo.pop("start")
        chk.true(f"rank {rank}: the process groups' backends", backends == ("torchring", "gloo"), f"got {backends}")
        ring, gloo = ({k: torch.from_numpy(v) for k, v in d.items()} for d in (ring, gloo))
        compare(chk, f"rank {rank}: Lightning fit, torchring vs gloo", ring, gloo, exact=True)
        moved(chk, f"rank {rank}: Lightning fit", start, ring)
        final.append(ring)
    compare(chk, "Lightning fit on torchring: rank 1 vs rank 0", final[1], final[0], exact=True)
    assert_no_failures([chk.failures])
