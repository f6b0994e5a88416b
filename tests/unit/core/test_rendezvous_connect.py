"""connect()'s rendezvous (_core/rendezvous.py), before any engine is involved: every rank must
use rank 0's transport setting, for the world, the torch.distributed backend and the tests alike."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from torchring._core import rendezvous as _rendezvous
from torchring._core.settings import Settings


def _rank0_published(transport: str) -> dist.Store:
    store = dist.HashStore()
    store.set("job/secret", "s3cret")
    store.set("job/transport", transport)
    return store


def test_a_rank_with_another_transport_than_rank_0_is_refused() -> None:
    store = _rank0_published("shm")
    with pytest.raises(ValueError, match=r"rank 1: TORCHRING_TRANSPORT is 'tcp' here but 'shm' on rank 0; "
                                         "every rank must use the same transport setting"):
        _rendezvous.connect(None, store, "job/", 1, 2, Settings(transport="tcp", timeout=1.0), "h1", "127.0.0.1")
    assert not store.check(["job/host/1"]), "a refused rank publishes nothing more"


def test_the_same_transport_goes_on_to_the_hosts() -> None:
    store = _rank0_published("tcp")
    store.set("job/host/0", "h0")

    class Stop(Exception):
        pass

    class Engine:  # the first engine call ends the test: the rendezvous before it went through
        def CommOptions(self) -> None:  # noqa: N802 - the engine's name
            raise Stop

    with pytest.raises(Stop):
        _rendezvous.connect(Engine(), store, "job/", 1, 2, Settings(transport="tcp", timeout=1.0), "h1",
                            "127.0.0.1")
    assert store.get("job/host/1") == b"h1"
