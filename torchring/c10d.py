"""torchring as a torch.distributed backend: ``dist.init_process_group("torchring")``.

    import torchring                       # registers the name (cheap: nothing is built)
    dist.init_process_group("torchring")   # or backend="cpu:torchring,cuda:nccl"
    model = DistributedDataParallel(model) # DDP, FSDP, Lightning, dist.* run on torchring

torch calls ``_create`` once per process group (the world, then every ``new_group`` and
DeviceMesh sub-group, on its members only) with the group's store, already prefixed by torch,
as the rendezvous: no second store. ``_create`` meets the group's other ranks through it (the
job secret and the transport setting from the group's rank 0, every rank's host) and wires an
engine Communicator (shared memory within a host, TCP links between hosts, point-to-point
streams) with ``torchring.init()``'s own code (_core/rendezvous.py ``connect``), and wraps it
in the C++ backend (csrc/c10d/backend.h). The process group's timeout becomes the engine's: a
mismatch or a dead peer fails the op's Work and Future within it. ``destroy_process_group()``
shuts the communicator down.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import Any

import torch.distributed as dist

from ._core import build as _build, env as _env, rendezvous as _rendezvous
from ._core.settings import Settings
from .trace import recorder as _recorder

__all__ = ["register", "connect_backend", "BACKEND_NAME"]

BACKEND_NAME = "torchring"


def _label(group_id: str, ranks: list[int], world: int) -> str:
    if not ranks or ranks == list(range(world)) and group_id in ("0", ""):
        return ""
    return (f"torch.distributed group {group_id} of world ranks {ranks} (the ranks in this message "
            "are group ranks): ")


def _create(options: Any, pg_options: Any = None) -> Any:
    """torch's creator callback: the backend for one process group."""
    timeout = options.timeout.total_seconds() if options.timeout is not None else None
    ranks = list(getattr(options, "global_ranks_in_group", []) or [])
    size = int(options.group_size)
    world = dist.get_world_size() if dist.is_initialized() else size
    group_id = str(getattr(options, "group_id", ""))
    label = _label(group_id, ranks, max(world, size))
    desc = str(getattr(options, "group_desc", "") or ("default_pg" if group_id in ("0", "") else "group"))
    backend = connect_backend(options.store, int(options.group_rank), size, timeout, label,
                              trace=(f"c10d:{group_id or '0'}", desc, ranks))[0]
    if not dist.is_initialized():  # the default group: its ranks are the world's
        settings = Settings.from_env(os.environ)
        job_id = settings.job_id or _env.launcher_job_id(os.environ)  # torch gave the ranks: no detect()
        _recorder.arm(_build.load(), int(options.group_rank), size, settings.hostname or socket.gethostname(),
                      settings.trace_directory(job_id), timeout or settings.timeout, settings.trace_frames,
                      settings.status_s, settings.data_wait)
    return backend


def connect_backend(store: Any, rank: int, size: int, timeout: float | None, label: str = "",
                    store_host: str | None = None,
                    trace: tuple[str, str, list[int]] = ("c10d", "", [])) -> tuple[Any, Any]:
    """(C++ c10d backend, its engine Communicator) for one group of `size` ranks met through `store`;
    `trace` is the group's (name, description, world ranks) in flight-recorder dumps."""
    settings = Settings.from_env(os.environ)
    if timeout is not None:
        settings = dataclasses.replace(settings, timeout=float(timeout))
    engine = _build.load()
    host = settings.hostname or socket.gethostname()
    # The host of the store's address: where the route to it starts. torch hands the rank and
    # the world, so nothing else of the launch is read (its variables may be partial).
    master_addr = store_host or _env.store_host() if size > 1 else "127.0.0.1"
    # The group's arena (reserved, committed only as used) holds the tensors it all_reduces again
    # and again, DDP's buckets: their all_reduces are then zero-copy (csrc/c10d/backend_arena.cpp).
    comm = _rendezvous.connect(engine, store, "torchring/", rank, size, settings, host, master_addr,
                               secret_from="the group's rank 0", label=label, trace_name=trace[0],
                               trace_desc=trace[1], trace_ranks=list(trace[2])).comm
    return engine.make_c10d_backend(comm, rank, size, label), comm


def register() -> None:
    """Makes ``init_process_group("torchring")`` work in this process (idempotent, builds nothing)."""
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
