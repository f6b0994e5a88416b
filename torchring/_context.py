"""Process context: init(), shutdown() and the rendezvous that wires the engine up.

Rendezvous goes through torch.distributed.TCPStore. All keys live under
``torchring/{job}/{restart}/{generation}/`` so a restarted job (torchrun bumps the restart
count) or a second init() in the same process never reads stale keys:

1. rank 0 publishes ``secret``, a random per-job token checked in every TCP handshake;
2. every rank publishes ``host/{rank}`` and reads all of them: ranks with the same host
   identity form a local group (shared memory), the first rank of each host is its leader
   (TCP ring between hosts);
3. every rank creates its shared-memory segment, the leaders open a listening socket, and
   each publishes ``info/{rank}`` = {host, addr, port, pid, shm};
4. ranks map their local peers' segments, wait until the whole host has, and unlink their
   own name (nothing stays in /dev/shm, even after a crash); leaders connect the ring.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import math
import os
import secrets
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from . import _build, _env, _gpu_path
from ._errors import TorchringError
from ._settings import Settings


@dataclass
class _State:
    launch: _env.Launch
    comm: Any  # the engine's Communicator
    local_rank: int
    local_size: int
    transport: str
    settings: Settings
    pid: int = dataclasses.field(default_factory=os.getpid)  # the process that joined


_state: _State | None = None
_last_settings: Settings | None = None  # the last init()'s, kept after shutdown()
_generation = 0
_stores: dict[tuple[str, int], dist.Store] = {}


def _store(launch: _env.Launch, timeout: float) -> dist.Store:
    key = (launch.master_addr, launch.master_port)
    if key not in _stores:
        is_master = launch.rank == 0 and not launch.use_agent_store
        try:
            _stores[key] = dist.TCPStore(
                launch.master_addr, launch.master_port, launch.world_size, is_master,
                timeout=timedelta(seconds=timeout), wait_for_workers=False,
                multi_tenant=True,  # a torch.distributed group in this process can share it
            )
        except Exception as exc:
            role = "host" if is_master else "reach"
            raise TorchringError(
                f"rank {launch.rank}: cannot {role} the rendezvous store at "
                f"{launch.master_addr}:{launch.master_port} ({exc}); check MASTER_ADDR/MASTER_PORT, "
                "that the port is free on rank 0's host, and that rank 0 was started") from exc
    return _stores[key]


def _get(store: dist.Store, key: str, rank: int, what: str, timeout: float) -> bytes:
    try:
        store.wait([key], timedelta(seconds=timeout))
        return store.get(key)
    except Exception as exc:
        raise TorchringError(
            f"rank {rank}: rendezvous timed out after {timeout:g} s waiting for {what} "
            f"(store key {key!r}); is every rank started with the same WORLD_SIZE, MASTER_ADDR "
            "and MASTER_PORT, and is none of them dead?") from exc


def _route_addr(master_addr: str, override: str | None) -> str:
    """The local address on the route to the store's host (what peers can connect to)."""
    if override:
        return override
    try:
        target = socket.gethostbyname(master_addr)
    except OSError:
        target = master_addr
    if target.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((target, 9))
        return probe.getsockname()[0]


def _host_groups(hosts: list[str]) -> list[list[int]]:
    """Ranks per host identity, hosts ordered by their smallest rank."""
    groups: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        groups.setdefault(host, []).append(rank)
    return list(groups.values())


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


def _communicator(engine: Any, launch: _env.Launch, groups: list[list[int]], settings: Settings,
                  secret: str) -> Any:
    """The engine's Communicator for this rank (not started, not wired yet)."""
    my_group = next(g for g in groups if launch.rank in g)
    options = engine.CommOptions()
    options.rank, options.size, options.hosts = launch.rank, launch.world_size, groups
    options.timeout, options.secret = settings.timeout, secret
    options.segment_bytes = settings.shm_segment_kb << 10
    options.arena_bytes = settings.shm_arena_mb << 20
    options.spin_iters = settings.spin_iters(len(my_group), _env.available_cpus())
    return engine.Communicator(options)


def init(timeout: float | None = None) -> None:
    """Joins the job described by the launcher's environment (idempotent)."""
    global _state, _last_settings, _generation
    if _state is not None:
        return
    launch = _env.detect()
    settings = _read_settings(launch.rank, timeout)
    timeout, transport = settings.timeout, settings.transport
    engine = _build.load()
    rank, world = launch.rank, launch.world_size
    job_id = settings.job_id or launch.job_id
    prefix = f"torchring/{job_id}/{launch.restart}/{_generation}/"
    _generation += 1
    host = settings.hostname or socket.gethostname()

    store = _store(launch, timeout) if world > 1 else None
    if store is not None:
        if rank == 0:
            store.set(prefix + "secret", secrets.token_hex(16))
        secret = _get(store, prefix + "secret", rank, "rank 0's job secret", timeout).decode()
        if rank == 0:
            store.set(prefix + "transport", transport)
        theirs = _get(store, prefix + "transport", rank, "rank 0's transport", timeout).decode()
        if theirs != transport:
            raise ValueError(f"rank {rank}: TORCHRING_TRANSPORT is {transport!r} here but {theirs!r} on "
                             "rank 0; every rank must use the same transport setting")
        store.set(prefix + f"host/{rank}", host)
        hosts = [host if r == rank else _get(store, prefix + f"host/{r}", rank,
                                             f"rank {r} to join", timeout).decode()
                 for r in range(world)]
    else:
        secret, hosts = "", [host]
    real_groups = _host_groups(hosts)
    groups = [[r] for r in range(world)] if transport == "tcp" else real_groups
    my_real = next(g for g in real_groups if rank in g)

    comm = _communicator(engine, launch, groups, settings, secret)
    try:
        if store is not None:
            _wire(comm, store, prefix, launch, host, groups, settings)
        comm.start()
    except BaseException:
        comm.shutdown()
        raise
    local_rank = launch.local_rank if launch.local_rank is not None else my_real.index(rank)
    local_size = launch.local_world_size if launch.local_world_size is not None else len(my_real)
    used = "none" if world == 1 else "+".join(
        t for t, on in (("shm", comm.has_shm), ("tcp", comm.num_hosts > 1)) if on)
    _state = _State(launch, comm, local_rank, local_size, used or "none", settings)
    _last_settings = settings
    # At exit, a job that never called shutdown() still lets its last GPU collectives finish
    # and stops the NCCL watchdog before the CUDA runtime unloads (registered once).
    atexit.unregister(shutdown)
    atexit.register(shutdown)
    try:
        _gpu_path.setup(engine, dist.PrefixStore(prefix, store) if store is not None else None, rank,
                        world, local_rank, host, settings)
    except BaseException:
        shutdown()
        raise


def _wire(comm: Any, store: dist.Store, prefix: str, launch: _env.Launch, host: str,
          groups: list[list[int]], settings: Settings) -> None:
    rank, timeout = launch.rank, settings.timeout
    shm_name = comm.create_shm(f"{os.getpid()}{secrets.token_hex(3)}") if comm.has_shm else ""
    port, addr = None, None
    if comm.is_leader and comm.num_hosts > 1:
        addr = _route_addr(launch.master_addr, settings.addr)
        bind = settings.bind_addr
        if bind is None:
            bind = "127.0.0.1" if addr.startswith("127.") else ""  # "": every interface
        port = comm.listen(bind)
    info = {"host": host, "addr": addr, "port": port, "pid": os.getpid(), "shm": shm_name}
    store.set(prefix + f"info/{rank}", json.dumps(info))

    def info_of(r: int) -> dict:
        return json.loads(_get(store, prefix + f"info/{r}", rank, f"rank {r}'s address", timeout))

    comm.set_failure_board(dist.PrefixStore(prefix, store))
    group = groups[comm.host_index]
    if comm.has_shm:
        comm.attach_shm([shm_name if r == rank else info_of(r)["shm"] for r in group])
        mapped = prefix + f"mapped/{comm.host_index}"
        if store.add(mapped, 1) == len(group):
            store.set(mapped + "/all", "1")
        _get(store, mapped + "/all", rank, "every rank of this host to map shared memory", timeout)
        comm.unlink_shm()
    if comm.is_leader and comm.num_hosts > 1:
        right = groups[(comm.host_index + 1) % len(groups)][0]
        peer = info_of(right)
        comm.connect_ring(peer["addr"], int(peer["port"]))


def shutdown() -> None:
    """Leaves the job: fails queued collectives and closes every connection."""
    global _state
    if _state is None:
        return
    state, _state = _state, None
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
        raise RuntimeError(f"torchring.{what}() was called before torchring.init(); call "
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
