"""torchring.trace: the flight recorder's dumps and the diagnosis read from them.

    torchring.dump_trace()            # this rank's dump now (also on failures and SIGUSR1)
    python -m torchring.trace DIR     # every rank's dump in DIR: what hangs, who is behind, why
"""

from __future__ import annotations

from pathlib import Path

from . import recorder as _recorder

__all__ = ["dump_trace"]


def dump_trace() -> Path | None:
    """Writes this rank's flight-recorder dump now and returns its path (None before init)."""
    return _recorder.dump_now("request")
