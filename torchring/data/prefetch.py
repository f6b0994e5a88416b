"""Copies the next batch to the GPU on a side stream while the current one computes.

On CPU (or with no CUDA device) it passes batches through unchanged.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from .._core import gpu_path as _gpu_path

__all__ = ["DevicePrefetcher"]


def _to(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, (list, tuple)):
        moved = [_to(b, device, non_blocking) for b in batch]
        return type(batch)(moved) if not hasattr(batch, "_fields") else type(batch)(*moved)
    if isinstance(batch, dict):
        return {k: _to(v, device, non_blocking) for k, v in batch.items()}
    return batch


def _record(batch: Any, stream: Any) -> None:
    if isinstance(batch, torch.Tensor):
        batch.record_stream(stream)
    elif isinstance(batch, (list, tuple)):
        for b in batch:
            _record(b, stream)
    elif isinstance(batch, dict):
        for b in batch.values():
            _record(b, stream)


class DevicePrefetcher:
    """Iterates `loader`, delivering each batch already on `device` (one batch ahead)."""

    def __init__(self, loader: Iterable[Any], device: torch.device | str | None = None) -> None:
        self.loader = loader
        if device is None:
            device = _gpu_path.device() or "cpu"  # the rank's device as init() chose it
        self.device = torch.device(device)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        if self.device.type != "cuda":
            yield from self.loader
            return
        stream = torch.cuda.Stream(self.device)
        pending = None
        for batch in self.loader:
            with torch.cuda.stream(stream):
                ready = _to(batch, self.device, non_blocking=True)
            if pending is not None:
                yield pending
            torch.cuda.current_stream(self.device).wait_stream(stream)
            _record(ready, torch.cuda.current_stream(self.device))
            pending = ready
        if pending is not None:
            yield pending
