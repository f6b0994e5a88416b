"""Uneven inputs for ``torchring.wrap``: ranks may run out of batches at different steps.

    with model.join():                  # model = torchring.wrap(...)
        for x, y in my_batches:         # 3 batches on one rank, 5 on another
            loss_fn(model(x), y).backward()
            opt.step(); opt.zero_grad()

Words used here: a rank is *active* while it is inside the with-body; once the body ended it
has *joined*. Inside the context every synchronized forward (grad enabled, not under no_sync)
of an active rank starts with a *round*: one small SUM allreduce of a flag per world rank (1:
active) followed by what that step communicates besides the gradients (whether the buffers are
broadcast, whether parameters became trainable). A joined rank keeps answering rounds with
zeros in ``__exit__``; for each round that still has an active rank it *shadows* the step: it
takes part in the buffer broadcast (from the lowest active rank, whose buffers are current),
in one gradient sync with zero contributions (``Reducer.shadow``: every bucket's allreduce and
the used-map's, in the same order) and, after the first sync, in the one-time bucket rebuild.
A round without any active rank ends the loop on every rank at once. Gradients are averaged
over the whole world, the joined ranks counting as zeros (DDP's default). Last, every rank
takes the parameters (and broadcast buffers) of a rank that joined last, since only those did
every optimizer step: the highest such rank broadcasts them.

Contract, as with DDP's join: inside the context each synchronized forward is followed by its
backward (a joined rank shadows one gradient sync per round); collectives the model issues
itself in forward (SyncBatchNorm's) cannot be shadowed, so such a model trains with equal batch
counts; the optimizer state of a rank that joined early is not updated by the steps it missed.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .._core import context as _context
from ..collectives import basic as collectives
from .._core.errors import TorchringError
from .._core.types import ReduceOp

__all__ = ["Join", "Joinable", "Round", "active_join"]


@dataclass(frozen=True)
class Round:
    """What the active ranks announced at one synchronized forward."""

    active: tuple[int, ...]  # world ranks still inside the with-body
    buffers: bool            # the step broadcasts the buffers
    retrain: bool            # parameters became trainable: the step re-buckets

    @property
    def source(self) -> int:
        """The rank whose buffers the step broadcasts: the lowest active one."""
        return self.active[0]


class Joinable(Protocol):
    """What a joined rank needs from the model it answers for (model.py's DistributedModel)."""

    def join_shadow(self, step: Round) -> None:
        """A joined rank's part in one step of the active ranks (the buffers, a sync with zeros)."""

    def join_adopt_state(self, src: int) -> None:
        """After the last round: takes rank `src`'s parameters (and broadcast buffers)."""


# The Join inside whose with-body each model is now (a model asks at every synchronized forward).
_active: weakref.WeakKeyDictionary[Joinable, Join] = weakref.WeakKeyDictionary()


def active_join(model: Joinable) -> Join | None:
    """The Join whose context `model` is in now (its forwards start with a round), or None."""
    return _active.get(model)


def _round(rank: int, world: int, active: bool, buffers: bool = False, retrain: bool = False) -> Round:
    flags = torch.zeros(world + 2, dtype=torch.int32)
    if active:
        flags[rank], flags[world], flags[world + 1] = 1, int(buffers), int(retrain)
    collectives.allreduce(flags)
    return Round(tuple(int(r) for r in flags[:world].nonzero().flatten()), bool(flags[world]),
                 bool(flags[world + 1]))


class Join:
    """The context manager returned by ``model.join()``; see the module docstring."""

    def __init__(self, model: Joinable, enable: bool = True,
                 throw_on_early_termination: bool = False) -> None:
        self._model = model
        self._enable = enable
        self._throw = throw_on_early_termination
        self._rank, self._world = _context.rank(), _context.size()
        self.shadowed = 0  # steps this rank answered after it joined (the last context)

    def __enter__(self) -> "Join":
        if self._enable:
            if self._model in _active:
                raise RuntimeError(f"rank {self._rank}: torchring.wrap: model.join() is already "
                                   "active for this model; do not nest join contexts")
            _active[self._model] = self
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if not self._enable:
            return False
        try:
            if exc_type is None:  # a body that raised leaves at once, like DDP's
                self._answer_until_all_joined()
        finally:
            _active.pop(self._model, None)
        return False

    def begin_step(self, buffers: bool, retrain: bool) -> Round:
        """An active rank's round at a synchronized forward (called by the model)."""
        step = _round(self._rank, self._world, True, buffers, retrain)
        if len(step.active) < self._world:
            self._refuse_uneven(step)
        return step

    def _refuse_uneven(self, step: Round) -> None:
        """Raises on the active ranks of a round some rank has joined, where that is an error."""
        joined = [r for r in range(self._world) if r not in step.active]
        if self._throw:
            raise TorchringError(
                f"rank {self._rank}: torchring.wrap: rank(s) {joined} ran out of inputs and "
                "model.join(throw_on_early_termination=True) stops every rank; catch this "
                "TorchringError on every rank to end the epoch")
        if step.retrain:
            raise TorchringError(
                f"rank {self._rank}: torchring.wrap: parameters became trainable inside "
                f"model.join() after rank(s) {joined} joined; a joined rank cannot re-bucket with "
                "the others. Change requires_grad outside the join context")

    def _answer_until_all_joined(self) -> None:
        last = True
        self.shadowed = 0
        while True:
            step = _round(self._rank, self._world, False)
            if not step.active:
                break
            last = False
            if self._throw or step.retrain:
                self._refuse_uneven(step)
            self._model.join_shadow(step)
            self.shadowed += 1
        # Every rank that joined in the final round did every step: the highest one is the source.
        src = torch.tensor([self._rank if last else -1], dtype=torch.int64)
        collectives.allreduce(src, ReduceOp.MAX)
        self._model.join_adopt_state(int(src))
