"""torchring.trace: the flight recorder's dumps and the diagnosis read from them.

    torchring.dump_trace()            # this rank's dump now (also on failures and SIGUSR1)
    python -m torchring.trace DIR     # every rank's dump in DIR: what hangs, who is behind, why
    python -m torchring.trace --status DIR   # the ranks' status files in DIR, a line per rank
    torchring.trace.step(samples)     # counts a training step for the status (loops not built on
                                      # wrap, torchring.horovod or torchring.data)
"""

from __future__ import annotations

from pathlib import Path

from . import recorder as _recorder
from .progress import step

__all__ = ["dump_trace", "step"]


def dump_trace() -> Path | None:
    """Writes this rank's flight-recorder dump now and returns its path (None before init)."""
    return _recorder.dump_now("request")
