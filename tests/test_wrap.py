"""``torchring.wrap(model)``: gradient parity with one process, accumulation, freezing, precision,
buffers, checkpoints and the consistency check, on worlds 1-4.

Every reference is computed inside the rank function with plain torch on one process:

* **Global batch.** Step ``k`` draws one global batch of ``PER_RANK * world`` samples (small
  integers, the same on every rank); rank r trains on rows ``[r*PER_RANK, (r+1)*PER_RANK)`` with a
  mean loss, and a deep copy of the unwrapped model trains on the whole batch with a mean loss.
  Equal shards make the average of the ranks' means the global mean, so ``.grad`` and the SGD
  parameters must match after every step.
* **Per-shard.** Where the forward pass legitimately depends on the rank's own batch, the
  reference loss is ``mean_r loss(model(shard_r))`` computed on the one process, whose gradient
  is exactly "the average of what each rank computed locally":
  - BatchNorm in *training* mode normalizes with the statistics of the batch it sees, so a
    per-rank batch of 4 and the global batch give different gradients; we do not use SyncBN, so
    we compare with the per-shard reference. The running statistics are checked separately:
    before each training forward every rank holds rank 0's buffers (broadcast_buffers=True),
    so after it rank r holds "rank 0's previous buffers updated by shard r" (recomputed here).
    The channels_last CNN instead runs BatchNorm in ``eval()`` mode (fixed statistics) and is
    compared with the global batch.
  - A branch used only on odd ranks (``BranchNet.extra``): the expected gradient is the sum of
    the using ranks' gradients divided by the world size (zero contribution from the others).

Gradients are also checked to be bit-identical across ranks (allgather), and a parameter no rank
used must keep ``.grad is None``. One spawned job runs many cases (a spawn costs ~1-2 s here).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import dataclasses
import io
import weakref
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _checks import Checker, assert_no_failures
from _dist import run_alone, spawn

PER_RANK = 4    # samples per rank per step
STEPS = 3
LR = 0.05
# ~314-byte buckets (first ~104 bytes): several buckets even for these tiny models.
SMALL = dict(bucket_cap_mb=0.0003, first_bucket_mb=0.0001)
RTOL, ATOL = 1e-5, 1e-5   # float32 parity (atol is scaled by the tensor's largest magnitude)


# ------------------------------------------------------------------------------------ models
class MLP(nn.Module):
    def __init__(self, d_in: int = 6, hidden: int = 16, d_out: int = 3, bn: bool = False) -> None:
        super().__init__()
        self.hidden_size = hidden
        self.fc1 = nn.Linear(d_in, hidden)
        self.bn = nn.BatchNorm1d(hidden) if bn else nn.Identity()
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, d_out)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.fc2(F.relu(self.bn(self.fc1(x)))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.features(x))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 8, 3, stride=2)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv1(x)))
        x = F.relu(self.conv2(x))
        return self.fc(x.mean((2, 3)))


class EmbedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(24, 8)   # dense gradients (sparse=False)
        self.fc = nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(ids).mean(1))


class TiedLM(nn.Module):
    """The embedding and the output projection share one Parameter (used twice per forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.mix = nn.Linear(8, 8)
        self.out = nn.Linear(8, 16, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.emb(ids))))


class BranchNet(nn.Module):
    """``extra`` only runs when asked (odd ranks); ``never`` is unused on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)
        self.extra = nn.Linear(6, 3)
        self.never = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        out = self.head(F.relu(self.body(x)))
        if use_extra:
            out = out + self.extra(x)
        return out


class Pair(nn.Module):
    """For the consistency check: fc1, an optional extra layer, fc2."""

    def __init__(self, out: int = 3, extra: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 6)
        if extra:
            self.extra = nn.Linear(6, 6)
        self.fc2 = nn.Linear(6, out)


# -------------------------------------------------------------------------------------- data
def _ints(step: int, salt: int, shape: tuple[int, ...], lo: int = -2, hi: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + step)
    return torch.randint(lo, hi, shape, generator=g)


def _regression(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _ints(step, 1, (n, 6)).float(), _ints(step, 2, (n, 3)).float()


def _images(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _ints(step, 3, (n, 3, 6, 6)).float(), _ints(step, 4, (n,), 0, 4)


def _images_cl(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _images(step, n)
    return x.contiguous(memory_format=torch.channels_last), y


def _tokens(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _ints(step, 5, (n, 5), 0, 24), _ints(step, 6, (n,), 0, 4)


def _lm_tokens(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _ints(step, 7, (n, 4), 0, 16), _ints(step, 8, (n, 4), 0, 16)


def _lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _shard(t: torch.Tensor, r: int) -> torch.Tensor:
    return t[r * PER_RANK:(r + 1) * PER_RANK]


# ----------------------------------------------------------------------------------- helpers
def _close(chk: Checker, what: str, got: torch.Tensor | None, want: torch.Tensor | None,
           rtol: float = RTOL, atol: float = ATOL) -> None:
    """``got`` matches ``want`` (atol scaled by max|want|); both None also matches."""
    if want is None or got is None:
        chk.true(what, got is None and want is None,
                 f"got {'None' if got is None else 'a tensor'}, expected "
                 f"{'None' if want is None else 'a tensor'}")
        return
    scale = max(1.0, float(want.detach().abs().max())) if want.numel() else 1.0
    try:
        torch.testing.assert_close(got.detach(), want.detach(), rtol=rtol, atol=atol * scale)
    except AssertionError as e:
        chk.fail(what, " ".join(str(e).split()))


def _grads_close(chk: Checker, what: str, model: nn.Module, ref: nn.Module, **tol: float) -> None:
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        _close(chk, f"{what}: {name}.grad", p.grad, q.grad, **tol)


def _params_close(chk: Checker, what: str, model: nn.Module, ref: nn.Module, **tol: float) -> None:
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        _close(chk, f"{what}: {name}", p, q, **tol)


def _same_on_all_ranks(chk: Checker, what: str, tensors: dict[str, torch.Tensor | None]) -> None:
    """Every rank holds bit-identical values (None where rank 0 has None)."""
    import torchring

    mine = {k: None if v is None else v.detach().clone() for k, v in tensors.items()}
    everyone = torchring.allgather_object(mine)
    for r, theirs in enumerate(everyone):
        for k, v in theirs.items():
            w = everyone[0][k]
            same = (v is None and w is None) or (v is not None and w is not None and torch.equal(v, w))
            chk.true(f"{what}: {k} on rank {r} vs rank 0", same, "differs")


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: p.grad for n, p in model.named_parameters()}


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def _bn_after(ref: nn.Module, state: dict[str, torch.Tensor], x: torch.Tensor,
              **kw: Any) -> dict[str, torch.Tensor]:
    """Buffers after one training forward of ``x`` starting from ``state`` (grads untouched)."""
    with torch.no_grad():
        for n, b in ref.named_buffers():
            b.copy_(state[n])
        was = ref.training
        ref.train()
        ref(x, **kw)
        ref.train(was)
    return _buffers(ref)


def _check_buckets(chk: Checker, what: str, ddp: Any, min_buckets: int, wire_bytes: int = 4) -> None:
    stats = ddp.bucket_stats()
    trainable = [p for p in ddp.module.parameters() if p.requires_grad]
    chk.true(f"{what}: number of buckets", len(stats) >= min_buckets,
             f"{len(stats)} buckets, expected at least {min_buckets}: {stats}")
    chk.true(f"{what}: bucket bytes", all(s["bytes"] > 0 for s in stats), f"{stats}")
    total = sum(p.numel() for p in trainable) * wire_bytes
    chk.true(f"{what}: bucket bytes add up", sum(s["bytes"] for s in stats) == total,
             f"sum {sum(s['bytes'] for s in stats)}, expected {total}")
    chk.true(f"{what}: bucket params add up", sum(s["params"] for s in stats) == len(trainable),
             f"sum {sum(s['params'] for s in stats)}, expected {len(trainable)}")


def _session(rank: int, body: Callable[[Checker, int, int], None]) -> list[str]:
    import torchring

    torchring.init()
    try:
        chk = Checker(rank)
        body(chk, rank, torchring.size())
        return chk.failures
    finally:
        torchring.shutdown()


# -------------------------------------------------------------------------------- parity core
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
        Case("mlp", MLP, _regression, mse),
        # fc2's 512x512 gradient (1 MiB) comes from the gradient pool (256 KiB and up).
        Case("wide mlp (pooled gradients)", lambda: MLP(hidden=512), _regression, mse),
        Case("mlp small buckets, zero_grad(set_to_none=False)", MLP, _regression, mse, SMALL,
             set_to_none=False, min_buckets=3),
        Case("cnn+batchnorm (train mode, per-shard stats)", CNN, _images, ce, SMALL, per_shard=True,
             check_buffers=True, min_buckets=3),
        Case("channels_last cnn (eval-mode batchnorm)",
             lambda: CNN().to(memory_format=torch.channels_last), _images_cl, ce, SMALL, eval=True,
             channels_last=True, min_buckets=3, set_to_none=False),
        Case("embedding", EmbedNet, _tokens, ce, SMALL, min_buckets=2),
        Case("tied weights", TiedLM, _lm_tokens, _lm_loss, SMALL, min_buckets=2, set_to_none=False),
        Case("branch on odd ranks + never-used layer", BranchNet, _regression, mse, SMALL,
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
    chain = _buffers(ref)  # rank 0's buffers at the start of the step
    for step in range(steps):
        what = f"{case.name} (world {world}) step {step}"
        x, y = case.batch(step, PER_RANK * world)
        opt.zero_grad(set_to_none=case.set_to_none)
        loss = case.loss(ddp(_shard(x, rank), **case.rank_kwargs(rank)), _shard(y, rank))
        loss.backward()

        ref_opt.zero_grad(set_to_none=case.set_to_none)
        if case.per_shard:
            ref_loss = sum(case.loss(ref(_shard(x, r), **case.rank_kwargs(r)), _shard(y, r))
                           for r in range(world)) / world
        else:
            ref_loss = case.loss(ref(x), y)
        ref_loss.backward()

        _grads_close(chk, what, ddp.module, ref)
        _same_on_all_ranks(chk, what + " grads", _grads(ddp.module))
        _check_buckets(chk, what, ddp, case.min_buckets)
        if case.channels_last:
            for name, p in ddp.module.named_parameters():
                if p.dim() == 4:
                    chk.true(f"{what}: {name}.grad strides", p.grad.stride() == p.stride(),
                             f"grad {p.grad.stride()} vs param {p.stride()}")
        if case.check_buffers:
            want = _bn_after(ref, chain, _shard(x, rank), **case.rank_kwargs(rank))
            for name, b in ddp.module.named_buffers():
                _close(chk, f"{what}: buffer {name} (rank 0's, updated by this rank's shard)", b,
                       want[name])
            chain = _bn_after(ref, chain, _shard(x, 0), **case.rank_kwargs(0))
        opt.step()
        ref_opt.step()
        _params_close(chk, what + " after SGD", ddp.module, ref)
        _same_on_all_ranks(chk, what + " params", dict(ddp.module.named_parameters()))
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
    return _session(rank, body)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_parity(world: int) -> None:
    """MLP, BN CNN, channels_last CNN, embedding, tied weights, rank-dependent branch."""
    assert_no_failures(spawn(world, _parity_job))


# ------------------------------------------------------------------------------ accumulation
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
            x, y = _regression(10 * rnd + k, PER_RANK * world)
            xs, ys = _shard(x, rank), _shard(y, rank)
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
                _grads_close(chk, what + " (accumulated global)", ddp.module, ref)
                _same_on_all_ranks(chk, what, _grads(ddp.module))
            else:
                _grads_close(chk, what + " (local only, no communication)", ddp.module, local)
        opt.step()
        ref_opt.step()
        _params_close(chk, f"{mode} round {rnd} after SGD", ddp.module, ref)
    _check_buckets(chk, mode, ddp, 3)


def _accumulation_job(rank: int) -> list[str]:
    def body(chk: Checker, rank: int, world: int) -> None:
        for mode in ("no_sync", "flag", "no_sync(enabled=cond)"):
            _accumulate(chk, rank, world, mode)
    return _session(rank, body)


def test_no_sync_accumulation() -> None:
    """no_sync(), require_backward_grad_sync=False/True and no_sync(enabled=cond) accumulate."""
    assert_no_failures(spawn(3, _accumulation_job))


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
            x, y = _regression(k, PER_RANK * world)
            with ddp.no_sync() if local_only else contextlib.nullcontext():
                F.mse_loss(ddp(_shard(x, rank), use_extra=uses_extra(rank)), _shard(y, rank)).backward()
            (sum(F.mse_loss(ref(_shard(x, r), use_extra=uses_extra(r)), _shard(y, r))
                 for r in range(world)) / world).backward()
        _grads_close(chk, "after the synced step", model, ref)
        _same_on_all_ranks(chk, "after the synced step", _grads(model))
    return _session(rank, body)


def test_no_sync_param_used_only_in_micro_steps() -> None:
    """Expected extra.grad = rank 1's accumulated grad / world on every rank (DDP keeps the
    used-map across no_sync iterations)."""
    assert_no_failures(spawn(2, _nosync_branch_job))


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
            x, y = _regression(step, PER_RANK * world)
            probe = _regression(100 + step, 2)[0]
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
            out = ddp(_shard(x, rank))
            if rank == 0:  # a train-mode no_grad forward between forward and backward
                with torch.no_grad():
                    ddp(probe)
            F.mse_loss(out, _shard(y, rank)).backward()
            if rank == world - 1:  # a validation pass on the last rank only
                ddp.eval()
                with torch.no_grad():
                    ddp(probe)
                ddp.train()
            ref_opt.zero_grad()
            (sum(F.mse_loss(ref(_shard(x, r)), _shard(y, r)) for r in range(world)) / world).backward()
            _grads_close(chk, what, model, ref)
            _same_on_all_ranks(chk, what, _grads(model))
            opt.step()
            ref_opt.step()
            _params_close(chk, what + " after SGD", model, ref)
    return _session(rank, body)


def test_inference_on_some_ranks_does_not_hang() -> None:
    assert_no_failures(spawn(3, _inference_job, timeout=90))


# ----------------------------------------------------------------------------------- freezing
def _train_mlp(chk: Checker, what: str, ddp: Any, ref: nn.Module, opts: tuple, rank: int,
               world: int, first: int, steps: int) -> None:
    """Global-batch regression steps on the wrapped MLP and its single-process reference."""
    opt, ref_opt = opts
    for step in range(first, first + steps):
        x, y = _regression(step, PER_RANK * world)
        opt.zero_grad()
        F.mse_loss(ddp(_shard(x, rank)), _shard(y, rank)).backward()
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        _grads_close(chk, f"{what} step {step}", ddp.module, ref)
        _same_on_all_ranks(chk, f"{what} step {step}", _grads(ddp.module))
        opt.step()
        ref_opt.step()
        _params_close(chk, f"{what} step {step} after SGD", ddp.module, ref)


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
        _train_mlp(chk, "fc2.weight frozen right after wrap", ddp, ref, opts, rank, world, 0, STEPS)
        chk.true("frozen fc2.weight.grad", model.fc2.weight.grad is None, "is not None")
        chk.equal("frozen fc2.weight unchanged", model.fc2.weight.detach(), frozen)
    return _session(rank, body)


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
        _train_mlp(chk, "fc1.weight frozen at wrap", ddp, ref, opts, rank, world, 0, 2)
        chk.true("fc1.weight.grad while frozen", model.fc1.weight.grad is None, "is not None")
        for m in (model, ref):
            m.fc1.weight.requires_grad_(True)
        _train_mlp(chk, "fc1.weight unfrozen", ddp, ref, opts, rank, world, 2, 3)
        chk.true("fc1.weight.grad after unfreezing", model.fc1.weight.grad is not None, "is None")
        _check_buckets(chk, "after unfreezing", ddp, 3)
        for m in (model, ref):  # frozen after the buckets were rebuilt
            m.fc3.bias.requires_grad_(False)
        bias = model.fc3.bias.detach().clone()
        _train_mlp(chk, "fc3.bias frozen later", ddp, ref, opts, rank, world, 5, 2)
        chk.true("fc3.bias.grad after freezing", model.fc3.bias.grad is None, "is not None")
        chk.equal("frozen fc3.bias unchanged", model.fc3.bias.detach(), bias)
    return _session(rank, body)


def test_unfrozen_later_and_frozen_later() -> None:
    assert_no_failures(spawn(2, _unfreeze_job))


# ---------------------------------------------------------------------------------- precision
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
            x, y = _regression(step, PER_RANK * world)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = ddp(_shard(x, rank))
            chk.true(f"{what}: autocast output dtype", out.dtype == torch.bfloat16, f"{out.dtype}")
            scaler.scale(F.mse_loss(out.float(), _shard(y, rank))).backward()
            scale = scaler.get_scale()
            for name, p in model.named_parameters():
                chk.true(f"{what}: {name}.grad finite float32", p.grad is not None and p.grad.dtype ==
                         torch.float32 and bool(torch.isfinite(p.grad).all()), f"{p.grad}")
            _same_on_all_ranks(chk, what, _grads(model))
            ref.load_state_dict(model.state_dict())
            ref.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                ref_out = ref(x)
            (F.mse_loss(ref_out.float(), y) * scale).backward()
            _grads_close(chk, what, model, ref, rtol=2e-2, atol=2e-2)
            scaler.step(opt)
            scaler.update()
            _same_on_all_ranks(chk, what + " params", dict(model.named_parameters()))

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
                x, y = _regression(step, PER_RANK * world)
                opt.zero_grad()
                F.mse_loss(ddp(_shard(x, rank)), _shard(y, rank)).backward()
                ref.load_state_dict(model.state_dict())
                ref.zero_grad()
                F.mse_loss(ref(x), y).backward()
                _grads_close(chk, what, model, ref, rtol=1e-2, atol=1e-2)
                _same_on_all_ranks(chk, what, _grads(model))
                _check_buckets(chk, what, ddp, 3, wire_bytes=2)
                opt.step()
            _same_on_all_ranks(chk, f"compression={comp} params", dict(model.named_parameters()))

        for kwargs in ({"compression": "fp8"}, {"compression": "int8"}, {"compression": 16},
                       {"bucket_cap_mb": 0}, {"first_bucket_mb": -1.0}):
            try:
                torchring.wrap(MLP(), **kwargs)
            except ValueError as e:
                key = next(iter(kwargs))
                chk.true(f"wrap(**{kwargs}) message", key.split("_")[0] in str(e), str(e))
            else:
                chk.fail(f"wrap(**{kwargs})", "did not raise ValueError")
    return _session(rank, body)


def test_autocast_and_compression() -> None:
    assert_no_failures(spawn(2, _precision_job))


# ------------------------------------------------------------------- state, buffers, wrap-time
def _state_job(rank: int) -> list[str]:
    import torchring

    def body(chk: Checker, rank: int, world: int) -> None:
        # parameters and buffers come from rank 0 at wrap, whatever each rank initialized
        torch.manual_seed(100 + rank)
        mine = CNN()
        torch.manual_seed(100)
        want = CNN()
        for m, r in ((mine, rank), (want, 0)):
            with torch.no_grad():
                m.bn.running_mean.fill_(r + 1.0)
                m.bn.running_var.fill_(r + 2.0)
                m.bn.num_batches_tracked.fill_(r)
        if rank:
            chk.true("ranks initialize differently before wrap",
                     not torch.equal(mine.conv1.weight, want.conv1.weight), "same weights")
        ddp = torchring.wrap(mine)
        for k, v in want.state_dict().items():
            chk.equal(f"after wrap, {k} is rank 0's", ddp.state_dict()[k], v)

        # the wrapper: .module, attributes and methods of the inner model, state_dict keys
        torch.manual_seed(3)
        inner = MLP(bn=True)
        ddp = torchring.wrap(inner)
        probe = _regression(99, 4)[0]
        chk.true(".module", ddp.module is inner, f"{type(ddp.module)}")
        chk.true(".hidden_size through the wrapper", getattr(ddp, "hidden_size", None) == 16, "")
        with torch.no_grad():
            chk.equal(".features() through the wrapper", ddp.features(probe), inner.features(probe))
        keys = list(MLP(bn=True).state_dict())
        chk.true("state_dict keys", list(ddp.state_dict()) == keys, f"{list(ddp.state_dict())} vs {keys}")
        for k, v in inner.state_dict().items():
            chk.equal(f"state_dict()[{k}]", ddp.state_dict()[k], v)

        # checkpoint: wrapped -> plain -> wrapped, and a resumed run repeats the original exactly
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)

        def train(first: int, steps: int) -> None:
            for step in range(first, first + steps):
                x, y = _regression(step, PER_RANK * world)
                opt.zero_grad()
                F.mse_loss(ddp(_shard(x, rank)), _shard(y, rank)).backward()
                opt.step()

        train(0, 2)
        buf = io.BytesIO()
        torch.save(ddp.state_dict(), buf)
        plain = MLP(bn=True)
        buf.seek(0)
        plain.load_state_dict(torch.load(buf))
        ddp.eval()
        plain.eval()
        with torch.no_grad():
            chk.equal("plain model loaded from the wrapped checkpoint", plain(probe), ddp(probe))
        ddp.train()
        train(2, 2)
        after = {k: v.clone() for k, v in ddp.state_dict().items()}
        buf.seek(0)
        ddp.load_state_dict(torch.load(buf))
        ddp.eval()
        with torch.no_grad():
            chk.equal("wrapped model reloaded from the checkpoint", ddp(probe), plain(probe))
        ddp.train()
        train(2, 2)
        for k, v in ddp.state_dict().items():
            chk.equal(f"resumed run, {k}", v, after[k])

        # buffers: with broadcast_buffers every training forward starts from rank 0's buffers
        for bb in (True, False):
            torch.manual_seed(4)
            inner = MLP(bn=True)
            ddp = torchring.wrap(inner, broadcast_buffers=bb)
            pre: list[dict[str, torch.Tensor]] = []
            post: list[dict[str, torch.Tensor]] = []
            hook = inner.register_forward_pre_hook(lambda mod, args: pre.append(_buffers(mod)))
            for step in range(3):
                x, y = _regression(step, PER_RANK * world)
                out = ddp(_shard(x, rank))
                post.append(_buffers(inner))
                F.mse_loss(out, _shard(y, rank)).backward()
            hook.remove()
            everyone = torchring.allgather_object((pre, post))
            for step in range(3):
                for name, got in pre[step].items():
                    if bb:
                        src = "rank 0's buffers before the forward"
                        want_b = everyone[0][0][0][name] if step == 0 else everyone[0][1][step - 1][name]
                    else:
                        src = "this rank's own buffers"
                        want_b = pre[0][name] if step == 0 else post[step - 1][name]
                    chk.equal(f"broadcast_buffers={bb} step {step}: {name} at forward is {src}", got,
                              want_b)
            if not bb and world > 1:
                last = [post_r[2]["bn.running_mean"] for _, post_r in everyone[:2]]
                chk.true("broadcast_buffers=False: running stats stay per rank",
                         not torch.equal(last[0], last[1]), "ranks ended with identical statistics")
    return _session(rank, body)


def test_state_dict_attributes_and_buffers() -> None:
    assert_no_failures(spawn(2, _state_job))


# ------------------------------------------------------------------------- consistency check
def _mismatch_job(rank: int, variant: str) -> str:
    import torchring

    torchring.init()
    try:
        if variant == "out_features":
            model = Pair(out=4 if rank == 1 else 3)
        else:
            model = Pair(extra=rank == 2)
        torchring.wrap(model)
        return "wrapped"
    finally:
        torchring.shutdown()


@pytest.mark.parametrize("variant,world,bad_rank,param", [("out_features", 2, 1, "fc2.weight"),
                                                          ("extra_layer", 3, 2, "extra.weight")])
def test_model_mismatch(variant: str, world: int, bad_rank: int, param: str) -> None:
    """Every rank raises TorchringError naming the first differing parameter and the ranks."""
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


# ------------------------------------------------------------------------------- before init
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


def _checkpointed(rank: int) -> list[str]:
    """Reentrant activation checkpointing: parity, and one sync per backward (not per segment)."""
    import torch.utils.checkpoint as cp
    import torchring
    torchring.init()
    try:
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
        launch = torchring.collectives.allreduce_async
        torchring.collectives.allreduce_async = lambda t, op: (ops.append(op.name), launch(t, op))[1]
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
    finally:
        torchring.shutdown()


def test_reentrant_checkpointing_syncs_once_per_backward() -> None:
    for failures in spawn(2, _checkpointed):
        assert failures == []


# ------------------------------------------------------------------------- gradient pool
WIDE = 512  # MLP(hidden=512): fc2.weight's gradient is 1 MiB, above the pool's 256 KiB floor


def _pool_step(ddp: Any, opt: Any, rank: int, step: int) -> None:
    x, y = _regression(step, PER_RANK * _world())
    opt.zero_grad()
    F.mse_loss(ddp(_shard(x, rank)), _shard(y, rank)).backward()


def _world() -> int:
    import torchring
    return torchring.size()


def _pooled_count(stats: dict[str, Any]) -> int:
    return stats["hits"] + stats["misses"]


def _pool_job(rank: int) -> dict[str, Any]:
    """Steps of a wide MLP with the pool's counters after each; a no_sync step; a backward
    that raises; allocations outside backward; gradients a user hook kept from step 0."""
    import torchring
    from torchring import memory

    torchring.init()
    try:
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

        def fail(grad: torch.Tensor) -> None:
            raise RuntimeError("hook failed on purpose")
        failing = ddp.module.fc1.weight.register_hook(fail)
        x, y = _regression(4, PER_RANK * torchring.size())
        try:
            F.mse_loss(ddp(_shard(x, rank)), _shard(y, rank)).backward()
            raised = False
        except RuntimeError:
            raised = True
        failing.remove()
        after_failure = memory.grad_pool_stats()
        big = torch.ones(1 << 20)  # after a failed backward: still torch's own allocator
        after_big = memory.grad_pool_stats()
        grad_bytes = sum(p.numel() * 4 for p in ddp.parameters())
        limits = [after_big["limit_bytes"]]
        wrapper = weakref.ref(ddp)
        del ddp, opt, failing, hook
        gc.collect()  # the wrapped model is gone: the pool keeps nothing
        limits.append(memory.grad_pool_stats()["limit_bytes"])
        return dict(counters=counters, outside=_pooled_count(after_outside) - _pooled_count(before),
                    limits=limits, grad_bytes=grad_bytes, collected=wrapper() is None,
                    outside_sum=float(outside.sum()), raised=raised,
                    after_failure=_pooled_count(after_big) - _pooled_count(after_failure),
                    big_sum=float(big.sum()), kept_intact=torch.equal(kept[0], kept_copy),
                    kept_len=len(kept))
    finally:
        torchring.shutdown()


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
        assert got["outside"] == 0 and got["outside_sum"] == float(1 << 20), got
        assert got["raised"] and got["after_failure"] == 0 and got["big_sum"] == float(1 << 20), (
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
    from torchring import memory

    torchring.init()
    try:
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
    finally:
        torchring.shutdown()


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
    from torchring import memory

    torchring.init()
    try:
        ddp = torchring.wrap(MLP(hidden=WIDE))
        x, y = _regression(0, PER_RANK)
        F.mse_loss(ddp(x), y).backward()
        return memory.grad_pool_stats()
    finally:
        torchring.shutdown()


def _pool_bad_setting_job(rank: int) -> str:
    import torchring

    torchring.init()
    try:
        torchring.wrap(MLP(hidden=WIDE))
        return "no error"
    except ValueError as e:
        return str(e)
    finally:
        torchring.shutdown()


def test_gradient_pool_can_be_turned_off_and_checks_its_setting() -> None:
    for off in ("0", "off"):
        stats = spawn(1, _pool_off_job, env={"TORCHRING_GRAD_POOL_MB": off})[0]
        assert not stats["installed"] and stats["hits"] == stats["misses"] == 0, (off, stats)
    message = spawn(1, _pool_bad_setting_job, env={"TORCHRING_GRAD_POOL_MB": "-5"})[0]
    assert "rank 0" in message and "TORCHRING_GRAD_POOL_MB='-5'" in message, message


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
        _train_mlp(chk, "before the failure", ddp, ref, opts, rank, world, 0, 1)

        def fail(grad: torch.Tensor) -> None:
            raise ValueError("hook failed on purpose")
        handle = model.fc1.weight.register_hook(fail)
        x, y = _regression(1, PER_RANK * world)
        try:
            F.mse_loss(ddp(_shard(x, rank)), _shard(y, rank)).backward()
            chk.fail("failing backward", "did not raise")
        except ValueError:
            pass
        handle.remove()
        try:
            ddp(_shard(x, rank))
            chk.fail("forward after a failed backward", "did not raise")
        except torchring.TorchringError as e:
            chk.true("forward after a failed backward: message", f"rank {rank}" in str(e)
                     and "previous backward raised" in str(e), str(e))
        _train_mlp(chk, "after the failure", ddp, ref, opts, rank, world, 2, 2)
    return _session(rank, body)


def test_failed_backward_is_reported_then_training_resumes() -> None:
    assert_no_failures(spawn(2, _failed_backward_job))
