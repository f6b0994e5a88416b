"""Where this process sits in the job, read from the launcher's environment.

Order: the torchrun contract (RANK, WORLD_SIZE, ...), then Open MPI, then PMI (MPICH,
Intel MPI), then SLURM; with none of them the job is a single process. torchring's own
variables (TORCHRING_*, including TORCHRING_JOB_ID, which overrides ``Launch.job_id``) are
read by settings.py, which also gives the messages here their shape.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from .settings import invalid

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class Launch:
    """The process's place in the job and how to reach the rendezvous store."""

    rank: int
    world_size: int
    local_rank: int | None
    local_world_size: int | None
    master_addr: str
    master_port: int
    use_agent_store: bool  # torchrun's agent already hosts the store: connect as a client
    job_id: str  # the launcher's run id (torchrun's, SLURM's), else "job"
    restart: int
    source: str  # "torchrun", "openmpi", "pmi", "slurm" or "single"


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which a launcher or cgroup may narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def source_address(host: str) -> str:
    """This host's address on the route to `host` (an IPv4 address or a name; no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return str(probe.getsockname()[0])


def _int(env: dict, name: str) -> int | None:
    """The launcher's variable `name` as an integer (None when unset or empty)."""
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise invalid(name, value, "an integer", "the launcher sets it: fix the launch command or "
                      "unset it") from None


def _first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list such as 'node[03-05,9],gpu1'."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not match:
        return "127.0.0.1"
    prefix, ranges = match.group(1), match.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def store_host(env: dict | None = None) -> str:
    """MASTER_ADDR (the host of rank 0's store) where the launcher set it, else this host: for a
    caller that was handed its rank and world already (torch.distributed's backend), whose
    launch variables may be partial (init_method="file://" or "tcp://", a test harness)."""
    return (os.environ if env is None else env).get("MASTER_ADDR") or "127.0.0.1"


def launcher_job_id(env: Mapping[str, str]) -> str:
    """The launcher's run id (torchrun's, SLURM's), else "job"; read without the rest of the launch."""
    return env.get("TORCHELASTIC_RUN_ID") or env.get("SLURM_JOB_ID") or "job"


def detect(env: dict | None = None) -> Launch:
    """Reads the launcher's variables (torchrun, Open MPI, PMI, SLURM) or returns world size 1."""
    env = dict(os.environ if env is None else env)
    job_id = launcher_job_id(env)
    restart = _int(env, "TORCHELASTIC_RESTART_COUNT") or 0
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    port = _int(env, "MASTER_PORT")
    if _int(env, "WORLD_SIZE") is not None:
        source, rank, world = "torchrun", _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_rank, local_world = _int(env, "LOCAL_RANK"), _int(env, "LOCAL_WORLD_SIZE")
        if rank is None:
            raise ValueError(f"WORLD_SIZE={world} is set but RANK is not; set RANK=0..{world - 1} "
                             "for each process, or launch with torchrun / torchring-run")
    elif _int(env, "OMPI_COMM_WORLD_SIZE") is not None:
        source, rank, world = "openmpi", _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
        local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
    elif _int(env, "PMI_SIZE") is not None:
        source, rank, world = "pmi", _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
        local_rank, local_world = _int(env, "MPI_LOCALRANKID"), _int(env, "MPI_LOCALNRANKS")
    elif _int(env, "SLURM_NTASKS") is not None and _int(env, "SLURM_PROCID") is not None:
        # The step's task count: a batch script run without srun is one task, not --ntasks.
        tasks = _int(env, "SLURM_STEP_NUM_TASKS") or _int(env, "SLURM_NTASKS")
        source, rank, world = "slurm", _int(env, "SLURM_PROCID"), tasks
        local_rank, local_world = _int(env, "SLURM_LOCALID"), None
        env.setdefault("MASTER_ADDR", _first_slurm_host(env.get("SLURM_JOB_NODELIST", "")))
        if port is None:
            port = DEFAULT_PORT + (_int(env, "SLURM_JOB_ID") or 0) % 1000
    else:
        return Launch(0, 1, 0, 1, "127.0.0.1", 0, False, job_id, restart, "single")
    assert rank is not None and world is not None
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside [0, {world}) (from {source} variables); "
                         "check the launcher's world size")
    addr = env.get("MASTER_ADDR")
    if addr is None:
        if world in (1, local_world):  # every rank is on this host
            addr = "127.0.0.1"
        else:
            raise ValueError(f"rank {rank}: MASTER_ADDR is not set ({source} launch over several "
                             "hosts); export MASTER_ADDR=<host of rank 0> (and MASTER_PORT) to every rank")
    return Launch(rank, world, local_rank, local_world, addr, port or DEFAULT_PORT,
                  agent, job_id, restart, source)
