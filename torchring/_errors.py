"""The exception type of failed collectives."""


class TorchringError(RuntimeError):
    """A collective failed: a peer died or went silent, a timeout expired, or ranks disagreed.

    The communicator is unusable afterwards: call ``torchring.shutdown()`` and
    ``torchring.init()`` (or let ``torchrun --max-restarts`` restart the job).
    """
