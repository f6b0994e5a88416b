"""hvd.broadcast_parameters, broadcast_optimizer_state, broadcast_object and allgather_object on
spawned ranks.

Every rank starts from different, integer-valued tensors and options; after the call each rank
compares what it holds with the root's, gathered through torchring's own allgather_object (not
the functions under test). broadcast_optimizer_state is run on every torch.optim optimizer that
takes a model's parameters.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from _dist import spawn


def _hvd() -> tuple[Any, Any, Any]:
    from torchring.horovod import functions, process_sets, runtime
    runtime.init()
    return functions, process_sets, runtime


def _same(a: Any, b: Any) -> str | None:
    """Why `a` and `b` differ (values or Python types, recursively), or None."""
    if type(a) is not type(b):
        return f"type {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        ok = a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
        return None if ok else f"tensor {a} != {b}"
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"keys {list(a)} != {list(b)}"
        for k in a:
            why = _same(a[k], b[k])
            if why:
                return f"[{k!r}]: {why}"
        return None
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            why = _same(x, y)
            if why:
                return f"[{i}]: {why}"
        return None
    return None if a == b else f"{a!r} != {b!r}"


def _objects_and_parameters(rank: int) -> None:
    import torchring
    functions, process_sets, runtime = _hvd()
    world = torchring.size()
    try:
        # broadcast_parameters: a state_dict (sorted by key), a list of tensors, a list of pairs
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        with torch.no_grad():
            for i, t in enumerate(model.state_dict().values()):
                t.copy_(torch.arange(t.numel()).reshape(t.shape) * (rank + 1) + i)
        root_values = [t.clone() for t in torchring.broadcast_object(model.state_dict(), 1).values()]
        functions.broadcast_parameters(model.state_dict(), root_rank=1)
        for got, want in zip(model.state_dict().values(), root_values):
            assert torch.equal(got, want), (got, want)

        plain = [torch.full((5,), float(rank)), torch.arange(6.).reshape(2, 3).t() * (rank + 1)]
        assert not plain[1].is_contiguous()
        functions.broadcast_parameters(plain, root_rank=2)
        assert torch.equal(plain[0], torch.full((5,), 2.))
        assert torch.equal(plain[1], torch.arange(6.).reshape(2, 3).t() * 3)
        pairs = [("b", torch.tensor([rank, rank], dtype=torch.int32)), ("a", torch.tensor(float(rank))),
                 ("empty", torch.zeros(0))]
        functions.broadcast_parameters(pairs, root_rank=0)
        assert pairs[0][1].tolist() == [0, 0] and pairs[1][1].item() == 0.0
        tied = torch.full((3,), float(rank))  # one tensor under two names (tied weights)
        functions.broadcast_parameters({"in": tied, "out": tied}, root_rank=1)
        assert tied.tolist() == [1.0] * 3

        # broadcast_object: the root's object, also within a process set (root: a world rank)
        obj = {"hello": 123, 0: [1, 2], "rank": rank} if rank == 2 else {}
        assert functions.broadcast_object(obj, root_rank=2) == {"hello": 123, 0: [1, 2], "rank": 2}
        tail = process_sets.add_process_set([1, 2])
        if rank in (1, 2):
            got = functions.broadcast_object(("from", rank), root_rank=2, process_set=tail)
            assert got == ("from", 2) and type(got) is tuple
            gathered = functions.allgather_object({"r": rank} | ({"x": 42} if rank == 1 else {}),
                                                  process_set=tail)
            assert gathered == [{"r": 1, "x": 42}, {"r": 2}], gathered
        else:
            with pytest.raises(ValueError, match="rank 0 is not in"):
                functions.broadcast_object(1, root_rank=1, process_set=tail)

        # allgather_object over the world: one entry per rank, sizes differ
        got = functions.allgather_object(list(range(rank * 3)))
        assert got == [list(range(r * 3)) for r in range(world)], got

        # errors every rank raises alike, before any collective
        with pytest.raises(ValueError, match="root_rank must be a world rank"):
            functions.broadcast_object(1, root_rank=world)
        if rank in (1, 2):
            with pytest.raises(ValueError, match="root_rank must be a world rank"):
                functions.broadcast_object(1, root_rank=0, process_set=tail)
        with pytest.raises(ValueError, match="invalid params of type"):
            functions.broadcast_parameters(torch.zeros(3), root_rank=0)
        with pytest.raises(ValueError, match="is of type int, not a tensor"):
            functions.broadcast_parameters({"w": 3}, root_rank=0)
        assert functions.broadcast_object("still in step", root_rank=0) == "still in step"
    finally:
        runtime.shutdown()


def test_parameters_and_objects_reach_every_rank() -> None:
    spawn(3, _objects_and_parameters)


# --- optimizers ----------------------------------------------------------------------------

def _optimizer_classes() -> list[type]:
    """Every torch.optim optimizer constructed from a model's parameters, by name."""
    skip = {torch.optim.LBFGS}  # rejected by design (tested below)
    muon = getattr(torch.optim, "Muon", None)
    if muon is not None:
        skip.add(muon)  # torch >= 2.9: takes 2-D parameters only, so no model with biases
    return sorted((c for c in torch.optim.Optimizer.__subclasses__()
                   if c.__module__.startswith("torch.optim") and c not in skip),
                  key=lambda c: c.__name__)


# Options differ per rank; only those a class accepts are passed. Tuples, ints and bools must
# reach the other ranks as tuples, ints and bools.
_OPTIONS = [dict(lr=0.125, momentum=0.5, weight_decay=0.25, nesterov=True, betas=(0.5, 0.75),
                 etas=(0.5, 1.5), step_sizes=(1e-6, 50), centered=True, amsgrad=True, lr_decay=0.0),
            dict(lr=0.25, momentum=0.75, weight_decay=0.5, nesterov=False, betas=(0.25, 0.5),
                 etas=(0.25, 1.75), step_sizes=(1e-7, 5), centered=False, amsgrad=False, lr_decay=0.5)]


def _model(cls: type, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    if cls is torch.optim.SparseAdam:  # sparse gradients only: an embedding
        return torch.nn.Embedding(6, 3, sparse=True)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def _make(cls: type, rank: int, model: torch.nn.Module) -> torch.optim.Optimizer:
    accepted = inspect.signature(cls.__init__).parameters
    opts = {k: v for k, v in _OPTIONS[rank % 2].items() if k in accepted}
    if "nesterov" in opts and "momentum" not in opts:
        opts.pop("nesterov")
    return cls(model.parameters(), **opts)


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int) -> None:
    opt.zero_grad()
    if isinstance(model, torch.nn.Embedding):
        loss = model(torch.tensor([rank, rank + 2])).sum()
    else:
        loss = model(torch.arange(8.).reshape(2, 4) * (rank + 1)).square().sum()
    loss.backward()
    opt.step()


def _optimizers(rank: int) -> None:
    import torchring
    functions, _, runtime = _hvd()
    root = 1
    try:
        for cls in _optimizer_classes():
            # trained on every rank (each its own data and options), then the root's state
            model = _model(cls, seed=rank)
            opt = _make(cls, rank, model)
            _train_step(model, opt, rank)
            functions.broadcast_optimizer_state(opt, root_rank=root, model=model)
            states = torchring.allgather_object(opt.state_dict())
            why = _same(states[rank], states[root])
            assert why is None, f"{cls.__name__}: rank {rank}'s state differs from the root's: {why}"
            _train_step(model, opt, rank)  # options and state work for further steps

            # fresh on every rank but the root: the root's state and options are adopted
            model = _model(cls, seed=rank)
            opt = _make(cls, rank, model)
            if rank == root:
                _train_step(model, opt, rank)
            functions.broadcast_optimizer_state(opt, root_rank=root, model=model)
            states = torchring.allgather_object(opt.state_dict())
            why = _same(states[rank], states[root])
            assert why is None, f"{cls.__name__} (fresh): rank {rank} differs from the root: {why}"
            assert len(states[rank]["state"]) == len(states[root]["state"]) > 0 or \
                cls is torch.optim.SGD
    finally:
        runtime.shutdown()


def test_every_optimizer_takes_the_roots_state_and_options() -> None:
    spawn(2, _optimizers, timeout=240)


def _fresh_and_errors(rank: int) -> None:
    import torchring
    functions, _, runtime = _hvd()
    try:
        # Fresh everywhere: state created by a zero-gradient step that leaves the parameters
        # alone (weight decay would otherwise move them); gradients stay zero, as in Horovod.
        model = torch.nn.Linear(3, 2)
        frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
        before = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.SGD([*model.parameters(), frozen], lr=0.5, momentum=0.9, weight_decay=0.5)
        functions.broadcast_optimizer_state(opt, root_rank=0)
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())
        assert frozen.grad is None and frozen not in opt.state
        assert all("momentum_buffer" in opt.state[p] for p in model.parameters())

        # A DistributedOptimizer is initialized with its base class's step: only rank 1 has
        # no state here, so a step that reduced gradients would wait for rank 0 for ever.
        from torchring.horovod.optimizer import DistributedOptimizer
        model = torch.nn.Linear(3, 2)
        opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters())
        if rank == 0:  # state from a checkpoint, as after a resume on the root only
            plain = torch.optim.Adam(model.parameters(), lr=0.5)
            for p in model.parameters():  # (no backward: opt's hooks would reduce gradients)
                p.grad = torch.ones_like(p)
            plain.step()
            opt.load_state_dict(plain.state_dict())
        functions.broadcast_optimizer_state(opt, root_rank=0)
        states = torchring.allgather_object(opt.state_dict())
        assert _same(states[1], states[0]) is None and len(states[1]["state"]) == 2

        # A stateless optimizer still gets the root's options.
        opt = torch.optim.SGD(model.parameters(), lr=float(rank + 1))
        functions.broadcast_optimizer_state(opt, root_rank=1)
        assert opt.param_groups[0]["lr"] == 2.0 and not opt.state

        # L-BFGS is refused, on every rank, before any collective.
        with pytest.raises(ValueError, match="LBFGS"):
            functions.broadcast_optimizer_state(torch.optim.LBFGS(model.parameters()), 0)

        # Different models: every rank raises, naming the rank that differs; the next call works.
        other = torch.nn.Linear(3, 2 + rank)
        opt = torch.optim.Adam(other.parameters())
        with pytest.raises(ValueError, match=r"ranks \[1\] have optimizers unlike root rank 0"):
            functions.broadcast_optimizer_state(opt, root_rank=0)
        assert torchring.broadcast_object(rank, 1) == 1
    finally:
        runtime.shutdown()


def test_fresh_state_and_refusals() -> None:
    spawn(2, _fresh_and_errors)
