"""Shared by the ``torchring.wrap`` tests (tests/spawned/wrap/test_wrap_*.py): small models, integer-valued
data, single-process references and the comparisons, run inside spawned ranks.

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
  - A branch used only on some ranks (``BranchNet.extra``): the expected gradient is the sum of
    the using ranks' gradients divided by the world size (zero contribution from the others).

Gradients are also checked to be bit-identical across ranks (allgather), and a parameter no rank
used must keep ``.grad is None``. One spawned job runs many cases (a spawn costs ~1-2 s here).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from _checks import Checker
from _dist import session

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


def regression(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s n samples of 6 features and their 3 targets."""
    return _ints(step, 1, (n, 6)).float(), _ints(step, 2, (n, 3)).float()


def images(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n 3x6x6 images and their classes (4)."""
    return _ints(step, 3, (n, 3, 6, 6)).float(), _ints(step, 4, (n,), 0, 4)


def images_cl(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """images() in channels_last layout."""
    x, y = images(step, n)
    return x.contiguous(memory_format=torch.channels_last), y


def tokens(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n sequences of 5 token ids (< 24) and their classes (4)."""
    return _ints(step, 5, (n, 5), 0, 24), _ints(step, 6, (n,), 0, 4)


def lm_tokens(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n sequences of 4 token ids (< 16) and the next tokens."""
    return _ints(step, 7, (n, 4), 0, 16), _ints(step, 8, (n, 4), 0, 16)


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every position."""
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def shard(t: torch.Tensor, r: int) -> torch.Tensor:
    """Rank r's rows of a global batch."""
    return t[r * PER_RANK:(r + 1) * PER_RANK]


# ----------------------------------------------------------------------------------- helpers
def close(chk: Checker, what: str, got: torch.Tensor | None, want: torch.Tensor | None,
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


def grads_close(chk: Checker, what: str, model: nn.Module, ref: nn.Module, **tol: float) -> None:
    """Every parameter's .grad matches the reference model's (see close)."""
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        close(chk, f"{what}: {name}.grad", p.grad, q.grad, **tol)


def params_close(chk: Checker, what: str, model: nn.Module, ref: nn.Module, **tol: float) -> None:
    """Every parameter matches the reference model's (see close)."""
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        close(chk, f"{what}: {name}", p, q, **tol)


def same_on_all_ranks(chk: Checker, what: str, tensors: dict[str, torch.Tensor | None]) -> None:
    """Every rank holds bit-identical values (None where rank 0 has None)."""
    import torchring

    mine = {k: None if v is None else v.detach().clone() for k, v in tensors.items()}
    everyone = torchring.allgather_object(mine)
    for r, theirs in enumerate(everyone):
        for k, v in theirs.items():
            w = everyone[0][k]
            same = (v is None and w is None) or (v is not None and w is not None and torch.equal(v, w))
            chk.true(f"{what}: {k} on rank {r} vs rank 0", same, "differs")


def grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Each parameter's .grad, by name."""
    return {n: p.grad for n, p in model.named_parameters()}


def buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of each buffer, by name."""
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def bn_after(ref: nn.Module, state: dict[str, torch.Tensor], x: torch.Tensor,
             **kw: Any) -> dict[str, torch.Tensor]:
    """Buffers after one training forward of ``x`` starting from ``state`` (grads untouched)."""
    with torch.no_grad():
        for n, b in ref.named_buffers():
            b.copy_(state[n])
        was = ref.training
        ref.train()
        ref(x, **kw)
        ref.train(was)
    return buffers(ref)


def check_buckets(chk: Checker, what: str, ddp: Any, min_buckets: int, wire_bytes: int = 4) -> None:
    """bucket_stats() covers every trainable parameter once, in at least `min_buckets` buckets."""
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


def checked(rank: int, body: Callable[[Checker, int, int], None]) -> list[str]:
    """Runs ``body(chk, rank, world)`` in a torchring session; the mismatches it recorded."""
    import torchring

    with session():
        chk = Checker(rank)
        body(chk, rank, torchring.size())
        return chk.failures


def train_mlp(chk: Checker, what: str, ddp: Any, ref: nn.Module, opts: tuple, rank: int,
              world: int, first: int, steps: int) -> None:
    """Global-batch regression steps on the wrapped MLP and its single-process reference."""
    opt, ref_opt = opts
    for step in range(first, first + steps):
        x, y = regression(step, PER_RANK * world)
        opt.zero_grad()
        F.mse_loss(ddp(shard(x, rank)), shard(y, rank)).backward()
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        grads_close(chk, f"{what} step {step}", ddp.module, ref)
        same_on_all_ranks(chk, f"{what} step {step}", grads(ddp.module))
        opt.step()
        ref_opt.step()
        params_close(chk, f"{what} step {step} after SGD", ddp.module, ref)
