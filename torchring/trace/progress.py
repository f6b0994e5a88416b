"""What a rank has done so far, for its status line: steps, samples, time spent waiting for data.

torchring's own loops count themselves: ``torchring.data.DataLoader`` notes each batch it hands
out and how long the caller waited for it (``batch``), ``wrap``'s gradient sync and
``torchring.horovod``'s optimizer note each step (``step``). A training loop built on neither can
call ``torchring.trace.step(samples)`` itself. The counters are plain integers of this process,
written by the training thread and read (a torn read costs one stale number) by the status writer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

__all__ = ["Counters", "counters", "step", "batch", "batch_size_of"]


@dataclass
class Counters:
    """This process's progress since it started."""

    steps: int = 0             # optimizer / gradient-sync steps (0 while nobody counts them)
    batches: int = 0           # batches the data loader handed out
    samples: int = 0           # samples in them, or counted by step(samples)
    data_ns: int = 0           # time the training loop waited for its next batch
    epoch: int = 0             # the loader's epoch (counted from 1 once it starts)
    epoch_batch: int = 0       # batches handed out in this epoch
    epoch_length: int = 0      # batches in an epoch (0: unknown)
    started_ns: int = 0        # time.time_ns() when counting began

    def as_dict(self) -> dict[str, Any]:
        """The counters as a status file holds them."""
        return {"steps": self.steps or self.batches, "batches": self.batches, "samples": self.samples,
                "data_s": self.data_ns * 1e-9, "epoch": self.epoch, "epoch_batch": self.epoch_batch,
                "epoch_length": self.epoch_length}


counters = Counters(started_ns=time.time_ns())


def step(samples: int = 0) -> None:
    """Counts one training step of this rank (and `samples` samples, when no loader counts them)."""
    counters.steps += 1
    counters.samples += samples


def epoch_started(length: int) -> None:
    """The data loader began an epoch of `length` batches (0: unknown)."""
    counters.epoch += 1
    counters.epoch_batch = 0
    counters.epoch_length = length


def batch(waited_ns: int, samples: int) -> None:
    """The data loader handed out a batch of `samples` after the loop waited `waited_ns` for it."""
    counters.batches += 1
    counters.epoch_batch += 1
    counters.samples += samples
    counters.data_ns += waited_ns


def batch_size_of(batch: Any, default: int) -> int:
    """The samples in `batch`: the first dimension of its first tensor, else `default`."""
    for _ in range(4):  # a tensor inside a few levels of tuple / list / dict
        if isinstance(batch, dict):
            batch = next(iter(batch.values()), None)
        elif isinstance(batch, (list, tuple)):
            batch = batch[0] if batch else None
        else:
            break
    shape = getattr(batch, "shape", None)
    return int(shape[0]) if shape else default
