"""Horovod's exception types, and the one rule by which torchring's failures reach hvd's users.

Horovod wraps a ``RuntimeError`` raised by one of its operations into ``HorovodInternalError``
when the operation is synchronized; ``to_horovod`` applies that rule at every hvd entry point
(the ops' ``synchronize``, the state helpers in functions.py, the optimizer's syncs). The
engine's own class stays reachable as the wrapper's ``__cause__``, so ``hvd.elastic.run`` can
tell a failed communicator (``CommunicatorFailedError``: restore the last commit) from a
failure that left it usable (a ``CollectiveMismatchError``, a refusal after ``hvd.shutdown()``),
which it lets through like any other exception. Misuse stays what it is: ``ValueError``,
``TypeError`` and ``NotImplementedError`` (hvd.Adasum) pass unchanged.

Users import these as Horovod has them: ``hvd.HorovodInternalError`` and
``hvd.elastic.HostsUpdatedInterrupt``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from .._core import errors as _errors

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "to_horovod", "raised_as_horovod",
           "communicator_failed"]


class HorovodInternalError(RuntimeError):
    """A collective failed: a peer died, a timeout expired, or ranks disagreed on an operation."""


class HostsUpdatedInterrupt(RuntimeError):
    """Hosts were added or removed: raised at a commit when processes wait to join (`joiners`),
    or by user code; hvd.elastic.run re-forms the world then."""

    def __init__(self, skip_sync: bool = False, joiners: int = 0) -> None:
        super().__init__("hosts were updated")
        self.skip_sync = skip_sync
        self.joiners = joiners


def to_horovod(exc: BaseException) -> BaseException:
    """What Horovod's users get for `exc`: a RuntimeError (the engine's TorchringError included)
    as HorovodInternalError with its message, caused by it; anything else unchanged."""
    if not isinstance(exc, RuntimeError) or isinstance(exc, (HorovodInternalError, NotImplementedError)):
        return exc
    err = HorovodInternalError(str(exc))
    err.__cause__ = exc
    return err


@contextlib.contextmanager
def raised_as_horovod() -> Iterator[None]:
    """Inside it, a failure reaches the caller as Horovod raises it (to_horovod)."""
    try:
        yield
    except RuntimeError as exc:
        raise to_horovod(exc)  # noqa: B904 (to_horovod sets the cause, or returns exc itself)


def communicator_failed(exc: BaseException) -> bool:
    """Whether `exc` means the communicator is broken: a CommunicatorFailedError, or a
    HorovodInternalError unless it wraps an engine error that left the communicator usable."""
    if isinstance(exc, _errors.CommunicatorFailedError):
        return True
    if not isinstance(exc, HorovodInternalError):
        return False
    cause = exc.__cause__
    failed = isinstance(cause, _errors.CommunicatorFailedError)
    return failed or not isinstance(cause, _errors.TorchringError)
