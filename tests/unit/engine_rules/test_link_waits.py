"""The TCP links' own-link rule (csrc/transport/tcp/held_by_link.cpp), on loopback sockets in
process: a wait counts as this rank's own link's (core/waits.h own()) when TCP holds bytes it
has not sent though the peer's receive window has room; a peer that does not read, whose window
is full, is the peer's doing, and a socket with nothing left to send holds nothing back."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from torchring._core import build as _build

ENGINE = _build.load()
SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)


def _pair() -> tuple[socket.socket, socket.socket]:
    listener = socket.create_server(("127.0.0.1", 0))
    sender = socket.create_connection(listener.getsockname())
    receiver, _ = listener.accept()
    listener.close()
    sender.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sender, receiver


def _fill(sender: socket.socket, limit: int) -> int:
    """Sends up to `limit` bytes without blocking; how many went into the socket."""
    sender.setblocking(False)
    sent, chunk = 0, b"\0" * 65536
    while sent < limit:
        try:
            sent += sender.send(chunk[: min(len(chunk), limit - sent)])
        except BlockingIOError:
            break
    return sent


def test_a_socket_with_nothing_left_to_send_holds_nothing_back() -> None:
    sender, receiver = _pair()
    with sender, receiver:
        sender.sendall(b"x" * 1000)
        assert len(receiver.recv(1000, socket.MSG_WAITALL)) == 1000
        assert ENGINE._send_held_by_link(sender.fileno()) is False


def test_a_paced_link_holds_the_bytes_back() -> None:
    sender, receiver = _pair()
    with sender, receiver:
        try:  # TCP's own pacing at 200 kB/s: the socket's way out is now slow, the peer is not
            sender.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, 200_000)
        except OSError as e:
            pytest.fail(f"SO_MAX_PACING_RATE refused: {e}")
        total = _fill(sender, 1 << 20)
        assert total > 200_000
        reader = threading.Thread(target=receiver.recv, args=(total, socket.MSG_WAITALL), daemon=True)
        reader.start()  # the peer reads all it gets: its window stays open
        time.sleep(0.05)
        assert ENGINE._send_held_by_link(sender.fileno()) is True
        sender.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, struct.pack("=Q", 2**64 - 1))  # unpaced again
        reader.join(10)
        assert not reader.is_alive()
        assert ENGINE._send_held_by_link(sender.fileno()) is False


def test_a_peer_that_does_not_read_is_not_this_ranks_link() -> None:
    sender, receiver = _pair()
    with sender, receiver:
        receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        _fill(sender, 64 << 20)  # until the peer's window and this socket's buffer are full
        time.sleep(0.2)
        assert ENGINE._send_held_by_link(sender.fileno()) is False
