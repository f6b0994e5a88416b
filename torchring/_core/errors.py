"""torchring's exceptions; docs/errors.md says which failure raises which, and what to do.

- ``TorchringError``: the base. Raised as itself for failures that leave the communicator as
  it was: a collective called in a forked child, an operation dropped or refused because of
  ``shutdown()``.
- ``CommunicatorFailedError``: a dead or silent peer, a timeout, a broken connection. The
  communicator is unusable: ``torchring.shutdown()`` then ``torchring.init()`` on every rank
  (or let ``torchrun --max-restarts`` restart the job).
- ``CollectiveMismatchError``: ranks issued different collectives (kind, dtype, shape, op or
  root) as one operation. Found before any data moved; every rank raises it for that
  operation and the next collective runs normally.
- ``WaitTimeoutError``: ``Handle.wait(timeout)`` expired; the operation is still running.
Misuse of the API (a wrong type, a bad argument) is a ``TypeError`` or ``ValueError``.
"""

__all__ = ["TorchringError", "CommunicatorFailedError", "CollectiveMismatchError",
           "WaitTimeoutError"]


class TorchringError(RuntimeError):
    """Base of torchring's errors; as itself, a failure that left the communicator usable."""


class CommunicatorFailedError(TorchringError):
    """A peer died or went silent, a timeout expired or a connection broke: rebuild the communicator."""


class CollectiveMismatchError(TorchringError):
    """Ranks issued different collectives as one operation; the communicator stays usable."""


class WaitTimeoutError(TorchringError):
    """``Handle.wait(timeout)`` expired; the operation is still running and nothing is broken."""
