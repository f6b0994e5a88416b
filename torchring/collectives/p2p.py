"""Point-to-point: send, recv, isend, irecv between two ranks of a group.

Messages between two ranks match in order per tag: the n-th recv from a rank with a tag gets
that rank's n-th send with that tag to this rank, whatever else runs meanwhile (p2p does not
take part in the collectives' order). The receiving tensor must have as many bytes as the sent
one. Within a host the bytes go through shared memory, across hosts over a direct TCP
connection opened on first use. A send completes once the peer's recv took it; a peer that
never posts the matching call fails the group's communicator after the timeout. CUDA tensors
go through a host copy. `dst`/`src` are ranks of the group (the world's for ``group=None``).

``src=None`` receives from any source, as MPI_ANY_SOURCE: the first message of `tag` from any
rank (the earliest arrived one when several wait), each rank's messages still in the order
sent; the Handle's ``source_rank()`` names the sender once it completed.
"""

from __future__ import annotations

from typing import Any

import torch

from .._core.group_wiring import GroupBase, Target, target
from .._core.types import Handle, profiled
from . import _checks
from .basic import _host

__all__ = ["send", "recv", "isend", "irecv"]


def _check_tag(tag: Any, what: str, tg: Target) -> int:
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < 2**63:
        raise ValueError(f"{tg.where(what)}: tag must be an integer in [0, 2**63), got {tag!r}")
    return tag


def _check_peer(peer: Any, name: str, what: str, tg: Target) -> int:
    peer = _checks.check_rank(peer, name, what, tg)
    if peer == tg.rank:
        raise ValueError(f"{tg.where(what)}: {name}={peer} is this rank itself; send to and "
                         "receive from other ranks only")
    return peer


def _send(tensor: torch.Tensor, dst: int, tag: int, group: GroupBase | None, what: str) -> Handle:
    tg = target(group, what)
    t = _checks.check_tensor(tensor, what, tg)
    dst = _check_peer(dst, "dst", what, tg)
    tag = _check_tag(tag, what, tg)
    return Handle(tg.comm.send(_host(t), dst, tag), lambda _: None)


ANY_SOURCE = -1  # the engine's P2P::kAnySource


def _recv(tensor: torch.Tensor, src: int | None, tag: int, group: GroupBase | None, what: str) -> Handle:
    tg = target(group, what)
    t = _checks.check_tensor(tensor, what, tg)
    src = ANY_SOURCE if src is None else _check_peer(src, "src", what, tg)
    tag = _check_tag(tag, what, tg)
    if not t.is_cuda:
        return Handle(tg.comm.recv(t, src, tag))
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return Handle(tg.comm.recv(host, src, tag), t.copy_)


@profiled
def isend(tensor: torch.Tensor, dst: int, tag: int = 0, group: GroupBase | None = None) -> Handle:
    """Starts sending `tensor` to rank `dst` (keep it unchanged until wait()); wait() returns None."""
    return _send(tensor, dst, tag, group, "isend")


@profiled
def send(tensor: torch.Tensor, dst: int, tag: int = 0, group: GroupBase | None = None) -> None:
    """Sends `tensor` to rank `dst`; returns once its matching recv took it."""
    _send(tensor, dst, tag, group, "send").wait()


@profiled
def irecv(tensor: torch.Tensor, src: int | None = None, tag: int = 0, group: GroupBase | None = None) -> Handle:
    """Starts receiving rank `src`'s (None: any rank's) next send with `tag` into `tensor`; wait() returns `tensor`."""
    return _recv(tensor, src, tag, group, "irecv")


@profiled
def recv(tensor: torch.Tensor, src: int | None = None, tag: int = 0,
         group: GroupBase | None = None) -> torch.Tensor:
    """Receives rank `src`'s (None: any rank's) next send with `tag` into `tensor` and returns it."""
    return _recv(tensor, src, tag, group, "recv").wait()
