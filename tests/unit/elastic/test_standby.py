"""Standby stores (torchring/elastic/standby.py) on real TCPStores: which standby the survivors
meet at when the job's store fails, that the job keeps it, and what they are told when none
answers."""

from __future__ import annotations

import dataclasses
import datetime
import socket
from typing import Any, Iterator

import pytest
import torch.distributed as dist

from torchring._core import env as _env, rendezvous
from torchring._core.errors import CommunicatorFailedError
from torchring.elastic import standby


def _server() -> Any:
    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nobody listens there once the socket is closed


@pytest.fixture()
def launch(monkeypatch: pytest.MonkeyPatch) -> Iterator[_env.Launch]:
    """A launch whose store (a real server) is gone; the module's line and moves are undone after."""
    primary = _server()
    port = primary.port
    gone = _env.Launch(1, 4, 1, 4, "127.0.0.1", port, True, "standby-test", 0, "torchrun")
    monkeypatch.setattr(standby, "_line", [])
    monkeypatch.setattr(standby, "_where", None)
    monkeypatch.setattr(_env, "detect", lambda: gone)
    del primary
    yield gone
    rendezvous._stores.pop(("127.0.0.1", port), None)


def test_the_survivors_meet_at_the_first_standby_that_answers(launch: _env.Launch) -> None:
    first, second = _server(), _server()
    standby._line[:] = [("127.0.0.1", launch.master_port), ("127.0.0.1", _closed_port()),
                        ("127.0.0.1", first.port), ("127.0.0.1", second.port)]
    store = standby._move(launch, 10.0, RuntimeError("Broken pipe"))
    store.set("who", "first?")
    assert first.get("who") == b"first?" and not second.check(["who"])
    assert standby._where == ("127.0.0.1", first.port)
    assert rendezvous.store(launch, 10.0) is store  # the next init() wires through it


def test_a_failed_client_moves_and_the_answer_comes_from_the_standby(launch: _env.Launch) -> None:
    primary = _server()
    client = dist.TCPStore("127.0.0.1", primary.port, None, False, timeout=datetime.timedelta(seconds=5))
    moved = dataclasses.replace(launch, master_port=primary.port)
    rendezvous._stores[("127.0.0.1", primary.port)] = client
    good = _server()
    good.set("arrivals", "4")
    standby._line[:] = [("127.0.0.1", good.port)]
    del primary  # the server goes: the client's next request fails at once
    try:
        assert standby.meet(lambda s: int(s.add("arrivals", 1)), moved, 10.0) == 5
        assert rendezvous.store(moved, 10.0) is not client
    finally:
        rendezvous._stores.pop(("127.0.0.1", moved.master_port), None)


def test_no_standby_answering_is_a_named_failure(launch: _env.Launch) -> None:
    dead = _closed_port()
    standby._line[:] = [("127.0.0.1", dead)]
    with pytest.raises(CommunicatorFailedError) as info:
        standby._move(launch, 10.0, RuntimeError("Connection reset by peer"))
    text = str(info.value)
    assert f"127.0.0.1:{launch.master_port} failed (Connection reset by peer)" in text
    assert f"tried: 127.0.0.1:{dead}" in text and "torchring.elastic.init()" in text
    assert standby._where is None

