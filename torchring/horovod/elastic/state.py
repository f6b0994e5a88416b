"""The state an elastic job keeps: commit() what is good, restore() it after a failure, sync() it
from one rank to all.

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)
    state.commit()     # in memory, and on disk when torchrun can restart the job (_commits.py)
    state.restore()    # back to the last commit
    state.sync()       # every rank takes rank 0's state (after a restart: the newest commit's)

Models, optimizers and ElasticSamplers are handled by type (get_handler_registry() lists the
handlers); every other keyword is a plain attribute, broadcast as a pickled object.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any, Callable

import torch

from .. import basics
from ..exceptions import HostsUpdatedInterrupt
from ..functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                         broadcast_parameters)
from . import _commits
from .sampler import ElasticSampler

__all__ = ["State", "ObjectState", "TorchState", "HostsUpdatedInterrupt", "StateHandler",
           "ModelStateHandler", "OptimizerStateHandler", "SamplerStateHandler",
           "get_handler_registry", "set_handler_registry"]


class State:
    """What a job tracks across failures: reset callbacks and commit(); subclasses hold the data."""

    def __init__(self, bcast_object: Callable[..., Any] = broadcast_object,
                 get_rank: Callable[[], int] = basics.rank) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: list[Callable[[], Any]] = []

    def register_reset_callbacks(self, callbacks: list[Callable[[], Any]]) -> None:
        """Adds functions called after a reset (e.g. to scale the learning rate to the new size)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Runs reset() and then every registered reset callback."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, update_res: Any) -> None:
        """Accepted for Horovod's driver API; torchrun restarts the ranks on membership changes."""

    def commit(self) -> None:
        """Saves the state as the one to go back to, then checks for host changes."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raises HostsUpdatedInterrupt on every rank at once when processes wait to join the
        world (a newcomer, or a survivor too late for the last re-forming): run() re-forms the
        world with them. Under torchrun's agent, which restarts every rank when hosts come or
        go, there are none."""
        from ...elastic import world as _world  # here: only a commit asks

        if basics.is_initialized():
            joiners = _world.joiners_waiting()
            if joiners:
                raise HostsUpdatedInterrupt(skip_sync=False, joiners=joiners)

    def save(self) -> None:
        """Saves the state in memory."""
        raise NotImplementedError()

    def restore(self) -> None:
        """Goes back to the last saved state."""
        raise NotImplementedError()

    def sync(self) -> None:
        """Makes every rank's state rank 0's."""
        raise NotImplementedError()

    def reset(self) -> None:
        """Called on a reset before the callbacks; for subclasses."""


class ObjectState(State):
    """State of plain Python objects given as keywords, kept as attributes and broadcast pickled."""

    def __init__(self, bcast_object: Callable[..., Any] = broadcast_object,
                 get_rank: Callable[[], int] = basics.rank, **kwargs: Any) -> None:
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        """Copies the current attribute values as the saved state."""
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    def restore(self) -> None:
        """Sets the attributes back to the saved state."""
        self._set_attrs()

    def sync(self) -> None:
        """Every rank takes rank 0's saved attributes."""
        self._sync_objects(0)

    def _sync_objects(self, root: int) -> None:
        if self._saved_state:  # Horovod's bcast_object(obj) form when the root is rank 0
            args = (self._saved_state,) if root == 0 else (self._saved_state, root)
            self._saved_state = self._bcast_object(*args)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)


class StateHandler:
    """Saves, restores and syncs one kind of object held by a TorchState."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.saved: Any = None
        self.save()

    def save(self) -> None:
        """Copies the value's state."""
        raise NotImplementedError()

    def restore(self) -> None:
        """Puts the saved copy back into the value."""
        raise NotImplementedError()

    def sync(self, root_rank: int = 0) -> None:
        """Gives every rank the root rank's value."""
        raise NotImplementedError()

    def set_value(self, value: Any) -> None:
        """Tracks a new object (state.model = other_model) and saves it."""
        self.value = value
        self.save()


class _StateDictHandler(StateHandler):
    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)


class ModelStateHandler(_StateDictHandler):
    """A torch.nn.Module: its state_dict, broadcast tensor by tensor."""

    def sync(self, root_rank: int = 0) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=root_rank)


class OptimizerStateHandler(_StateDictHandler):
    """A torch.optim.Optimizer: its state and options (hvd.broadcast_optimizer_state)."""

    def restore(self) -> None:
        # load_state_dict keeps the given tensors as the live state, which the next step()
        # changes in place: load a copy, so that the saved state survives for the next restore
        self.value.load_state_dict(copy.deepcopy(self.saved))

    def sync(self, root_rank: int = 0) -> None:
        broadcast_optimizer_state(self.value, root_rank=root_rank)


class SamplerStateHandler(_StateDictHandler):
    """An ElasticSampler: the root's epoch and count, and the indices every rank recorded."""

    def sync(self, root_rank: int = 0) -> None:
        states = allgather_object(self.value.state_dict())
        merged = dict(states[root_rank])
        merged["processed_indices"] = sorted(set().union(*(s["processed_indices"] for s in states)))
        self.value.load_state_dict(merged)


_handler_registry: list[tuple[type, type[StateHandler]]] = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry() -> list[tuple[type, type[StateHandler]]]:
    """The (type, handler class) pairs TorchState picks handlers from, first match wins."""
    return _handler_registry


def set_handler_registry(registry: list[tuple[type, type[StateHandler]]]) -> None:
    """Replaces the handler registry (for objects of your own types)."""
    global _handler_registry
    _handler_registry = registry


def _handler_for(value: Any) -> StateHandler | None:
    for kind, handler in _handler_registry:
        if isinstance(value, kind):
            return handler(value)
    return None


_instances = itertools.count()  # names each TorchState's commit file, in creation order


class TorchState(ObjectState):
    """A model, an optimizer and any other attributes, committed, restored and synced together."""

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers, plain = {}, {}
        for name, value in kwargs.items():
            handler = _handler_for(value)
            if handler is None:
                plain[name] = value
            else:
                handlers[name] = handler
        self._handlers: dict[str, StateHandler] = handlers
        for name, handler in handlers.items():
            setattr(self, name, handler.value)
        self._index = next(_instances)
        self._commits = 0  # commits made by this job (continued across restarts)
        self._resume_checked = False
        self._marked = False  # this job's commits are announced in the rendezvous store
        super().__init__(bcast_object=broadcast_object, get_rank=basics.rank, **plain)

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers")
        if handlers is not None and name in handlers and name in self.__dict__:
            handlers[name].set_value(value)
        super().__setattr__(name, value)

    def save(self) -> None:
        """Copies the model, optimizer, sampler and attributes as the state to go back to."""
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        """Loads the last saved copy back into the model, optimizer, sampler and attributes."""
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def commit(self) -> None:
        """save(), and to disk too when the launcher can restart the job (see _commits)."""
        self.save()
        if _commits.enabled():
            self._persist()
        self.check_host_updates()

    def sync(self) -> None:
        """Every rank takes rank 0's state; on the first sync of a restarted job, the state of
        the newest commit any rank has on disk. The synced state becomes the saved one."""
        root = 0
        if not self._resume_checked:
            self._resume_checked = True
            if _commits.enabled():
                root = self._resume()
        for handler in self._handlers.values():
            handler.sync(root)
        self._sync_objects(root)
        self.save()

    def _file(self) -> str:
        return _commits.path(self._index, basics.rank())

    def _persist(self) -> None:
        self._resume_checked = True  # committing before any sync: a file there is an old job's
        self._commits += 1
        payload = {"commit": self._commits,
                   "handlers": {name: h.saved for name, h in self._handlers.items()},
                   "objects": self._saved_state}
        _commits.write(self._file(), payload)
        if not self._marked:
            _commits.mark_job()
            self._marked = True

    def _resume(self) -> int:
        """Loads the newest commit of an earlier incarnation; returns the rank to sync from."""
        file = self._file()
        payload = _commits.read(file) if _commits.job_was_marked() else None
        if payload is None:
            _commits.remove(file)  # an earlier job's, or none
        mine = int(payload["commit"]) if payload is not None else -1
        counts = allgather_object(mine)
        newest = max(counts)
        if newest < 0:
            return 0
        if mine == newest:
            for name, saved in payload["handlers"].items():
                if name in self._handlers:
                    self._handlers[name].saved = saved
                    self._handlers[name].restore()
            self._saved_state = payload["objects"]
            self._set_attrs()
        self._commits = newest
        self._just_resumed = True  # run() calls the reset callbacks after this sync
        return counts.index(newest)
