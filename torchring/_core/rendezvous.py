"""The rendezvous: how the ranks meet through a store and wire the engine's communicator up.

All keys live under a prefix ``torchring/{job}/{restart}/{generation}/`` (built by _context), so
a restarted job (torchrun bumps the restart count) or a second init() in the same process
never reads stale keys:

1. rank 0 publishes ``secret``, a random per-job token checked in every TCP handshake;
2. every rank publishes ``host/{rank}`` and reads all of them: ranks with the same host
   identity form a local group (shared memory), the first rank of each host is its leader
   (TCP links between hosts);
3. every rank creates its shared-memory region, the leaders open a listening socket for the
   links among them, every rank of a job on several hosts one for point-to-point messages, and each
   publishes ``info/{rank}`` = {host, addr, port, p2p_port, pid, shm};
4. ranks map their local peers' regions, wait until the whole host has, and unlink their
   own name (nothing stays in /dev/shm, even after a crash); leaders connect to their partner
   leaders (the links every cross-host schedule uses), measure them and publish
   ``links/{host}`` = [alpha, beta, gamma]; leader 0 publishes the largest of each as
   ``links/agreed``, which every rank's cost model takes; every rank learns where the ranks of
   other hosts listen for point-to-point messages (those connections open on first use).

connect() runs them all and starts the communicator: for the world (context.init), a group
(group_wiring.create, which knows the secret and the hosts already and so skips 1 and 2), the
torch.distributed backend (c10d._create) and the engine tests (N communicators on N threads
over one in-process HashStore). In step 1 rank 0 also publishes its ``transport``
(TORCHRING_TRANSPORT), and every rank refuses to go on with a different one.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
from datetime import timedelta
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from . import env as _env
from .errors import CommunicatorFailedError
from .settings import Settings

_stores: dict[tuple[str, int], dist.Store] = {}


def store(launch: _env.Launch, timeout: float) -> dist.Store:
    """The job's TCPStore (rank 0 hosts it unless the launcher's agent does); one per address."""
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
            raise CommunicatorFailedError(
                f"rank {launch.rank}: cannot {role} the rendezvous store at "
                f"{launch.master_addr}:{launch.master_port} ({exc}); check MASTER_ADDR/MASTER_PORT, "
                "that the port is free on rank 0's host, and that rank 0 was started") from exc
    return _stores[key]


def move(launch: _env.Launch, to: dist.Store) -> None:
    """The job's store moved (torchring.elastic's standby took over): store(launch) returns `to` from now on."""
    _stores[(launch.master_addr, launch.master_port)] = to


def failure_board(store: dist.Store, prefix: str) -> dist.Store:
    """The failure board of the world wired under `prefix`: the engine posts `failed/{rank}`
    (and `failed/latest`) there, and reads the others' posts."""
    return dist.PrefixStore(prefix, store)


def get(store: dist.Store, key: str, rank: int, what: str, timeout: float) -> bytes:
    """The value of `key`, waiting up to `timeout`; a CommunicatorFailedError naming `what` after that."""
    try:
        store.wait([key], timedelta(seconds=timeout))
        return store.get(key)
    except Exception as exc:
        raise CommunicatorFailedError(
            f"rank {rank}: rendezvous timed out after {timeout:g} s waiting for {what} "
            f"(store key {key!r}); is every rank started with the same WORLD_SIZE, MASTER_ADDR "
            "and MASTER_PORT, and is none of them dead?") from exc


def hosts_of(store: dist.Store, prefix: str, rank: int, world: int, host: str, timeout: float) -> list[str]:
    """Every rank's host name, by rank: this rank publishes `host` and reads the others'."""
    store.set(prefix + f"host/{rank}", host)
    return [host if r == rank else get(store, prefix + f"host/{r}", rank, f"rank {r} to join", timeout).decode()
            for r in range(world)]


def ipv4_of(host: str) -> str:
    """`host`'s IPv4 address, or `host` itself when it does not resolve."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def route_addr(master_addr: str, override: str | None) -> str:
    """The local address on the route to the store's host (what peers can connect to)."""
    if override:
        return override
    target = ipv4_of(master_addr)
    if target.startswith("127."):
        return "127.0.0.1"
    return _env.source_address(target)


def store_where(master_addr: str, infos: list[dict]) -> str:
    """How failure messages name the store when it does not answer: its host, its address and the
    ranks that run there (those whose route address to it is its own address)."""
    target = ipv4_of(master_addr)
    there = [r for r, info in enumerate(infos) if info.get("addr") == target]
    if not there:
        return f"the rendezvous store on {master_addr}"
    ranks = "rank " + str(there[0]) + " runs" if len(there) == 1 else \
        "ranks " + ", ".join(map(str, there)) + " run"
    return f"the rendezvous store on {infos[there[0]]['host']} ({target}, where {ranks})"


def host_groups(hosts: list[str]) -> list[list[int]]:
    """Ranks per host identity, hosts ordered by their smallest rank."""
    groups: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        groups.setdefault(host, []).append(rank)
    return list(groups.values())


def communicator(engine: Any, rank: int, world: int, groups: list[list[int]], settings: Settings,
                 secret: str, **overrides: Any) -> Any:
    """The engine's Communicator for `rank` (not started, not wired yet); `overrides` set
    further CommOptions fields (tests: one_shot_bytes)."""
    my_group = next(g for g in groups if rank in g)
    options = engine.CommOptions()
    options.rank, options.size, options.hosts = rank, world, groups
    options.timeout, options.secret = settings.timeout, secret
    options.segment_bytes = settings.shm_segment_kb << 10
    options.arena_bytes = settings.shm_arena_mb << 20
    options.staging_stores = ("auto", "cached", "streaming").index(settings.shm_stores)
    options.spin_iters = settings.spin_iters(len(my_group), _env.available_cpus())
    options.spin_auto = settings.spin is None
    options.trace_entries = settings.trace
    options.straggler_sec = settings.straggler_ms / 1000
    word, _, levels = settings.algo.partition(":")
    options.algo, options.levels = list(engine.ALGOS).index(word), int(levels or 0)
    options.header = list(engine.ALGOS).index(settings.header)  # "auto" is index 0
    for field, value in overrides.items():
        setattr(options, field, value)
    return engine.Communicator(options)


def wire(comm: Any, store: dist.Store, prefix: str, rank: int, master_addr: str, host: str,
         groups: list[list[int]], settings: Settings) -> None:
    """Steps 3 and 4 above for `comm` (made by communicator()); start() it afterwards."""
    timeout = settings.timeout
    shm_name = comm.create_shm(f"{os.getpid()}{secrets.token_hex(3)}") if comm.has_shm else ""
    port, addr, p2p_port = None, None, None
    if comm.num_hosts > 1:
        addr = route_addr(master_addr, settings.addr)
        bind = settings.bind_addr
        if bind is None:
            bind = "127.0.0.1" if addr.startswith("127.") else ""  # "": every interface
        if comm.is_leader:
            port = comm.listen(bind)
        p2p_port = comm.listen_p2p(bind)
    info = {"host": host, "addr": addr, "port": port, "p2p_port": p2p_port, "pid": os.getpid(),
            "shm": shm_name}
    store.set(prefix + f"info/{rank}", json.dumps(info))

    def info_of(r: int) -> dict:
        return json.loads(get(store, prefix + f"info/{r}", rank, f"rank {r}'s address", timeout))

    comm.set_failure_board(failure_board(store, prefix))
    group = groups[comm.host_index]
    if comm.has_shm:
        comm.attach_shm([shm_name if r == rank else info_of(r)["shm"] for r in group])
        mapped = prefix + f"mapped/{comm.host_index}"
        if store.add(mapped, 1) == len(group):
            store.set(mapped + "/all", "1")
        get(store, mapped + "/all", rank, "every rank of this host to map shared memory", timeout)
        comm.unlink_shm()
    if comm.is_leader and comm.num_hosts > 1:
        leaders = [info_of(g[0]) for g in groups]
        comm.connect_links([i["addr"] for i in leaders], [int(i["port"]) for i in leaders])
    if comm.num_hosts > 1:
        _agree_link_cost(comm, store, prefix, rank, len(groups), timeout)
    if comm.num_hosts > 1:
        mine = set(group)
        world = sum(len(g) for g in groups)
        others = [None if r in mine else info_of(r) for r in range(world)]
        comm.set_p2p_peers([i["addr"] if i else "" for i in others],
                           [int(i["p2p_port"]) if i else -1 for i in others])
        comm.set_failure_board(failure_board(store, prefix),
                               store_where(master_addr, [i or info for i in others]))


def _agree_link_cost(comm: Any, store: dist.Store, prefix: str, rank: int, hosts: int,
                     timeout: float) -> None:
    """Every leader measures its links (alpha, beta, alpha_group) and host (gamma); every rank of
    the job then sets the largest of each, so every rank's cost model chooses the same algorithms."""
    if comm.is_leader:
        store.set(prefix + f"links/{comm.host_index}", json.dumps(comm.measure_links()))
        if comm.host_index == 0:
            costs = [json.loads(get(store, prefix + f"links/{h}", rank, f"host {h}'s link measurement",
                                    timeout)) for h in range(hosts)]
            store.set(prefix + "links/agreed", json.dumps([max(c[i] for c in costs) for i in range(4)]))
    alpha, beta, gamma, alpha_group = json.loads(get(store, prefix + "links/agreed", rank,
                                                     "the leaders' link measurements", timeout))
    comm.set_link_cost(alpha, beta, gamma, alpha_group)


@dataclass
class Connection:
    """What connect() wired: the started communicator and what the job learnt on the way."""

    comm: Any  # the engine's Communicator, started
    secret: str  # the job secret every TCP handshake checks
    groups: list[list[int]]  # ranks per host as wired (TORCHRING_TRANSPORT=tcp: one per rank)
    real_groups: list[list[int]]  # ranks per host identity, whatever the transport


def _meet(store: dist.Store, prefix: str, rank: int, size: int, host: str, settings: Settings,
          secret_from: str) -> tuple[str, list[str]]:
    """Steps 1 and 2 above: the job secret and every rank's host, after checking that every
    rank uses rank 0's transport."""
    timeout, transport = settings.timeout, settings.transport
    if rank == 0:
        store.set(prefix + "secret", secrets.token_hex(16))
    secret = get(store, prefix + "secret", rank, secret_from, timeout).decode()
    if rank == 0:
        store.set(prefix + "transport", transport)
    theirs = get(store, prefix + "transport", rank, "rank 0's transport", timeout).decode()
    if theirs != transport:
        raise ValueError(f"rank {rank}: TORCHRING_TRANSPORT is {transport!r} here but {theirs!r} on "
                         "rank 0; every rank must use the same transport setting")
    return secret, hosts_of(store, prefix, rank, size, host, timeout)


def connect(engine: Any, store: dist.Store | None, prefix: str, rank: int, size: int, settings: Settings,
            host: str, master_addr: str, secret: str | None = None,
            groups: list[list[int]] | None = None, secret_from: str = "rank 0's job secret",
            **overrides: Any) -> Connection:
    """A started communicator for `rank` of `size`, wired through `store` under `prefix`.

    Without `secret` and `groups` the ranks meet first (steps 1 and 2; `secret_from` names rank
    0's secret in a timeout's message); with them (a group of a wired world, the engine tests)
    they do not. `store` may be None for a single rank; `overrides` set further CommOptions
    fields (arena_bytes, label, one_shot_bytes)."""
    if groups is None:
        if size > 1:
            assert store is not None, "several ranks meet through a store"
            secret, hosts = _meet(store, prefix, rank, size, host, settings, secret_from)
        else:
            secret, hosts = "", [host]
        real_groups = host_groups(hosts)
        groups = [[r] for r in range(size)] if settings.transport == "tcp" else real_groups
        overrides.setdefault("host_names", [hosts[g[0]] for g in groups])
    else:
        real_groups = groups
    comm = communicator(engine, rank, size, groups, settings, secret or "", **overrides)
    try:
        if size > 1:
            assert store is not None, "several ranks meet through a store"
            wire(comm, store, prefix, rank, master_addr, host, groups, settings)
        comm.start()
    except BaseException:
        comm.shutdown()
        raise
    return Connection(comm, secret or "", groups, real_groups)
