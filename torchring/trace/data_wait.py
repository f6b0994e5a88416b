"""How long the training loop waits for its data, whatever loader it uses.

A rank's time splits into data loading, communication and compute (the status line, the
straggler report): communication is the engine's, and compute is what is left, so the data
time must be measured or it counts as compute. Nearly every PyTorch loop takes its batches from
``torch.utils.data.DataLoader``; every batch it hands out passes through one method of its
iterator (``_BaseDataLoaderIter.__next__``, single- and multi-process alike). ``install()``
wraps that method once per process: each batch's wait (the time the calling thread spent in
``__next__``) and its samples (the first dimension of its first tensor, else the loader's batch
size) go into the rank's counters (progress.py). The end of an epoch (StopIteration) counts
nothing. A wrap costs two clock reads per batch.

torchring.init(), the torch.distributed backend and torchring.data's loader install it, unless
TORCHRING_DATA_WAIT=0 (the settings' data_wait), which leaves torch's DataLoader untouched: a
plain loader's data time then counts as compute.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from . import progress as _progress

__all__ = ["install", "installed", "uninstall"]

_lock = threading.Lock()
_original: Any = None


def _iterator_class() -> Any:
    """torch's DataLoader iterator base class, or None where this torch has none."""
    # Function-local: the trace layer imports torch only where a rank already has it loaded.
    from torch.utils.data import dataloader

    return getattr(dataloader, "_BaseDataLoaderIter", None)


def installed() -> bool:
    """Whether torch's DataLoader batches are being timed in this process."""
    return _original is not None


def install() -> bool:
    """Times every torch DataLoader batch of this process from now on (idempotent); False where
    this torch's DataLoader has no iterator to time."""
    global _original
    with _lock:
        if _original is not None:
            return True
        cls = _iterator_class()
        original = getattr(cls, "__next__", None)
        if original is None:
            return False

        def __next__(self: Any) -> Any:
            start = time.perf_counter_ns()
            batch = original(self)  # StopIteration: the epoch ended, nothing to count
            default = getattr(getattr(self, "_index_sampler", None), "batch_size", None) or 1
            _progress.batch(time.perf_counter_ns() - start, _progress.batch_size_of(batch, default))
            return batch

        __next__.__wrapped__ = original  # type: ignore[attr-defined]
        __next__.__doc__ = original.__doc__
        cls.__next__ = __next__
        _original = original
        return True


def uninstall() -> None:
    """Puts torch's own method back (tests)."""
    global _original
    with _lock:
        if _original is not None:
            _iterator_class().__next__ = _original
            _original = None
