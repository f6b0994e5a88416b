"""Process context: init(), shutdown(), and what this process's place in the job is.

init() reads the launcher's environment (_env) and the settings (_settings), builds or loads
the engine (_build), meets the other ranks through the store and wires the communicator up
(_rendezvous), arms the flight recorder's dumps (torchring/trace), then chooses the GPU path
(_gpu_path).
"""

from __future__ import annotations

import atexit
import dataclasses
import math
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..trace import recorder as _recorder
from . import build as _build, env as _env, gpu_path as _gpu_path, rendezvous as _rendezvous, shm_room as _shm_room
from .log import logger
from .settings import Settings


@dataclass
class _State:
    launch: _env.Launch
    comm: Any  # the engine's Communicator
    local_rank: int
    local_size: int
    transport: str
    settings: Settings
    engine: Any = None  # the loaded engine module (groups build their communicators with it)
    store: Any = None  # the rendezvous store (None for a single rank)
    prefix: str = ""  # this init()'s store keys start with it
    secret: str = ""
    host: str = ""  # this rank's host identity
    master_addr: str = ""
    host_groups: list[list[int]] = dataclasses.field(default_factory=list)  # the world's, as wired
    next_group: int = 1  # the id the next new_group() gets (0 is the world)
    groups: dict[int, Any] = dataclasses.field(default_factory=dict)  # live groups' communicators
    world_group: Any = None  # torchring.world_group()'s object, made on first use
    world_target: Any = None  # group_wiring.target()'s for the world, made on first use
    pid: int = dataclasses.field(default_factory=os.getpid)  # the process that joined
    allreduce_now: Any = None  # the engine's allreduceNow without pybind's dispatcher (bindings.cpp)


_state: _State | None = None
_last_settings: Settings | None = None  # the last init()'s, kept after shutdown()
_generation = 0


def _read_settings(rank: int, timeout: float | None) -> Settings:
    """The environment's settings, with an explicit init(timeout=...) winning."""
    try:
        settings = Settings.from_env(os.environ)
    except ValueError as exc:
        raise ValueError(f"rank {rank}: {exc}") from None
    if timeout is None:
        return settings
    timeout = float(timeout)
    if not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"rank {rank}: init(timeout={timeout}): expected a positive number of seconds")
    return dataclasses.replace(settings, timeout=timeout)


def init(timeout: float | None = None, membership: tuple[int, int, int] | None = None,
         shrink_from: tuple[Any, list[int] | None] | None = None) -> None:
    """Joins the job described by the launcher's environment (idempotent); `membership`
    (rank, world size, epoch) replaces the launcher's ranks after an in-process re-forming
    (torchring.elastic), under the epoch's own store keys, and `shrink_from` is the old NCCL
    communicator with the old ranks to leave out (gpu_path.setup)."""
    global _state, _last_settings, _generation
    if _state is not None:
        return
    launch = _env.detect()
    if membership is not None:  # the hosts' rank counts changed too: wiring finds the local ranks
        launch = dataclasses.replace(launch, rank=membership[0], world_size=membership[1], local_rank=None,
                                     local_world_size=None)
    settings = _read_settings(launch.rank, timeout)
    engine = _build.load()
    rank, world = launch.rank, launch.world_size
    job_id = job(settings, launch)
    prefix = f"torchring/{job_id}/{launch.restart}/{_generation}/"
    if membership is not None:  # every member of the epoch, whatever its own count of init()s
        prefix = f"torchring/{job_id}/{launch.restart}/epoch-{membership[2]}/"
    _generation += 1
    host = settings.hostname or socket.gethostname()

    store = _rendezvous.store(launch, settings.timeout) if world > 1 else None
    wired = _rendezvous.connect(engine, store, prefix, rank, world, settings, host, launch.master_addr)
    comm, groups = wired.comm, wired.groups
    my_real = next(g for g in wired.real_groups if rank in g)
    local_rank = launch.local_rank if launch.local_rank is not None else my_real.index(rank)
    local_size = launch.local_world_size if launch.local_world_size is not None else len(my_real)
    if comm.has_shm and local_rank == 0:
        note = _shm_room.advice_once(local_size, settings.shm_arena_mb)
        if note:
            logger.warning("rank %d: %s", rank, note)
    used = "none" if world == 1 else "+".join(
        t for t, on in (("shm", comm.has_shm), ("tcp", comm.num_hosts > 1)) if on)
    _state = _State(launch, comm, local_rank, local_size, used or "none", settings, engine=engine,
                    store=store, prefix=prefix, secret=wired.secret, host=host,
                    master_addr=launch.master_addr, host_groups=groups,
                    allreduce_now=engine.allreduce_now_function(comm))
    _last_settings = settings
    # At exit, a job that never called shutdown() still lets its last GPU collectives finish
    # and stops the NCCL watchdog before the CUDA runtime unloads (registered once).
    atexit.unregister(shutdown)
    atexit.register(shutdown)
    # After shutdown's registration: at exit the recorder dumps a pending failure first, while
    # the communicators it reads still live.
    _recorder.arm(engine, rank, world, host, settings.trace_directory(job_id), settings.timeout,
                  settings.trace_frames, settings.status_s, settings.data_wait)
    try:
        _gpu_path.setup(engine, dist.PrefixStore(prefix, store) if store is not None else None, rank,
                        world, local_rank, host, settings, shrink_from)
    except BaseException:
        shutdown()
        raise


def job(settings: Settings, launch: _env.Launch) -> str:
    """The job's id: TORCHRING_JOB_ID, else the launcher's run id."""
    return settings.job_id or launch.job_id


def elastic_running_key(job_id: str, restart: int) -> str:
    """The store key torchring.elastic sets once job `job_id` (at launcher restart `restart`) has
    formed its first world: a process started later joins it as a newcomer (torchring-run's
    elastic mode waits for it before starting one)."""
    return f"torchring/{job_id}/{restart}/elastic/running"


def elastic_ended_key(job_id: str, restart: int) -> str:
    """The store key torchring-run's elastic mode sets once a worker of job `job_id` finished its
    script: a process still waiting to be let in then ends instead of waiting for members that
    are gone."""
    return f"torchring/{job_id}/{restart}/elastic/ended"


def launch_info() -> _env.Launch:
    """The launcher's view of this process, as init() used it (after a re-forming: the epoch's ranks)."""
    return _require("launch_info").launch


def wiring() -> tuple[Any, str, str]:
    """(store, key prefix, host) this world was wired through (store None for a single rank)."""
    state = _require("wiring")
    return state.store, state.prefix, state.host


def shutdown() -> None:
    """Leaves the job: destroys every group, fails queued collectives, closes every connection."""
    global _state
    if _state is None:
        return
    state, _state = _state, None
    _recorder.write_status(ending=True)  # while the communicators still hold their counts
    state.world_group = None  # it holds the state: without this, the communicator lives until a gc pass
    groups, state.groups = list(state.groups.values()), {}
    for comm in groups:  # every group first: their queues fail, the world's work may still end
        comm.shutdown()
    if state.pid != os.getpid():  # a forked child's copy: the parent's job, not its own
        state.comm.shutdown()  # the engine keeps it, closing and aborting nothing
        return
    _gpu_path.teardown()
    state.comm.shutdown()


def is_initialized() -> bool:
    """True between init() and shutdown()."""
    return _state is not None


def _require(what: str) -> _State:
    if _state is None:
        raise RuntimeError(f"torchring.{what}() was called while torchring is not initialized "
                           "(before torchring.init() or after torchring.shutdown()); call "
                           "torchring.init() once at the start of every rank")
    return _state


def rank() -> int:
    """This process's rank in [0, size())."""
    return _require("rank").launch.rank


def size() -> int:
    """Number of ranks in the job."""
    return _require("size").launch.world_size


def local_rank() -> int:
    """This process's rank among the ranks on its host."""
    return _require("local_rank").local_rank


def local_size() -> int:
    """Number of ranks on this host."""
    return _require("local_size").local_size


def transport() -> str:
    """The transports in use: 'shm', 'tcp', 'shm+tcp', or 'none' for a single rank."""
    return _require("transport").transport


def arena_mb() -> int:
    """Size of each rank's shared-memory arena in MiB (0: torchring.empty uses plain memory)."""
    return _require("empty").settings.shm_arena_mb


def settings() -> Settings:
    """The settings init() read; after shutdown() the last init()'s; before any init(), the
    environment's (parsed now)."""
    if _state is not None:
        return _state.settings
    return _last_settings if _last_settings is not None else Settings.from_env(os.environ)


def communicator(what: str) -> Any:
    """The engine communicator, or a RuntimeError naming `what` before init()."""
    return _require(what).comm
