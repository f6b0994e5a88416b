"""torchring.elastic: a lost rank or host costs a pause, not the job.

    torchring.elastic.init()             # as launched, or, in a running job, as a newcomer
    state = torchring.elastic.State(model=model, optimizer=optimizer, epoch=0)

    @torchring.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...                          # steps on torchring.wrap(model), state.commit() every few

    train(state)

When a collective fails because a peer died or went silent (CommunicatorFailedError), run()
puts the state back at its last commit, re-forms the world with the processes still alive
(world.reform(): a new membership epoch agreed through the store, new ranks, a new
communicator; no process restarts), makes every rank take rank 0's state, and calls `train`
again. A mismatch (CollectiveMismatchError) leaves the communicator usable and reaches the
caller untouched. A process that waits to join (one that came too late for the survivors'
epoch, or a newcomer) is let in at the next commit(): every rank raises WorldChanged there and
run() re-forms the world with it.

torchft users keep torchft's Manager and quorums and take torchring's process group instead of
gloo's: ``torchring.elastic.torchft.ProcessGroupTorchring`` (imported on its own: it needs torchft).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

from .._core import context as _context, errors as _errors, log as _log
from .membership import Epoch, Member, NotAMemberError
from .sampler import ElasticSampler
from .state import State
from .world import DEFAULT_SETTLE_S, WorldChanged, epoch, finished, init, reform, reform_process_group

__all__ = ["init", "run", "reform", "reform_process_group", "epoch", "Epoch", "Member", "NotAMemberError",
           "State", "ElasticSampler", "WorldChanged", "recover"]

F = TypeVar("F", bound=Callable[..., Any])


def recover(state: Any, error: BaseException) -> Epoch:
    """After `error` broke the communicator: restore `state`'s last commit, re-form the world,
    and log who is left; the caller then syncs and goes on."""
    state.restore()
    before = _log_rank()
    settle, gather = waits_after(error)
    joined = reform(settle=settle, gather=gather)
    _log.logger.warning("rank %s: %s; the world is re-formed in process as epoch %d: %d ranks, this "
                        "one now rank %d, back at the last commit", before,
                        failure_summary(error),
                        joined.number, joined.size, joined.rank)
    return joined


def waits_after(error: BaseException) -> tuple[float, float]:
    """(settle, gather) for the epoch after `error` (membership.join). A dead process is seen by
    every survivor at once (its connections close): the settle second decides. A silent one
    (paused, cut off) is seen first by the survivor whose TORCHRING_TIMEOUT runs out; the
    others read its failure on the board within a second and arrive first (gather 1.5 s
    covers them), while it still asks the board why (up to 2 s): its post there says it lives,
    so the epoch waits for it, then settles for half a second."""
    text = str(error)
    silent = " s timeout" in text or "stopped waiting for" in text  # the engine's wording
    return (0.5, 1.5) if silent else (DEFAULT_SETTLE_S, 0.0)


def failure_summary(error: BaseException) -> str:
    """The failure's first clause (its advice to restart the job does not apply here)."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return text.split("; ")[0]


def _log_rank() -> str:
    return str(_context.rank()) if _context.is_initialized() else "?"


def run(func: F) -> F:
    """Wraps `func(state, ...)`: sync the state, run, and after a failed communicator restore
    the last commit, re-form the world in process and run again."""

    @functools.wraps(func)
    def wrapper(state: Any, *args: Any, **kwargs: Any) -> Any:
        while True:
            try:
                state.sync()  # inside: a world that fails again while syncing re-forms again
                result = func(state, *args, **kwargs)
                finished()
                return result
            except _errors.CommunicatorFailedError as exc:
                recover(state, exc)
                state.on_reset()
            except WorldChanged as exc:  # raised at a commit: nothing to undo
                joined = reform(joiners=exc.joiners)
                _log.logger.info("rank %d: %s; the world is re-formed as epoch %d: %d ranks",
                                 joined.rank, exc, joined.number, joined.size)
                state.on_reset()

    return wrapper  # type: ignore[return-value]
