"""A fake torchring session for API unit tests: one rank's _context state over communicators that
record every call, and a rendezvous that records what it would wire."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from torchring._core import context as _context, env as _env, rendezvous as _rendezvous
from torchring._core.settings import Settings
from torchring._core.types import OpKind

PREFIX = "torchring/job/0/0/"


class FakeWork:
    def __init__(self, result: Any, seq: int = 1) -> None:
        self.result, self.seq, self.waited = result, seq, 0

    def wait(self, timeout: float = 0.0) -> Any:
        self.waited += 1
        return self.result

    def synchronize(self, timeout: float = 0.0) -> Any:
        return self.wait(timeout)

    def is_completed(self) -> bool:
        return True


class FakeComm:
    """Records submit/send/recv/start/shutdown; `respond(kind, tensor, kw)` gives a Work's result
    (default: the tensor)."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log
        self.calls: list[tuple] = []
        self.respond: Callable[[OpKind, Any, dict], Any] = lambda kind, t, kw: t

    def submit(self, kind: int, t: Any, op: int, root: int, inline: bool, **kw: Any) -> FakeWork:
        self.calls.append((OpKind(kind), t, op, root, inline, kw))
        return FakeWork(self.respond(OpKind(kind), t, kw), len(self.calls))

    def allreduce_now(self, t: Any, op: int) -> bool:
        """The engine's allreduce fast path, declining: every call is recorded as a submit."""
        return False

    def send(self, t: torch.Tensor, peer: int, tag: int) -> FakeWork:
        self.calls.append(("send", t, peer, tag))
        return FakeWork(None)

    def recv(self, t: torch.Tensor, peer: int, tag: int) -> FakeWork:
        self.calls.append(("recv", t, peer, tag))
        return FakeWork(t)

    def start(self) -> None:
        self.log.append(f"{self.name} start")

    def shutdown(self) -> None:
        self.log.append(f"{self.name} shutdown")


class FakeWorld:
    """Rank `rank` of `size` ranks, hosts `hosts`; records the group communicators it makes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, rank: int, size: int,
                 hosts: list[list[int]] | None = None, timeout: float = 5.0) -> None:
        import torch.distributed as dist

        self.log: list[str] = []
        self.comms: list[FakeComm] = []
        self.made: list[tuple] = []  # (rank, size, hosts, overrides) per communicator()
        self.wired: list[tuple] = []  # (prefix, rank, hosts) per wire()
        self.store = dist.HashStore() if size > 1 else None
        self.world = FakeComm("world", self.log)
        launch = _env.Launch(rank, size, rank, size, "127.0.0.1", 0, True, "job", 0, "test")
        self.state = _context._State(
            launch, self.world, rank, size, "shm", Settings(timeout=timeout), engine=object(),
            store=self.store, prefix=PREFIX, secret="s3cret", host="here", master_addr="127.0.0.1",
            host_groups=hosts if hosts is not None else [list(range(size))],
            allreduce_now=self.world.allreduce_now)
        monkeypatch.setattr(_context, "_state", self.state)
        monkeypatch.setattr(_rendezvous, "communicator", self._communicator)
        monkeypatch.setattr(_rendezvous, "wire", self._wire)

    def _communicator(self, engine: Any, rank: int, size: int, hosts: list[list[int]],
                      settings: Settings, secret: str, **overrides: Any) -> FakeComm:
        assert engine is self.state.engine and secret == "s3cret" and settings is self.state.settings
        self.made.append((rank, size, hosts, overrides))
        comm = FakeComm(f"group{len(self.comms) + 1}", self.log)
        self.comms.append(comm)
        return comm

    def _wire(self, comm: Any, store: Any, prefix: str, rank: int, master_addr: str, host: str,
              hosts: list[list[int]], settings: Settings) -> None:
        assert store is self.store and master_addr == "127.0.0.1" and host == "here"
        self.wired.append((prefix, rank, hosts))

    def publish(self, gid: int, rank: int, ranks: list[int]) -> None:
        """What rank `rank`'s new_group(ranks) call number `gid` publishes."""
        self.store.set(f"{PREFIX}group/{gid}/ranks/{rank}", str(list(ranks)))
