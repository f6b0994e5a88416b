"""hvd.DistributedOptimizer on worlds 2 and 3 against single-process references.

Every rank trains a small net on its own integer-valued batches; the reference, computed inside
each rank with plain torch, runs every member rank's batches through a copy of the net one after
the other, combines their gradients the way Horovod defines it (the sum, or the sum divided by
the set's size, a rank without a gradient adding zeros; a parameter no rank reached gets a zero
gradient) and steps a plain optimizer. Parameters must match after every step. One spawned job
per world runs every case (a spawn costs a few seconds).
"""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any, Callable

import pytest
import torch
from torch import nn

from _checks import Checker, assert_no_failures
from _dist import spawn

LR = 0.125


class Net(nn.Module):
    """fc1 -> fc2, plus `extra` (used where a rank asks for it) and `unused` (used by none)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 3)
        self.fc2 = nn.Linear(3, 2)
        self.extra = nn.Linear(3, 2)
        self.unused = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        h = self.fc1(x)
        out = self.fc2(h)
        return out + self.extra(h) if use_extra else out


def make_net() -> Net:
    net = Net()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randint(-1, 2, p.shape, generator=g).float())
    return net


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randint(-1, 2, (3, 4), generator=g).float(),
            torch.randint(-2, 3, (3, 2), generator=g).float())


def loss_of(model: nn.Module, rank: int, step: int, use_extra: bool = False) -> torch.Tensor:
    x, y = batch(rank, step)
    return ((model(x, use_extra) - y) ** 2).sum()


def reference_grads(ref: Net, ranks: list[int], steps: list[int], average: bool,
                    use_extra: Callable[[int], bool], zero_fill: bool = True) -> dict[str, Any]:
    """{name: combined gradient} over `ranks`, each running `steps` backward passes on `ref`."""
    per_rank = []
    for r in ranks:
        ref.zero_grad(set_to_none=True)
        for s in steps:
            loss_of(ref, r, s, use_extra(r)).backward()
        per_rank.append({n: None if p.grad is None else p.grad.clone() for n, p in ref.named_parameters()})
    out: dict[str, Any] = {}
    for n, p in ref.named_parameters():
        got = [g[n] for g in per_rank if g[n] is not None]
        if not got:
            out[n] = torch.zeros_like(p) if zero_fill else None
            continue
        total = torch.stack(got).sum(0)
        out[n] = total / len(ranks) if average else total
    return out


def ref_step(ref: Net, ref_opt: torch.optim.Optimizer, grads: dict[str, Any]) -> None:
    for n, p in ref.named_parameters():
        p.grad = grads[n]
    ref_opt.step()


def same_params(chk: Checker, what: str, model: nn.Module, ref: nn.Module, tol: float = 0.0) -> None:
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if tol:
            close = torch.allclose(p.detach(), q.detach(), rtol=tol, atol=tol)
            chk.true(f"{what}: {n}", close, f"{p.detach().tolist()} vs {q.detach().tolist()}")
        else:
            chk.equal(f"{what}: {n}", p.detach(), q.detach(), exact=False)


def sgd(params: Any, wd: float = 0.0) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=LR, momentum=0.5, weight_decay=wd)


# --------------------------------------------------------------------------------- cases
def case_ops(chk: Checker, hvd: Any, rank: int, world: int) -> None:
    """Average, Sum and Average with gradient_predivide_factor; a branch some ranks skip and a
    layer no rank uses (zero-filled, so weight decay moves it as under Horovod)."""
    extra = lambda r: r % 2 == 1  # noqa: E731
    for op, factor in [(hvd.Average, 1.0), (hvd.Sum, 1.0), (hvd.Average, 4.0)]:
        what = f"op={op} predivide={factor}"
        model = make_net()
        ref = copy.deepcopy(model)
        base = sgd(model.parameters(), wd=0.5)
        # A scheduler made before wrapping sets base.step; the wrapper's step must still sync.
        torch.optim.lr_scheduler.LambdaLR(base, lambda epoch: 1.0)
        opt = hvd.DistributedOptimizer(base, model.named_parameters(), op=op,
                                       gradient_predivide_factor=factor)
        ref_opt = sgd(ref.parameters(), wd=0.5)
        for step in range(3):
            opt.zero_grad()
            loss_of(model, rank, step, extra(rank)).backward()
            opt.step()
            chk.true(f"{what}: unused.weight.grad", model.unused.weight.grad is not None and
                     not model.unused.weight.grad.any(), "expected a zero gradient (zero-fill)")
            ref_step(ref, ref_opt, reference_grads(ref, list(range(world)), [step],
                                                   op == hvd.Average, extra))
            same_params(chk, f"{what} step {step}", model, ref)
        w0 = make_net().unused.weight
        chk.true(f"{what}: unused layer moved by weight decay", not torch.equal(model.unused.weight, w0))


def case_passes(chk: Checker, hvd: Any, rank: int, world: int) -> None:
    """backward_passes_per_step=2: two passes accumulate locally, one sync; a third pass before
    step() is the AssertionError; zero_grad() between backward and step() raises."""
    model = make_net()
    ref = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(sgd(model.parameters()), model.named_parameters(),
                                   backward_passes_per_step=2)
    ref_opt = sgd(ref.parameters())
    for step in range(2):
        opt.zero_grad()
        for k in range(2):
            loss_of(model, rank, 2 * step + k).backward()
        opt.step()
        ref_step(ref, ref_opt, reference_grads(ref, list(range(world)), [2 * step, 2 * step + 1],
                                               True, lambda r: False))
        same_params(chk, f"passes=2 step {step}", model, ref)
    opt.zero_grad()
    loss_of(model, rank, 9).backward()
    try:
        opt.zero_grad()
        chk.fail("zero_grad after backward", "no error")
    except AssertionError as e:
        chk.true("zero_grad text", "zero_grad()" in str(e), str(e))
    loss_of(model, rank, 10).backward()
    try:
        loss_of(model, rank, 11).backward()
        chk.fail("third backward with passes=2", "no error")
    except AssertionError as e:
        chk.true("assertion text", "backward_passes_per_step" in str(e) and "Increase" in str(e), str(e))
    opt.synchronize()  # the ranks end the sync together
    opt.zero_grad()


def case_clip(chk: Checker, hvd: Any, rank: int, world: int) -> None:
    """synchronize(); clip; step() inside skip_synchronize(): no warning, the clipped average.
    Then step() after synchronize() without it: exactly one warning, still the average."""
    model = make_net()
    ref = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(sgd(model.parameters()), model.named_parameters())
    ref_opt = sgd(ref.parameters())
    for step, skip in [(0, True), (1, False), (2, True)]:
        opt.zero_grad()
        loss_of(model, rank, step).backward()
        opt.synchronize()
        grads = reference_grads(ref, list(range(world)), [step], True, lambda r: False)
        for n, p in model.named_parameters():
            chk.equal(f"clip step {step}: synchronized {n}.grad", p.grad, grads[n], exact=False)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            if skip:
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        texts = [str(w.message) for w in ws]
        if skip:
            chk.true(f"clip step {step}: warnings", not texts, repr(texts))
        else:
            chk.true(f"clip step {step}: one warning", len(texts) == 1 and
                     "optimizer.step() called without optimizer.skip_synchronize()" in texts[0], repr(texts))
        for n, p in ref.named_parameters():
            p.grad = grads[n]
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        same_params(chk, f"clip step {step}", model, ref)


def case_compression(chk: Checker, hvd: Any, rank: int, world: int) -> None:
    """fp16 travels as float16 (half the bucket bytes) with the same result on these small
    integers; a custom Compressor is applied to each bucket and undone after."""
    calls = []

    class Quarter(hvd.Compressor):
        @staticmethod
        def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
            calls.append(tensor.dtype)
            return tensor * 0.25, 4.0

        @staticmethod
        def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
            return tensor * ctx

    for name, compression in [("fp16", hvd.Compression.fp16), ("custom", Quarter)]:
        model = make_net()
        ref = copy.deepcopy(model)
        opt = hvd.DistributedOptimizer(sgd(model.parameters()), model.named_parameters(),
                                       compression=compression)
        ref_opt = sgd(ref.parameters())
        for step in range(2):
            opt.zero_grad()
            loss_of(model, rank, step).backward()
            opt.step()
            ref_step(ref, ref_opt, reference_grads(ref, list(range(world)), [step], True, lambda r: False))
            # step 0 sends small integers (exact in float16); later steps round to 11 bits
            same_params(chk, f"{name} step {step}", model, ref, tol=4e-3 if name == "fp16" else 0.0)
            for n, p in model.named_parameters():
                chk.true(f"{name}: {n}.grad dtype", p.grad.dtype == torch.float32, str(p.grad.dtype))
        sent = sum(s["bytes"] for s in opt._hvd_sync.reducer.bucket_stats())
        numel = sum(p.numel() for p in model.parameters())
        chk.true(f"{name}: bytes sent", sent == numel * (2 if name == "fp16" else 4), f"{sent} for {numel}")
    chk.true("custom compressor called", len(calls) >= 2 and set(calls) == {torch.float32}, repr(calls))


def case_names(chk: Checker, hvd: Any, rank: int, world: int) -> None:
    """named_parameters errors; default names unique and equal on every rank; the returned
    object is the user's class; state_dict round trip."""
    model = make_net()
    other = make_net()
    both = list(model.parameters()) + list(other.parameters())
    for what, named in [("duplicates", list(model.named_parameters()) + list(other.named_parameters())),
                        ("missing", list(model.named_parameters())),
                        ("not pairs", [p for _, p in model.named_parameters()] + list(other.parameters()))]:
        try:
            hvd.DistributedOptimizer(sgd(both), named_parameters=named)
            chk.fail(f"named_parameters {what}", "no ValueError")
        except ValueError:
            pass
    groups = [{"params": list(model.fc1.parameters())}, {"params": list(model.fc2.parameters()), "lr": 0.5}]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(groups, lr=LR, momentum=0.5))
    names = sorted(opt._parameter_names.values())
    chk.true("default names", names == sorted(f"allreduce.noname.{i}.{j}" for i in range(2) for j in range(2)),
             repr(names))
    chk.true("names on every rank", hvd.allgather_object(names) == [names] * world)
    chk.true("isinstance", isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD")
    loss_of(model, rank, 0).backward()
    opt.step()
    state = copy.deepcopy(opt.state_dict())
    chk.true("state after a step", len(state["state"]) == 4 and state["param_groups"][1]["lr"] == 0.5)
    fresh = hvd.DistributedOptimizer(torch.optim.SGD(copy.deepcopy(groups), lr=1.0))
    fresh.load_state_dict(state)
    again = fresh.state_dict()
    chk.true("param_groups after load", again["param_groups"] == state["param_groups"])
    for k, v in state["state"].items():
        chk.equal(f"momentum {k} after load", again["state"][k]["momentum_buffer"], v["momentum_buffer"])


def case_groups(chk: Checker, hvd: Any, rank: int, world: int) -> None:
    """groups= fixes the buckets (threshold 0: one bucket per group) and gives the same result."""
    os.environ["HOROVOD_FUSION_THRESHOLD"] = "0"
    try:
        for groups in [2, "listed"]:
            model = make_net()
            ref = copy.deepcopy(model)
            g = [[model.fc1.weight, model.fc2.bias], [model.extra.weight]] if groups == "listed" else groups
            opt = hvd.DistributedOptimizer(sgd(model.parameters()), model.named_parameters(), groups=g)
            layout = opt._hvd_sync.reducer.layout()
            # Parameters 0-7: fc1.weight, fc1.bias, fc2.weight, fc2.bias, extra.*, unused.*.
            # Groups run in backward order (by their first-registered parameter, last first).
            if groups == 2:  # [0-3] and [4-7]
                want = [["unused.bias", "unused.weight", "extra.bias", "extra.weight"],
                        ["fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"]]
            else:  # [0, 3], [4] and every other parameter alone
                want = [["unused.bias"], ["unused.weight"], ["extra.bias"], ["extra.weight"],
                        ["fc2.weight"], ["fc1.bias"], ["fc2.bias", "fc1.weight"]]
            chk.true(f"groups={groups} layout", layout == want, repr(layout))
            ref_opt = sgd(ref.parameters())
            for step in range(2):
                opt.zero_grad()
                loss_of(model, rank, step, True).backward()
                opt.step()
                ref_step(ref, ref_opt, reference_grads(ref, list(range(world)), [step], True, lambda r: True))
                same_params(chk, f"groups={groups} step {step}", model, ref)
    finally:
        del os.environ["HOROVOD_FUSION_THRESHOLD"]


class EmbedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 3, sparse=True)
        self.fc = nn.Linear(3, 1)

    def forward(self, idx: torch.Tensor | None) -> torch.Tensor:
        h = self.fc.bias.expand(1, 1) if idx is None else self.fc(self.emb(idx)).sum(0, keepdim=True)
        return h


def case_sparse(chk: Checker, hvd: Any, rank: int, world: int) -> None:
    """nn.Embedding(sparse=True): averaged like its dense gradient, handed to the optimizer
    sparse, with and without sparse_as_dense; at step 2 rank 1 does not use the embedding."""
    def tokens(r: int, step: int) -> torch.Tensor | None:
        if step == 2 and r == 1:
            return None
        return torch.tensor([(3 * r + step) % 10, (r * r + 2 * step + 1) % 10, r % 10])

    for dense in [False, True]:
        torch.manual_seed(3)
        model = EmbedNet()
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randint(-2, 3, p.shape).float())
        ref = copy.deepcopy(model)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                       model.named_parameters(), sparse_as_dense=dense)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
        for step in range(4):
            opt.zero_grad()
            model(tokens(rank, step)).sum().backward()
            opt.step()
            if step != 2 or rank != 1:
                chk.true(f"sparse_as_dense={dense} step {step}: grad is sparse", model.emb.weight.grad.is_sparse)
            total = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
            for r in range(world):
                ref.zero_grad()
                ref(tokens(r, step)).sum().backward()
                for n, p in ref.named_parameters():
                    if p.grad is not None:
                        total[n] += p.grad.to_dense()
            ref_step(ref, ref_opt, {n: t / world for n, t in total.items()})
            same_params(chk, f"sparse_as_dense={dense} step {step}", model, ref)


def case_reinit(chk: Checker, hvd: Any, rank: int, world: int) -> None:
    """hvd.shutdown(); hvd.init() between steps (an elastic reset): the optimizer goes on."""
    model = make_net()
    ref = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(sgd(model.parameters()), model.named_parameters())
    ref_opt = sgd(ref.parameters())
    for step in range(3):
        if step == 1:
            hvd.shutdown()
            hvd.init()
        opt.zero_grad()
        loss_of(model, rank, step).backward()
        opt.step()
        ref_step(ref, ref_opt, reference_grads(ref, list(range(world)), [step], True, lambda r: False))
        same_params(chk, f"reinit step {step}", model, ref)


def case_pool(chk: Checker, hvd: Any, rank: int, world: int) -> None:
    """Fresh CPU gradients of a synchronized backward come from torchring's gradient pool (as
    under torchring.wrap): the pool is on from the first hook of a backward, so from the second
    step on the first layer's 512 KiB gradient (computed after fc2's hooks fired) is a hit."""
    from torchring._wrap import memory

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model.named_parameters())
    before = memory.grad_pool_stats()["hits"]
    for step in range(3):
        opt.zero_grad()
        model(torch.ones(2, 256) * (rank + 1)).sum().backward()
        opt.step()
    hits = memory.grad_pool_stats()["hits"] - before
    chk.true("gradient pool hits", hits >= 2, f"{hits} hits in 3 steps")


def case_process_set(chk: Checker, hvd: Any, rank: int, world: int) -> None:
    """World 3, process_set=[0, 2]: those two average; rank 1 steps on its own gradients."""
    evens = hvd.add_process_set([0, 2])
    try:
        model = make_net()
        ref = copy.deepcopy(model)
        opt = hvd.DistributedOptimizer(sgd(model.parameters()), model.named_parameters(), process_set=evens)
        chk.true("hooks only on members", (opt._hvd_sync is not None) == (rank != 1))
        ref_opt = sgd(ref.parameters())
        members = [0, 2] if rank != 1 else [1]
        for step in range(2):
            opt.zero_grad()
            loss_of(model, rank, step).backward()
            opt.step()
            ref_step(ref, ref_opt, reference_grads(ref, members, [step], True, lambda r: False,
                                                   zero_fill=rank != 1))
            same_params(chk, f"process set step {step}", model, ref)
    finally:
        hvd.remove_process_set(evens)


def _run(rank: int, world: int) -> list[str]:
    import torchring.horovod as hvd
    from torchring.horovod.optimizer import DistributedOptimizer

    if not hasattr(hvd, "DistributedOptimizer"):  # until the package re-exports it
        hvd.DistributedOptimizer = DistributedOptimizer
    chk = Checker(rank)
    hvd.init()
    try:
        cases = [case_ops, case_passes, case_clip, case_compression, case_names, case_groups,
                 case_sparse, case_reinit, case_pool]
        if world == 3:
            cases.append(case_process_set)
        for case in cases:
            case(chk, hvd, rank, world)
            hvd.barrier()  # a failing case must not leave a rank behind the others
    finally:
        hvd.shutdown()
    return chk.failures


@pytest.mark.parametrize("world", [2, 3])
def test_distributed_optimizer_matches_reference(world: int) -> None:
    assert_no_failures(spawn(world, _run, world, timeout=120))
