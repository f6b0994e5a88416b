"""hvd.elastic: training that survives a rank's failure, riding torchrun's elastic agent.

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...                       # steps; state.commit() every few
            state.commit()

    train(state)

    torchring-run -np 4 --max-restarts 3 train.py     # or torchrun --nnodes=MIN:MAX ...

As in Horovod, the surviving processes recover in place: a failed communicator restores the
last commit, the world is re-formed with the processes still alive (torchring.elastic: a new
membership epoch, new ranks, no restart), the reset callbacks run and every rank takes rank 0's
state. Processes waiting to join (a newcomer, a survivor too late for the re-forming) make
commit() raise HostsUpdatedInterrupt on every rank, and run() re-forms the world with them.

Under torchrun's agent (TORCHELASTIC_RUN_ID set), which stops every rank when one fails and
starts the job again, a failed rank restores its last commit and exits with the error instead.
TorchState writes each commit to disk there (_commits.py), and the restarted job's first sync()
loads the newest commit any rank has, so ``train(state)`` continues from the last commit,
possibly with another number of ranks (the ElasticSampler re-splits what is left of the epoch).

Only a failed communicator is restored from (``CommunicatorFailedError``, or the
``HorovodInternalError`` an hvd entry point wraps around it; exceptions.py): ranks that disagreed
on an operation (``CollectiveMismatchError``) left it usable, so that error reaches the caller
untouched, with the state as it was. This package sits above runtime.py, as Horovod's elastic
module sits above its ops: a re-forming goes through runtime.reform(), which stops Horovod's
side, re-forms the world (torchring.elastic) and starts Horovod's side again.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, TypeVar

from ... import elastic as _elastic
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


def _restarts_the_job() -> bool:
    """Whether torchrun's agent runs this rank: it stops every rank when one fails and starts
    the job again, so a rank recovers by the restart (from the commit on disk), not in process."""
    return bool(os.environ.get("TORCHELASTIC_RUN_ID"))


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
                result = func(state, *args, **kwargs)
                _elastic.finished()  # a process still waiting to be let in ends
                return result
            except _FAILURES as exc:
                if not communicator_failed(exc):  # the communicator is usable: the caller's to handle
                    raise
                if _restarts_the_job():
                    state.restore()
                    where = f" (on disk in {_commits.directory()})" if _commits.enabled() else ""
                    _log.logger.error(
                        "rank %d: hvd.elastic.run: a collective failed (%s); the state is back at its "
                        "last commit%s and this rank exits so that the launcher restarts the job from "
                        "it (torchring-run --max-restarts / torchrun --max-restarts)",
                        basics.rank(), str(exc).splitlines()[0] if str(exc) else type(exc).__name__, where)
                    raise
                state.restore()  # in process, as Horovod: restore, re-form, reset, sync
                joined = runtime.reform(*_elastic.waits_after(exc))
                _log.logger.warning("rank %d: hvd.elastic.run: %s; the world is re-formed in process as "
                                    "epoch %d: %d ranks, back at the last commit", joined.rank,
                                    _elastic.failure_summary(exc),
                                    joined.number, joined.size)
                skip_sync = False
            except HostsUpdatedInterrupt as exc:  # at a commit (joiners wait) or from user code
                skip_sync = exc.skip_sync
                runtime.reform(joiners=exc.joiners)
            state.on_reset()

    return wrapper  # type: ignore[return-value]
