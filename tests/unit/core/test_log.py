"""torchring's messages go through logging.getLogger("torchring"): visible on stderr for an
application that configured no logging, routed to the application's handlers otherwise,
and silenced by the logger's level."""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import pytest

from torchring._core import build as _build
from torchring._core.log import logger


@contextlib.contextmanager
def _no_logging_configured() -> Iterator[logging.Logger]:
    """As in a script that never touched logging; yields the root logger. (pytest puts its
    capture handlers on the root for each test phase, so this runs inside the test body.)"""
    root = logging.getLogger()
    saved = (list(root.handlers), list(logger.handlers), logger.level, logger.propagate)
    root.handlers.clear()
    logger.setLevel(logging.INFO)
    logger.propagate = True
    try:
        yield root
    finally:
        root.handlers[:] = saved[0]
        logger.handlers[:] = saved[1]
        logger.setLevel(saved[2])
        logger.propagate = saved[3]


class _Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_info_reaches_stderr_by_default(capsys: pytest.CaptureFixture) -> None:
    with _no_logging_configured():
        logger.info("CUDA tensors take the %s path (%s)", "staged", "a reason")
    captured = capsys.readouterr()
    assert captured.err == "torchring: CUDA tensors take the staged path (a reason)\n"
    assert captured.out == ""


def test_the_level_silences_it(capsys: pytest.CaptureFixture) -> None:
    with _no_logging_configured():
        logger.setLevel(logging.WARNING)
        logger.info("building the engine")
        logger.warning("the arena is full")
    assert capsys.readouterr().err == "torchring: the arena is full\n"


def test_an_application_handler_takes_over_without_duplicates(capsys: pytest.CaptureFixture) -> None:
    recorder = _Recorder()
    with _no_logging_configured() as root:
        root.addHandler(recorder)  # logging.basicConfig() after import torchring
        logger.info("engine built in 3 s")
    assert recorder.messages == ["engine built in 3 s"] and capsys.readouterr().err == ""


def test_a_handler_on_the_torchring_logger_takes_over(capsys: pytest.CaptureFixture) -> None:
    recorder = _Recorder()
    with _no_logging_configured():
        logger.addHandler(recorder)
        logger.info("one line")
    assert recorder.messages == ["one line"] and capsys.readouterr().err == ""


def test_without_propagation_the_fallback_still_prints(capsys: pytest.CaptureFixture) -> None:
    recorder = _Recorder()
    with _no_logging_configured() as root:
        root.addHandler(recorder)
        logger.propagate = False  # the root's handlers never see it, so the fallback must
        logger.info("kept")
    assert capsys.readouterr().err == "torchring: kept\n" and recorder.messages == []


def test_engine_warnings_from_its_threads_reach_the_logger(caplog: pytest.LogCaptureFixture) -> None:
    engine = _build.load()
    with caplog.at_level(logging.WARNING, logger="torchring"):
        engine.warn_from_thread("rank 3: refused connection from 198.18.0.9:4242: wrong job secret")
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == [
        ("torchring", "WARNING", "rank 3: refused connection from 198.18.0.9:4242: wrong job secret")]
