"""The GPU path: which way CUDA tensors go, chosen once per init(), the same on every rank.

- "nccl": a CUDA build of torch with NCCL and one GPU per rank. One NCCL communicator per
  process on its device (TORCHRING_DEVICE, else the device torch.cuda.set_device() chose
  before init() if not 0, else local_rank), bootstrapped with rank 0's unique id through
  the store. Collectives run on a torchring stream that first waits on the caller's current
  stream; Handle.wait() makes the current stream wait on the completion event without
  blocking the host, Handle.synchronize() blocks the host. Each collective's header is also
  compared across ranks by the CPU engine, off the caller's thread; a watchdog thread aborts
  NCCL (and later calls raise) when ranks disagree, a peer dies, NCCL reports an error, or a
  collective every rank issued does not complete within TORCHRING_TIMEOUT.
- "staged": several ranks share a GPU (NCCL refuses duplicate GPUs), NCCL is not built, or
  TORCHRING_CUDA_PATH=staged: CUDA tensors are copied to pinned host buffers, reduced by the
  CPU engine (shared memory / TCP), and copied back. Slower, but any job runs correctly.
- "none": no CUDA device, or TORCHRING_CUDA_PATH=off (a CPU-only job on a GPU host then
  creates no CUDA context); CUDA tensors are refused with an error saying why.

This module sets the path up (the choice, the NCCL communicator's creation and teardown);
``collectives`` dispatches CUDA tensors along it. ``choose_path`` and ``choose_device`` are
pure functions so that every branch is tested without a GPU (tests/unit/core/test_gpu_path.py).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from . import nccl_shrink as _nccl_shrink
from .log import logger
from .settings import DEFAULT_TIMEOUT_S, Settings

_path = "none"
_reason = "no CUDA device"
_comm: Any = None  # the engine's NcclComm on the "nccl" path
_device: torch.device | None = None
_timeout = DEFAULT_TIMEOUT_S


def choose_device(setting: int | None, current: int, count: int, local_rank: int) -> int:
    """This rank's CUDA device index: `setting` (TORCHRING_DEVICE), else the `current` device
    if the script chose one other than 0 before init(), else local_rank modulo `count`."""
    if setting is not None:
        if not 0 <= setting < count:
            raise ValueError(f"TORCHRING_DEVICE={setting}: expected a CUDA device index in "
                             f"[0, {count - 1}] (this host has {count}); unset it for the "
                             "default (the local rank)")
        return setting
    return current if current != 0 else local_rank % count


def choose_path(wanted: str, cuda_available: bool, nccl_built: bool, gpus: Sequence[str],
                device: int | None, rank: int = 0) -> tuple[str, str]:
    """(path, reason) for TORCHRING_CUDA_PATH=`wanted`. `gpus` holds every rank's GPU identity
    (host and device uuid, by rank; empty without CUDA), `device` this rank's index."""
    if wanted not in ("auto", "nccl", "staged", "off"):
        raise ValueError(f"TORCHRING_CUDA_PATH={wanted!r}: expected one of auto, nccl, staged, off")
    if wanted == "off":
        return "none", "TORCHRING_CUDA_PATH=off"
    if not cuda_available:
        return "none", "no CUDA device"
    if wanted == "staged":
        path, reason = "staged", "TORCHRING_CUDA_PATH=staged"
    elif not nccl_built:
        path, reason = "staged", "the engine was built without NCCL (python -m torchring.build)"
    elif len(set(gpus)) < len(gpus):
        path, reason = "staged", "several ranks share one GPU, which NCCL refuses"
    else:
        path, reason = "nccl", f"one GPU per rank, cuda:{device}"
    if wanted == "nccl" and path != "nccl":
        raise RuntimeError(f"rank {rank}: TORCHRING_CUDA_PATH=nccl, but {reason}; unset it to let "
                           "torchring choose, or fix the cause")
    return path, reason


def setup(engine: Any, store: Any, rank: int, world: int, local_rank: int, host: str,
          settings: Settings, shrink_from: tuple[Any, list[int] | None] | None = None) -> None:
    """Chooses the job's GPU path (every rank reaches the same choice) and joins NCCL if used.
    `store` is this init()'s key space (None for a single rank); `shrink_from` (a re-forming's
    kept communicator and the old ranks to leave out) is shrunk when every rank can
    (nccl_shrink.py), else a new communicator is made."""
    global _path, _reason, _comm, _device, _timeout
    teardown()
    _timeout, _device = settings.timeout, None
    # With TORCHRING_CUDA_PATH=off torch.cuda is not touched at all.
    available = settings.cuda_path != "off" and torch.cuda.is_available()
    index, gpus = None, []
    if available:
        index = choose_device(settings.device, torch.cuda.current_device(),
                              torch.cuda.device_count(), local_rank)
        torch.cuda.set_device(index)
        _device = torch.device("cuda", index)
        gpus = [f"{host}|{torch.cuda.get_device_properties(index).uuid}"]
        if world > 1:
            store.set(f"gpu/{rank}", gpus[0])
            gpus = [store.get(f"gpu/{r}").decode() for r in range(world)]
    _path, _reason = choose_path(settings.cuda_path, available, hasattr(engine, "NcclComm"),
                                 gpus, index, rank)
    if _path == "nccl":
        if shrink_from is not None:
            _comm = _nccl_shrink.shrunk(engine, shrink_from, store, rank, world, index, settings.timeout)
        if _comm is None:
            if world > 1 and rank == 0:
                store.set("nccl_id", engine.nccl_unique_id())
            unique_id = store.get("nccl_id") if world > 1 else engine.nccl_unique_id()
            _comm = engine.NcclComm(rank, world, index, unique_id, settings.timeout)
    if rank == 0:
        logger.log(logging.INFO if available else logging.DEBUG, "CUDA tensors take the %s path (%s)", _path, _reason)


def keep() -> Any:
    """teardown() that keeps the NCCL communicator (None if there is none) for a re-forming to
    shrink (nccl_shrink.py): its collectives in flight are let finish, nothing is freed."""
    global _comm, _path
    comm, _comm, _path = _comm, None, "none"
    if comm is not None:
        try:
            comm.drain(_timeout)
        except Exception:  # it failed: it is marked so, and is not shrunk
            pass
    return comm


def teardown() -> None:
    """Lets the NCCL collectives in flight finish (up to the timeout), then frees the NCCL
    communicator; a new init() makes a new one. Runs before the CPU engine stops, which
    still has to compare the last collectives' headers."""
    global _comm, _path
    comm, _comm, _path = _comm, None, "none"
    if comm is not None:
        try:
            comm.drain(_timeout)
        finally:
            comm.close()


def path() -> str:
    """'nccl', 'staged', or 'none' (no CUDA device)."""
    return _path


def reason() -> str:
    """Why the current path was taken."""
    return _reason


def device() -> torch.device | None:
    """This rank's CUDA device, if it has one."""
    return _device


def nccl_comm() -> Any:
    """The engine's NCCL communicator on the "nccl" path (else None)."""
    return _comm


def check(t: torch.Tensor, where: str) -> None:
    """Raises if CUDA tensors cannot be handled in this job."""
    if _path == "none":
        raise ValueError(f"{where}: tensor on {t.device}, but this job has no CUDA path "
                         f"({_reason}); move it to the CPU or run with a CUDA device")
    if _path == "nccl" and t.device != _device:
        raise ValueError(f"{where}: tensor on {t.device}, but this rank's NCCL communicator is on "
                         f"{_device}; move the tensor there (or set TORCHRING_DEVICE)")
