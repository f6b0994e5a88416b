"""torchring as torchft's process group: ``ProcessGroupTorchring`` in place of ``ProcessGroupGloo``.

    from torchft import Manager
    from torchring.elastic.torchft import ProcessGroupTorchring
    manager = Manager(pg=ProcessGroupTorchring(), ...)   # everything else as with gloo

torchft (PyPI ``torchft``) computes a quorum of replica groups every step and, whenever the
quorum changes, calls ``configure(store_addr, replica_id, rank, world_size)`` with a fresh store
prefix. Each call builds a new group: torchft's ``ProcessGroupWrapper.configure`` aborts the old
one and hands ``_create_pg`` a store client, which meets the quorum's other ranks through it with
the same code as ``init_process_group("torchring")`` (c10d.connect_backend: one engine
Communicator, shared memory within a host, TCP between hosts) and registers that backend for
CPU and CUDA tensors in a torch ProcessGroup.

Failure, as torchft expects it of a process group:
- ``abort()`` may come from another thread (the Manager's quorum or timeout path): the
  operation in flight fails at once, on this rank and its peers (Communicator.abort), and so
  does every later one until ``configure()``.
- ``errored()`` returns the group's first failure (a dead or silent peer, a peer that left, an
  abort) as a RuntimeError, or None while the group is healthy.
- ``shutdown()`` closes the group; a peer still waiting for this rank fails at once with
  "Connection closed by peer" (the shared-memory departure flag, or the closed TCP link).
- ``set_timeout()`` applies from the next ``configure()``, as for torchft's gloo group.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

import torch
from torch.distributed import ProcessGroup as BaseProcessGroup
from torchft.process_group import ProcessGroupWrapper

from ..c10d import connect_backend

__all__ = ["ProcessGroupTorchring"]


def _store_host(store_addr: str) -> str:
    """The host of torchft's "host:port/prefix" store address (brackets of IPv6 removed)."""
    where = store_addr.split("/", 1)[0]
    host = where.rsplit(":", 1)[0] if ":" in where else where
    return host.strip("[]")


class ProcessGroupTorchring(ProcessGroupWrapper):
    """torchft's reconfigurable process group on the torchring engine (a drop-in for ProcessGroupGloo)."""

    def __init__(self, timeout: timedelta = timedelta(seconds=60), pg: Any = None) -> None:
        super().__init__(timeout=timeout, pg=pg)
        self._comm: Any = None
        self._store_host: Optional[str] = None
        self._abort_error: Optional[RuntimeError] = None

    def getBackendName(self) -> str:
        """torchft's name for this kind of process group."""
        return "torchft-torchring"

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                  quorum_id: Optional[int] = None, group_rank: Optional[int] = None,
                  group_world_size: Optional[int] = None, global_ranks: Optional[list[int]] = None) -> None:
        """Replaces the group with a new one of `world_size` ranks met under `store_addr` (host:port/prefix)."""
        self._store_host = _store_host(store_addr)
        super().configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank,
                          group_world_size, global_ranks)
        self._abort_error = None

    def _create_pg(self, store: Any, rank: int, world_size: int) -> BaseProcessGroup:
        label = f"torchft replica {self._replica_id} (quorum {self._quorum_id}): "
        backend, comm = connect_backend(store, rank, world_size, self._timeout.total_seconds(),
                                        label, self._store_host)
        pg = BaseProcessGroup(store, rank, world_size)
        kind = BaseProcessGroup.BackendType.CUSTOM
        pg._set_default_backend(kind)
        for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
            pg._register_backend(torch.device(device), kind, backend)
        self._comm = comm
        return pg

    def abort(self, errored: bool = True) -> None:
        """Fails the operation in flight and every later one, here and on the peers (any thread)."""
        if errored and self._comm is not None and self._abort_error is None:
            self._abort_error = RuntimeError(
                f"rank {self._rank} of torchft replica {self._replica_id}: the torchring process group "
                f"was aborted (quorum {self._quorum_id}); configure() forms a new one")
        super().abort(errored)
        self._comm = None

    def shutdown(self) -> None:
        """Closes the group: peers still waiting for this rank fail at once."""
        comm, self._comm, self._pg = self._comm, None, None
        if comm is not None:
            comm.shutdown()

    def errored(self) -> Optional[Exception]:
        """The group's first failure as a RuntimeError (it must be configured anew), or None."""
        if self._abort_error is not None:
            return self._abort_error
        comm = self._comm
        failure = comm.failure() if comm is not None else ""
        if not failure:
            return None
        return RuntimeError(f"the torchring process group is aborted by its first failure ({failure}); "
                            "configure() forms a new one")
