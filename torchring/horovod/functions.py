"""Horovod's state helpers: broadcast a model's parameters, an optimizer's state, any object.

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    config = hvd.broadcast_object(config, root_rank=0)
    metrics = hvd.allgather_object({"loss": loss})      # one entry per rank

Every rank of the process set calls these together and in the same order, so they run as direct
torchring collectives on the set's ``.group`` (no name negotiation); ``name=`` is accepted for
Horovod's signatures. ``root_rank`` is a world rank. Objects are pickled (with cloudpickle when it
is installed, so lambdas and local classes travel too, as in Horovod).
"""

from __future__ import annotations

import pickle
from typing import Any, Iterable

import torch

from .._core.types import DTYPES
from . import basics
from .exceptions import raised_as_horovod
from .process_sets import ProcessSet, global_process_set

try:  # Horovod pickles with cloudpickle; use it when the user has it
    import cloudpickle as _pickler
except ImportError:  # pragma: no cover - depends on the environment
    _pickler = pickle

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
           "allgather_object"]


def _group_of(process_set: ProcessSet, what: str) -> Any:
    """The torchring group of `process_set`, or a clear error when this rank cannot use it."""
    me = basics.rank()
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"rank {me}: hvd.{what}: process_set must be an hvd.ProcessSet, got "
                        f"{type(process_set).__name__}")
    if process_set.group is None:
        raise ValueError(f"rank {me}: hvd.{what}: {process_set} is not registered; pass it to "
                         "hvd.init(process_sets=...) or hvd.add_process_set() first")
    if me not in (process_set.ranks or ()):
        raise ValueError(f"rank {me}: hvd.{what}: rank {me} is not in {process_set}; call it only "
                         "on the set's ranks (process_set.included() says)")
    return process_set.group


def _group_root(process_set: ProcessSet, root_rank: Any, what: str) -> int:
    """The group rank of world rank `root_rank`, which must be a member of the set."""
    ranks = process_set.ranks or []
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or root_rank not in ranks:
        raise ValueError(f"rank {basics.rank()}: hvd.{what}: root_rank must be a world rank of "
                         f"{process_set}, got {root_rank!r}")
    return ranks.index(root_rank)


def _dumps(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(_pickler.dumps(obj)), dtype=torch.uint8)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Returns the root rank's `obj` (pickled, then broadcast) on every rank of `process_set`."""
    group = _group_of(process_set, "broadcast_object")
    src = _group_root(process_set, root_rank, "broadcast_object")
    mine = group.rank() == src
    payload = _dumps(obj) if mine else None
    length = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64)
    with raised_as_horovod():
        group.broadcast(length, src)
        if payload is None:
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
        if payload.numel():
            group.broadcast(payload, src)
    return obj if mine else pickle.loads(payload.numpy().tobytes())


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Returns the list of every member's `obj` (pickled), indexed by rank within `process_set`."""
    group = _group_of(process_set, "allgather_object")
    payload = _dumps(obj)
    with raised_as_horovod():
        lengths = group.allgather(torch.tensor([payload.numel()], dtype=torch.int64)).tolist()
        data = group.allgather(payload).numpy().tobytes()
    out, start = [], 0
    for n in lengths:
        out.append(pickle.loads(data[start:start + n]))
        start += n
    return out


def _named_tensors(params: Any) -> list[tuple[Any, torch.Tensor]]:
    """`params` as (name, tensor) pairs: a dict sorted by key, or a list of tensors or pairs."""
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, (str, bytes, torch.Tensor)) or not isinstance(params, Iterable):
        raise ValueError(f"invalid params of type: {type(params)}; pass a dict (model.state_dict()) "
                         "or a list of tensors or (name, tensor) pairs (list(model.named_parameters()))")
    else:
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    for i, (name, t) in enumerate(items):
        if not isinstance(t, torch.Tensor):
            what = f"{name!r}" if name is not None else f"item {i}"
            raise ValueError(f"rank {basics.rank()}: hvd.broadcast_parameters: {what} is of type "
                             f"{type(t).__name__}, not a tensor")
    return items


def _broadcast_tensors(tensors: list[torch.Tensor], src: int, group: Any) -> None:
    """Broadcasts each tensor in place from group rank `src`, all in flight at once."""
    handles, copies, seen = [], [], set()
    for t in tensors:
        if t.numel() == 0:
            continue
        key = (t.data_ptr(), t.numel(), t.dtype, t.device)
        if key in seen:  # tied weights: one broadcast fills every alias
            continue
        seen.add(key)
        wire = t.detach()
        if t.is_complex():
            wire = torch.view_as_real(wire)
        if not wire.is_contiguous():
            wire = wire.contiguous()
            copies.append((t, wire))
        handles.append(group.broadcast_async(wire, src))
    with raised_as_horovod():
        for h in handles:
            h.wait()
    with torch.no_grad():
        for t, wire in copies:
            t.copy_(torch.view_as_complex(wire) if t.is_complex() else wire)


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Overwrites `params` (a dict or a list of tensors or (name, tensor) pairs) in place with the
    root rank's values on every rank."""
    items = _named_tensors(params)
    group = _group_of(global_process_set, "broadcast_parameters")
    src = _group_root(global_process_set, root_rank, "broadcast_parameters")
    _broadcast_tensors([t for _, t in items], src, group)


# --- optimizer state -------------------------------------------------------------------------

def _base_step(optimizer: torch.optim.Optimizer) -> None:
    """step() of the user's optimizer class, skipping a DistributedOptimizer's (which would
    reduce gradients and so need every rank to step together)."""
    for cls in type(optimizer).__mro__:
        if not cls.__module__.startswith(__package__ + "."):
            cls.step(optimizer)
            return


def _initialize_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None) -> None:
    """Creates the state of a fresh optimizer with one step on zero gradients, as Horovod does
    (the gradients stay zero), but leaves the parameters as they were: weight decay would
    otherwise move them on the ranks that took this step and not on the others."""
    sparse = set()
    if model is not None:
        for m in model.modules():
            if isinstance(m, torch.nn.Embedding) and m.sparse:
                sparse.update(id(p) for p in m.parameters())
    trained = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    for p in trained:
        p.grad = torch.zeros_like(p)
        if isinstance(optimizer, torch.optim.SparseAdam) or id(p) in sparse:
            p.grad = p.grad.to_sparse()
    before = [p.detach().clone() for p in trained]
    _base_step(optimizer)
    with torch.no_grad():
        for p, value in zip(trained, before):
            p.copy_(value)


def _wire_ok(value: torch.Tensor) -> bool:
    """Whether a state tensor can be broadcast in place (else it travels pickled)."""
    return value.layout == torch.strided and (value.dtype in DTYPES or value.is_complex())


def _layout(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The root's description of its optimizer: options, parameter shapes, state entries."""
    options, shapes, state = [], [], []
    for group in optimizer.param_groups:
        options.append({k: v for k, v in group.items() if k != "params"})
        shapes.append([tuple(p.shape) for p in group["params"]])
        for p in group["params"]:
            entries = None
            if p in optimizer.state and optimizer.state[p]:
                entries = []
                for key, value in optimizer.state[p].items():
                    if isinstance(value, torch.Tensor) and _wire_ok(value):
                        entries.append(("tensor", key, tuple(value.shape), value.dtype,
                                        value.device == p.device))
                    else:  # Python scalars and tuples keep their types through pickle
                        entries.append(("value", key, value))
            state.append(entries)
    return {"options": options, "shapes": shapes, "state": state}


def _mismatch(optimizer: torch.optim.Optimizer, layout: dict[str, Any]) -> str | None:
    """Why this rank's optimizer cannot take the root's state, or None."""
    mine = [[tuple(p.shape) for p in g["params"]] for g in optimizer.param_groups]
    if mine == layout["shapes"]:
        return None
    return (f"the root has {len(layout['shapes'])} param groups of parameter shapes "
            f"{layout['shapes']}, this rank {len(mine)} of {mine}")


def _adopt(optimizer: torch.optim.Optimizer, layout: dict[str, Any]) -> list[torch.Tensor]:
    """Makes this rank's state mirror the root's layout; returns the tensors to broadcast into."""
    for group, options in zip(optimizer.param_groups, layout["options"]):
        group.update(options)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    tensors = []
    for p, entries in zip(params, layout["state"]):
        if entries is None:
            optimizer.state.pop(p, None)
            continue
        old, new = optimizer.state[p], {}
        for entry in entries:
            if entry[0] == "value":
                new[entry[1]] = entry[2]
                continue
            _, key, shape, dtype, on_param = entry
            device = p.device if on_param else torch.device("cpu")
            t = old.get(key)
            if not (isinstance(t, torch.Tensor) and tuple(t.shape) == shape and t.dtype == dtype
                    and t.device == device and t.is_contiguous() and _wire_ok(t)):
                t = torch.empty(shape, dtype=dtype, device=device)
            new[key] = t
            tensors.append(t)
        optimizer.state[p] = new
    return tensors


def _root_tensors(optimizer: torch.optim.Optimizer, layout: dict[str, Any]) -> list[torch.Tensor]:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return [optimizer.state[p][e[1]] for p, entries in zip(params, layout["state"])
            for e in entries or () if e[0] == "tensor"]


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: torch.nn.Module | None = None) -> None:
    """Gives every rank the root rank's optimizer state and options (lr, betas, ...), in place.

    An optimizer with no state yet is first stepped once on zero gradients (Horovod's way to
    create it); `model` marks sparse embeddings, whose gradients are then sparse.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state: its state is a nested history "
                         "that is not tied to parameters; broadcast_object(optimizer.state_dict()) "
                         "and load_state_dict() it on the other ranks instead")
    group = _group_of(global_process_set, "broadcast_optimizer_state")
    src = _group_root(global_process_set, root_rank, "broadcast_optimizer_state")
    if not any(optimizer.state.values()):
        _initialize_state(optimizer, model)
    is_root = group.rank() == src
    layout = broadcast_object(_layout(optimizer) if is_root else None, root_rank)
    problem = None if is_root else _mismatch(optimizer, layout)
    with raised_as_horovod():  # every rank learns whether any rank cannot take the state
        bad = group.allgather(torch.tensor([problem is not None], dtype=torch.int32)).tolist()
    if any(bad):
        failing = [global_process_set.ranks[i] for i, b in enumerate(bad) if b]
        raise ValueError(f"rank {basics.rank()}: hvd.broadcast_optimizer_state: ranks {failing} have "
                         f"optimizers unlike root rank {root_rank}'s"
                         + (f" ({problem})" if problem else "")
                         + "; build the same model and optimizer on every rank")
    tensors = _root_tensors(optimizer, layout) if is_root else _adopt(optimizer, layout)
    _broadcast_tensors(tensors, src, group)
