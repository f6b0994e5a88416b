"""Horovod's basics on torchring: the job's shape, what was built, op constants.

(hvd.init() and hvd.shutdown() are in runtime.py, above the process sets.) Ranks launched by torchring-run or torchrun also see
horovodrun's variables (``HOROVOD_RANK``, ``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK``,
``HOROVOD_LOCAL_SIZE``), set at import from the launcher's, so scripts that read them keep working.
"""

from __future__ import annotations

import os

import torch

from .._core import build as _build, context as _context
from .._core.types import ReduceOp
from .exceptions import HorovodInternalError

__all__ = ["is_initialized", "size", "rank", "local_size", "local_rank",
           "cross_size", "cross_rank", "mpi_built", "gloo_built", "nccl_built", "ddl_built",
           "ccl_built", "cuda_built", "rocm_built", "mpi_enabled", "gloo_enabled",
           "mpi_threads_supported", "HorovodInternalError", "Average", "Sum", "Adasum", "Min",
           "Max", "Product", "to_reduce_op", "op_name"]

# Reduction ops, as Horovod numbers them (ints, compared with ==).
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}
_ENGINE_OPS = {Sum: ReduceOp.SUM, Min: ReduceOp.MIN, Max: ReduceOp.MAX, Product: ReduceOp.PRODUCT}


def op_name(op: int) -> str:
    """'Average', 'Sum', ... for a Horovod op constant."""
    return _NAMES.get(op, repr(op))


def to_reduce_op(op: int) -> ReduceOp:
    """The engine's op for Sum/Min/Max/Product (Average is a Sum and a division; Adasum is not built)."""
    if op == Adasum:
        raise NotImplementedError("hvd.Adasum is not implemented by torchring; use hvd.Average or "
                                  "hvd.Sum (Horovod needs MPI and a power-of-two world for it)")
    if op not in _ENGINE_OPS:
        raise ValueError(f"op={op!r}: expected one of hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product")
    return _ENGINE_OPS[op]


def _export_launch_variables() -> None:
    """horovodrun's per-rank variables from torchrun's, for scripts that read them."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return
    pairs = {"HOROVOD_RANK": "RANK", "HOROVOD_SIZE": "WORLD_SIZE",
             "HOROVOD_LOCAL_RANK": "LOCAL_RANK", "HOROVOD_LOCAL_SIZE": "LOCAL_WORLD_SIZE"}
    for ours, theirs in pairs.items():
        if theirs in env:
            env.setdefault(ours, env[theirs])


_export_launch_variables()


_started = False  # set by runtime.init(), cleared by runtime.shutdown()


def is_initialized() -> bool:
    """True between hvd.init() and hvd.shutdown()."""
    return _started and _context.is_initialized()


def _require(what: str) -> _context._State:
    if not is_initialized():
        raise ValueError(f"hvd.{what}(): Horovod has not been initialized; call hvd.init() first "
                         "(torchring.horovod joins the job there)")
    state = _context._state
    assert state is not None
    return state


def size() -> int:
    """Number of ranks in the job."""
    return _require("size").launch.world_size


def rank() -> int:
    """This process's rank in [0, size())."""
    return _require("rank").launch.rank


def local_size() -> int:
    """Number of ranks on this host."""
    return _require("local_size").local_size


def local_rank() -> int:
    """This process's index among the ranks on its host."""
    return _require("local_rank").local_rank


def _cross(what: str) -> tuple[int, int]:
    """(cross_rank, cross_size): among the hosts with a rank of this local rank, this host's index."""
    state = _require(what)
    hosts = state.host_groups or [list(range(state.launch.world_size))]
    me, local = state.launch.rank, state.local_rank
    peers = [h for h in hosts if len(h) > local]
    mine = next(i for i, h in enumerate(peers) if me in h)
    return mine, len(peers)


def cross_rank() -> int:
    """Index of this host among the hosts that have a rank with this local rank."""
    return _cross("cross_rank")[0]


def cross_size() -> int:
    """Number of hosts that have a rank with this local rank."""
    return _cross("cross_size")[1]


def mpi_built() -> bool:
    """False: torchring needs no MPI."""
    return False


def gloo_built() -> bool:
    """False: torchring's own engine moves the data, not Gloo."""
    return False


def nccl_built() -> int:
    """The NCCL version the engine was built with (e.g. 22703), or 0 without NCCL."""
    info = _build.load().build_info()
    return int(info.get("nccl_version", 0)) if info.get("nccl") else 0


def ddl_built() -> bool:
    """False: IBM DDL is not supported."""
    return False


def ccl_built() -> bool:
    """False: oneCCL is not used."""
    return False


def cuda_built() -> bool:
    """True when CUDA tensors can be reduced (a CUDA build of torch; NCCL or the staged path)."""
    return bool(torch.version.cuda)


def rocm_built() -> bool:
    """True for a ROCm build of torch (its tensors take the staged path)."""
    return bool(getattr(torch.version, "hip", None))


def mpi_enabled() -> bool:
    """False: MPI is not the controller."""
    return False


def gloo_enabled() -> bool:
    """False: Gloo is not the controller."""
    return False


def mpi_threads_supported() -> bool:
    """False: there is no MPI (kept for scripts that ask)."""
    return False

