"""torchring's log: ``logging.getLogger("torchring")``.

Rank 0's GPU-path choice, the engine build's progress and warnings (a full shared-memory
arena, ...) go through it, so an application can silence it
(``logging.getLogger("torchring").setLevel(logging.WARNING)``) or route it to its handlers.

Default, for an application that configured no logging: the messages still reach stderr
as ``torchring: <message>``, as print() did before. The logger has level INFO unless the
application set one, and carries one fallback handler that writes to stderr only while
nothing else would: while the torchring logger has no handler of the application's and
the root logger has none (or this logger does not propagate to it). So a later ``logging.basicConfig()`` (or a handler added to
this logger) takes over without duplicated lines. This is ``logging.lastResort``'s idea,
but for INFO too (lastResort prints only warnings and worse).
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("torchring")


class _Fallback(logging.StreamHandler):
    """Writes to the current sys.stderr while no application handler would see the record."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("torchring: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        others = any(h is not self for h in logger.handlers)
        if others or (logger.propagate and logging.getLogger().handlers):
            return
        self.stream = sys.stderr  # looked up now: tests and tools replace sys.stderr
        super().emit(record)


if logger.level == logging.NOTSET:
    logger.setLevel(logging.INFO)
if not any(isinstance(h, _Fallback) for h in logger.handlers):
    logger.addHandler(_Fallback())
