"""hvd.elastic: training that survives a rank's failure, riding torchrun's elastic agent.

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...                       # steps; state.commit() every few
            state.commit()

    train(state)

    torchring-run -np 4 --max-restarts 3 train.py     # or torchrun --nnodes=MIN:MAX ...

Horovod recovers inside the surviving processes. Here the launcher does it: when a rank dies,
torchrun's agent stops the others and starts every rank again (a rank whose collective failed
first restores its last commit and exits with the error). TorchState writes each commit to disk
(_commits.py), and the restarted job's first sync() loads the newest commit any rank has, then
runs the reset callbacks, so ``train(state)`` continues from the last commit, possibly with another
number of ranks (the ElasticSampler re-splits what is left of the epoch).

Only a failed communicator is restored from (``CommunicatorFailedError``, or the
``HorovodInternalError`` an hvd entry point wraps around it; exceptions.py): ranks that disagreed
on an operation (``CollectiveMismatchError``) left it usable, so that error reaches the caller
untouched, with the state as it was. This package sits above runtime.py, as Horovod's elastic
module sits above its ops: ``HostsUpdatedInterrupt`` re-initializes through runtime's
``shutdown()`` and ``init()``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

from ..._core import errors as _errors, log as _log
from .. import basics, runtime
from ..exceptions import HorovodInternalError, HostsUpdatedInterrupt, communicator_failed
from . import _commits
from .sampler import ElasticSampler
from .state import ObjectState, State, TorchState

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler", "HostsUpdatedInterrupt"]

F = TypeVar("F", bound=Callable[..., Any])

# What a failed peer looks like to a rank: an hvd op's error, or the engine's own (torchring.wrap);
# communicator_failed() then sets apart those that left the communicator usable (a mismatch).
_FAILURES = (HorovodInternalError, _errors.CommunicatorFailedError)


def _reinit() -> None:
    runtime.shutdown()
    runtime.init()


def run(func: F) -> F:
    """Wraps `func(state, ...)`: sync the state (after a restart: resume its newest commit), run,
    and on a failed communicator restore the last commit and re-raise, so that torchrun restarts."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                    if state.__dict__.pop("_just_resumed", False):
                        state.on_reset()  # the world may have another size after the restart
                return func(state, *args, **kwargs)
            except _FAILURES as exc:
                if not communicator_failed(exc):  # the communicator is usable: the caller's to handle
                    raise
                state.restore()
                where = f" (on disk in {_commits.directory()})" if _commits.enabled() else ""
                _log.logger.error(
                    "rank %d: hvd.elastic.run: a collective failed (%s); the state is back at its "
                    "last commit%s and this rank exits so that the launcher restarts the job from "
                    "it (torchring-run --max-restarts / torchrun --max-restarts)",
                    basics.rank(), str(exc).splitlines()[0] if str(exc) else type(exc).__name__, where)
                raise
            except HostsUpdatedInterrupt as exc:  # raised by user code only: reset in place
                skip_sync = exc.skip_sync
            _reinit()
            state.on_reset()

    return wrapper  # type: ignore[return-value]
