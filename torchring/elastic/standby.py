"""Standby stores: the rendezvous moves with the survivors when the store's host is lost.

The epochs (membership.py) are agreed through one store: the launcher's, which by default rank
0's process serves (or torchrun's agent on rank 0's host). Losing that host would leave the
survivors nowhere to meet, so every world keeps a line of succession:

    arm()       after each world is formed, every rank of local rank 0 or 1 that does not serve
                the store itself opens an empty TCPStore server (one per process, kept across
                epochs); one allgather of [IPv4, port] per rank ([0, 0]: none) gives every rank
                the same `_line` of standbys, in rank order
    meet(use)   runs use(store) on the job's store; when the store fails (a DistError: its
                process is gone and the connection closed, or it did not answer within the
                timeout), walks `_line` in order, skips the store that failed, and takes the
                first standby that answers within PROBE_S. Every survivor walks the same line
                and finds the same hosts dead, so they all meet at the same standby, which is
                the job's store from then on (rendezvous.move: the next init() wires through it)

A standby starts empty, and nothing from the old store is needed: every survivor knows the epoch
it left, and the next epoch's keys are written fresh. What a move cannot carry is the
launcher's address: a newcomer still looks for the job there, so after a move the job goes on
with its survivors and lets no newcomer in. Survivors that cannot reach one another (a network
split) may each find a different standby; the epoch's min_size keeps the smaller side out.
"""

from __future__ import annotations

import ipaddress
import socket
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from .._core import context as _context, env as _env, errors as _errors, log as _log, \
    rendezvous as _rendezvous
from ..collectives import basic as _basic

T = TypeVar("T")

PROBE_S = 2.0  # how long a standby may take to answer before the next in line is tried

_server: Any = None  # this process's standby server, once it has opened one
_line: list[tuple[str, int]] = []  # the current world's standbys (address, port), in rank order
_where: tuple[str, int] | None = None  # where the job's store is, once it has moved (None: the launcher's)


def line() -> list[tuple[str, int]]:
    """The current world's standbys (address, port) in the order the survivors try them."""
    return list(_line)


def _serves_store(launch: _env.Launch) -> bool:
    """Whether this process serves the job's store itself (it would go down with it)."""
    if _where is not None:
        return _server is not None and _where == (_address(launch), int(_server.port))
    return launch.rank == 0 and not launch.use_agent_store


def _address(launch: _env.Launch) -> str:
    """This host's address on the route to the store's host (what the other hosts reach)."""
    return _rendezvous.route_addr(launch.master_addr, _context.settings().addr)


def arm() -> None:
    """Opens this process's standby if it is in line and learns the world's line; every rank of
    the world calls it together, after the world is formed (elastic.init and reform do)."""
    global _server, _line
    if _context.size() == 1:
        _line = []
        return
    launch = _env.detect()
    mine = torch.zeros(2, dtype=torch.int64)
    if _context.local_rank() < 2 and not _serves_store(launch):
        if _server is None:
            _server = dist.TCPStore("0.0.0.0", 0, None, True, timeout=timedelta(seconds=_context.settings().timeout),
                                    wait_for_workers=False, multi_tenant=True)
        mine[0] = int(ipaddress.IPv4Address(_rendezvous.ipv4_of(_address(launch))))
        mine[1] = int(_server.port)
    rows = _basic.allgather(mine.view(1, 2)).tolist()
    _line = [(str(ipaddress.IPv4Address(ip)), port) for ip, port in rows if port]


def meet(use: Callable[[Any], T], launch: _env.Launch, timeout: float) -> T:
    """use(store) on the job's store; if that store fails, use(standby) on the first standby in
    line that answers (see the module docstring), which the job keeps as its store."""
    store = _rendezvous.store(launch, timeout)
    try:
        return use(store)
    except dist.DistError as exc:
        lost = exc
    return use(_move(launch, timeout, lost))


def _move(launch: _env.Launch, timeout: float, lost: BaseException) -> Any:
    """Connects to the first standby in line that answers and makes it the job's store."""
    global _where
    failed = _where or (_rendezvous.ipv4_of(launch.master_addr), launch.master_port)
    tried = []
    for addr, port in _line:
        if (addr, port) == failed:
            continue
        store = _connect(addr, port, timeout)
        if store is None:
            tried.append(f"{addr}:{port}")
            continue
        _log.logger.warning("the rendezvous store at %s:%d failed (%s); the survivors meet at the "
                            "standby at %s:%d from now on", failed[0], failed[1], str(lost).splitlines()[0],
                            addr, port)
        _rendezvous.move(launch, store)
        _where = (addr, port)
        return store
    raise _errors.CommunicatorFailedError(
        f"rank {_env.detect().rank} (as launched): the rendezvous store at {failed[0]}:{failed[1]} failed "
        f"({str(lost).splitlines()[0]}) and no standby answered (tried: {', '.join(tried) or 'none in line'}); "
        "call torchring.elastic.init() at the start so that the world keeps standbys, or serve the store "
        "on a host that stays")


def _connect(addr: str, port: int, timeout: float) -> Any:
    """A client of the standby at addr:port, or None if it does not answer within PROBE_S."""
    try:
        with socket.create_connection((addr, port), timeout=PROBE_S):
            pass
        store = dist.TCPStore(addr, port, None, False, timeout=timedelta(seconds=PROBE_S))
        store.check(["torchring/standby"])  # answers: the server runs, not just its host's kernel
    except (OSError, dist.DistError):
        return None
    store.set_timeout(timedelta(seconds=timeout))
    return store
