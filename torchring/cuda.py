"""The GPU path: CUDA tensors over NCCL, or staged through pinned host memory.

The path is chosen once per init(), the same on every rank:
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
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import torch

_path = "none"
_reason = "no CUDA device"
_comm: Any = None
_device: torch.device | None = None
_timeout = 300.0


class _NcclHandleWork:
    """Adapts an NCCL work to the interface Handle expects."""

    seq = -1

    def __init__(self, work: Any) -> None:
        self._work = work

    def wait(self, timeout: float = 0.0) -> torch.Tensor:
        if timeout > 0:
            self._work.synchronize(timeout)
        return self._work.wait()

    def synchronize(self, timeout: float = 0.0) -> torch.Tensor:
        return self._work.synchronize(timeout)

    def is_completed(self) -> bool:
        return self._work.is_completed()


def _choose_device(local_rank: int) -> int:
    if os.environ.get("TORCHRING_DEVICE"):
        return int(os.environ["TORCHRING_DEVICE"])
    current = torch.cuda.current_device()
    return current if current != 0 else local_rank % torch.cuda.device_count()


def setup(engine: Any, store: Any, prefix: str, rank: int, world: int, local_rank: int,
          host: str, timeout: float) -> None:
    """Chooses the job's GPU path (every rank reaches the same choice) and joins NCCL if used."""
    global _path, _reason, _comm, _device, _timeout
    teardown()
    _timeout = timeout
    wanted = os.environ.get("TORCHRING_CUDA_PATH", "auto").lower()
    if wanted not in ("auto", "nccl", "staged", "off"):
        raise ValueError(f"TORCHRING_CUDA_PATH={wanted!r}: expected auto, nccl, staged or off")
    if not torch.cuda.is_available() or wanted == "off":
        _path, _reason = "none", "no CUDA device" if wanted != "off" else "TORCHRING_CUDA_PATH=off"
        return
    index = _choose_device(local_rank)
    torch.cuda.set_device(index)
    _device = torch.device("cuda", index)
    gpus = [f"{host}|{torch.cuda.get_device_properties(index).uuid}"]
    if world > 1:
        store.set(prefix + f"gpu/{rank}", gpus[0])
        gpus = [store.get(prefix + f"gpu/{r}").decode() for r in range(world)]
    shared = len(set(gpus)) < world
    if wanted == "staged":
        _path, _reason = "staged", "TORCHRING_CUDA_PATH=staged"
    elif not hasattr(engine, "NcclComm"):
        _path, _reason = "staged", "the engine was built without NCCL (python -m torchring.build)"
    elif shared:
        _path, _reason = "staged", "several ranks share one GPU, which NCCL refuses"
    else:
        _path, _reason = "nccl", f"one GPU per rank, cuda:{index}"
    if wanted == "nccl" and _path != "nccl":
        raise RuntimeError(f"rank {rank}: TORCHRING_CUDA_PATH=nccl, but {_reason}")
    if _path == "nccl":
        if world > 1 and rank == 0:
            store.set(prefix + "nccl_id", engine.nccl_unique_id())
        unique_id = store.get(prefix + "nccl_id") if world > 1 else engine.nccl_unique_id()
        _comm = engine.NcclComm(rank, world, index, unique_id, timeout)
    if rank == 0:
        print(f"torchring: CUDA tensors take the {_path} path ({_reason})", file=sys.stderr, flush=True)


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


def check(t: torch.Tensor, where: str) -> None:
    """Raises if CUDA tensors cannot be handled in this job."""
    if _path == "none":
        raise ValueError(f"{where}: tensor on {t.device}, but this job has no CUDA path "
                         f"({_reason}); move it to the CPU or run with a CUDA device")
    if _path == "nccl" and t.device != _device:
        raise ValueError(f"{where}: tensor on {t.device}, but this rank's NCCL communicator is on "
                         f"{_device}; move the tensor there (or set TORCHRING_DEVICE)")


def _staged(t: torch.Tensor, run: Callable[[torch.Tensor], Any],
            back: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    from .collectives import Handle
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t)  # synchronous: the host copy is complete before the CPU engine reads it
    return Handle(run(host)._work, back)


def _check(kind: Any, t: torch.Tensor, op: int = 0, root: int = -1) -> Any:
    """Queues the engine's comparison of this NCCL collective's header across ranks (kind,
    dtype, count, op, root, shape). It runs on the engine's thread, in order with every other
    collective, and never blocks the caller; NCCL's watchdog aborts on a mismatch."""
    from . import _context
    return _context.communicator(kind.name.lower()).submit_check(int(kind), t, int(op), root)


def allreduce(t: torch.Tensor, op: int) -> Any:
    """Starts an allreduce of a CUDA tensor; returns a Handle."""
    from . import collectives
    if _path == "nccl":
        check = _check(collectives._Kind.ALLREDUCE, t, op)
        return collectives.Handle(_NcclHandleWork(_comm.allreduce(t, int(op), check)))
    return _staged(t, lambda h: collectives.allreduce_async(h, op), lambda out: t.copy_(out))


def broadcast(t: torch.Tensor, src: int) -> Any:
    """Starts a broadcast of a CUDA tensor; returns a Handle."""
    from . import collectives
    if _path == "nccl":
        check = _check(collectives._Kind.BROADCAST, t, root=src)
        return collectives.Handle(_NcclHandleWork(_comm.broadcast(t, src, check)))
    return _staged(t, lambda h: collectives.broadcast_async(h, src), lambda out: t.copy_(out))


def allgather(t: torch.Tensor) -> Any:
    """Starts an allgather of a CUDA tensor; returns a Handle."""
    from . import collectives
    if _path == "nccl":
        rows = collectives.allgather(torch.tensor([t.shape[0]], dtype=torch.int64)).tolist()
        check = _check(collectives._Kind.ALLGATHER, t)
        return collectives.Handle(_NcclHandleWork(_comm.allgather(t, rows, check)))
    return _staged(t, collectives.allgather_async, lambda out: out.to(t.device))


def reduce_scatter(t: torch.Tensor, op: int) -> Any:
    """Starts a reduce_scatter of a CUDA tensor; returns a Handle of this rank's rows."""
    from . import collectives
    if _path == "nccl":
        check = _check(collectives._Kind.REDUCE_SCATTER, t, op)
        return collectives.Handle(_NcclHandleWork(_comm.reduce_scatter(t, int(op), check)))
    return _staged(t, lambda h: collectives.reduce_scatter_async(h, op), lambda out: out.to(t.device))
