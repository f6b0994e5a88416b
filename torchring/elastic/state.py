"""State: what an elastic job keeps across a re-forming of its world.

    state = torchring.elastic.State(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0)
    state.commit()      # a copy in host memory is the point to come back to; lets waiting joiners in
    state.restore()     # back to the last commit (after a failure)
    state.sync()        # every rank takes rank 0's state (after a re-forming: a newcomer's start)

Objects with state_dict()/load_state_dict() (modules, optimizers, torchring's elastic
samplers) are saved and restored through their state dicts; a module's tensors are synced
with torchring.broadcast in place, everything else (optimizer state, plain attributes such as
`epoch`) with torchring.broadcast_object from rank 0. Plain attributes read and write as
`state.epoch`.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from ..collectives import basic as _basic
from .._core import context as _context
from . import world as _world

_OWN = ("_objects", "_values", "_saved", "_callbacks")


class State:
    """Named objects and values with commit/restore/sync; see the module docstring."""

    def __init__(self, **entries: Any) -> None:
        objects = {k: v for k, v in entries.items() if hasattr(v, "state_dict") and hasattr(v, "load_state_dict")}
        object.__setattr__(self, "_objects", objects)
        object.__setattr__(self, "_values", {k: v for k, v in entries.items() if k not in objects})
        object.__setattr__(self, "_callbacks", [])
        object.__setattr__(self, "_saved", None)
        self.save()

    def __getattr__(self, name: str) -> Any:
        entries = {**self.__dict__.get("_objects", {}), **self.__dict__.get("_values", {})}
        if name in entries:
            return entries[name]
        raise AttributeError(f"torchring.elastic.State has no entry {name!r}; it holds {sorted(entries)}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN:
            object.__setattr__(self, name, value)
        elif name in self._objects:
            self._objects[name] = value
        else:
            self._values[name] = value

    def register_reset_callbacks(self, callbacks: list[Callable[[], Any]]) -> None:
        """Adds functions called after each re-forming (e.g. to scale the learning rate to the new size)."""
        self._callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Re-splits the samplers over the new world, then runs the reset callbacks."""
        for obj in self._objects.values():
            if callable(getattr(obj, "reset", None)) and not isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
                obj.reset()
        for callback in self._callbacks:
            callback()

    def commit(self) -> None:
        """save(), then let in the processes waiting to join: every rank raises WorldChanged
        together when there are any, and run() re-forms the world with them."""
        self.save()
        if _context.is_initialized():
            joiners = _world.joiners_waiting()
            if joiners:
                raise _world.WorldChanged(joiners)

    def save(self) -> None:
        """Saves a copy of every entry in host memory: the point restore() goes back to."""
        saved = {k: _to_cpu(copy.deepcopy(o.state_dict())) for k, o in self._objects.items()}
        object.__setattr__(self, "_saved", (saved, copy.deepcopy(self._values)))

    def restore(self) -> None:
        """Puts every entry back as it was at the last commit."""
        saved, values = self._saved
        for name, obj in self._objects.items():
            obj.load_state_dict(copy.deepcopy(saved[name]))
        object.__setattr__(self, "_values", copy.deepcopy(values))

    def sync(self) -> None:
        """Every rank takes rank 0's entries (tensors of modules in place, the rest as objects),
        then commits them, so that all ranks go back to the same point. The world is
        torchring's, or torch.distributed's default group for a job on init_process_group."""
        bcast, bcast_object = _collectives()
        if bcast is not None:
            others: dict[str, Any] = {}
            for name, obj in self._objects.items():
                if isinstance(obj, torch.nn.Module):
                    for tensor in obj.state_dict().values():
                        bcast(tensor)
                else:
                    others[name] = obj.state_dict()
            others, values = bcast_object((others, self._values))
            for name, state_dict in others.items():
                self._objects[name].load_state_dict(state_dict)
            object.__setattr__(self, "_values", values)
        self.save()


def _collectives() -> tuple[Callable[[torch.Tensor], Any] | None, Callable[[Any], Any]]:
    """(broadcast a tensor from rank 0 in place, broadcast an object from rank 0) over the
    job's world: torchring's, else torch.distributed's default group; (None, ...) for one rank."""
    import torch.distributed as dist  # here: only a job without torchring.init() uses it

    if _context.is_initialized():
        if _context.size() == 1:
            return None, lambda obj: obj
        return (lambda t: _basic.broadcast(t, 0)), (lambda obj: _basic.broadcast_object(obj, 0))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        def bcast_object(obj: Any) -> Any:
            box = [obj]
            dist.broadcast_object_list(box, src=0)
            return box[0]
        return (lambda t: dist.broadcast(t, 0)), bcast_object
    return None, lambda obj: obj


def _to_cpu(value: Any) -> Any:
    """The same nesting with every tensor copied to host memory (a commit survives a GPU's loss)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value
