"""Re-forming the world in process: leave the broken communicator, agree on the next epoch's
members through the store (membership.py), and wire a new communicator for them.

    try:
        step()
    except torchring.CommunicatorFailedError:
        epoch = torchring.elastic.reform()      # the survivors, ranked 0..n-1 again
        ...                                     # restore the last commit, sync it, go on

No process starts again: the survivors keep their interpreter, imports, engine, data-loader
workers and memory; a re-forming costs the failure's detection, `settle` seconds of waiting
for joiners when a member died silently, and one init() of the engine (see
benchmarks/RESULTS.md for the times measured).

The store is the launcher's (torchrun's agent, rank 0's process, or the job's own). When it is
lost with its host, the survivors meet at the first standby store that answers (standby.py):
every world started with init() keeps a line of them. The world's groups end with the old
communicator: new_group() again after a re-forming, as Horovod's process sets are re-made.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from .._core import context as _context, env as _env, gpu_path as _gpu_path, log as _log, \
    nccl_shrink as _nccl_shrink, rendezvous as _rendezvous
from ..collectives import basic as _basic
from ..trace import status as _status
from . import membership, standby
from .membership import Epoch, Member, NotAMemberError

_epoch = 0  # the epoch this process's world belongs to (0: the launcher's)
_store: Any = None  # the store the last re-forming met through (a world of 1 keeps none in its wiring)

DEFAULT_SETTLE_S = 1.0
JOIN_TIMEOUT_S = 600.0  # how long a process left out waits to be let in (Horovod's elastic timeout)
STORE_LOST = -1  # joiners_waiting()'s answer when the store failed: re-form through a standby now


class WorldChanged(Exception):
    """Raised by State.commit() on every rank when processes wait to join, or when the store
    failed (joiners == STORE_LOST): run() re-forms the world (Horovod's HostsUpdatedInterrupt)."""

    def __init__(self, joiners: int) -> None:
        super().__init__(f"{joiners} process(es) wait to join the world" if joiners >= 0 else
                         "the rendezvous store failed; the world re-forms through a standby store")
        self.joiners = joiners


def epoch() -> int:
    """The membership epoch of the current world: 0 as launched, +1 at each re-forming."""
    return _epoch


def _running_key(launch: _env.Launch) -> str:
    return _context.elastic_running_key(_context.job(_context.settings(), launch), launch.restart)


def _job(launch: _env.Launch) -> str:
    """The key space of this job's epochs: its id and the launcher's restart count."""
    return f"{_context.job(_context.settings(), launch)}/{launch.restart}"


def _me(settings: Any, old_rank: int) -> Member:
    """This process as a joiner: host:pid, its rank in the world it leaves (-1: a newcomer)."""
    host = settings.hostname or socket.gethostname()
    return Member(f"{host}:{os.getpid()}", old_rank, host)


def init(timeout: float | None = None, join_timeout: float = JOIN_TIMEOUT_S) -> Epoch:
    """Joins the job: as launched when it is starting (torchring.init()), or, when its world
    already runs (a replacement, a host added), as a newcomer that the members let in at
    their next State.commit(); a newcomer ends (SystemExit(0)) if the launcher says the job
    finished while it waited. Returns the epoch joined."""
    global _epoch, _store
    launch = _env.detect()
    settings = _context.settings()
    wait = settings.timeout if timeout is None else float(timeout)
    if launch.source == "single":
        _context.init(timeout)
        return Epoch(0, (), 0)
    store = _store = _rendezvous.store(launch, wait)
    job = _job(launch)
    if not store.check([_running_key(launch)]):
        _context.init(timeout)
        if _context.rank() == 0:
            store.set(_running_key(launch), "1")
        standby.arm()
        return Epoch(0, (), _context.rank())
    me = _me(settings, -1)
    ended = _ended_key(launch)
    try:
        joined = membership.join(store, job, membership.current(store, job) + 1, me, expected=0, min_size=1,
                                 settle=DEFAULT_SETTLE_S, timeout=join_timeout, may_close=False, ended_key=ended)
    except membership.JobEndedError as e:
        _log.logger.warning("%s", e)
        raise SystemExit(0) from None  # a worker started too late for a finished job ends quietly
    _epoch = joined.number
    _context.init(timeout, membership=(joined.rank, joined.size, joined.number))
    standby.arm()
    return joined


def reform(min_size: int | None = None, settle: float = DEFAULT_SETTLE_S, timeout: float | None = None,
           joiners: int = 0, gather: float = 0.0) -> Epoch:
    """Leaves the current world and forms the next epoch's with every process that calls this
    too (the survivors of a failure) and the `joiners` known to wait; returns the epoch, whose
    rank and size torchring.rank() and torchring.size() report from now on. A process that
    arrives after the epoch closed waits to be let into the next one (at the members' next
    commit). Raises TimeoutError below `min_size` members (default TORCHRING_MIN_NP, which
    torchring-run --min-np sets). `gather`: see membership.join. When the store fails, the
    members meet at a standby."""
    global _epoch
    joiners = max(joiners, 0)  # STORE_LOST: every member comes, nobody new
    old_rank, old_world = _context.rank(), _context.size()
    settings = _context.settings()
    min_size = settings.min_np if min_size is None else min_size
    launch = _env.detect()
    wait = settings.timeout if timeout is None else float(timeout)
    gone = dead_neighbours(*_context.wiring(), old_rank, old_world)
    alive = _posted(*_context.wiring()[:2], old_world)
    parent = _gpu_path.keep()  # the NCCL communicator, for the survivors to shrink
    _context.shutdown()
    me = _me(settings, old_rank)
    if old_world == 1 and not joiners:  # alone, and nobody waits: nothing to agree on
        joined = Epoch(_epoch + 1, (me,), 0)
    else:
        job = _job(launch)

        def join(store: Any) -> Epoch:
            global _store
            _store = store
            try:
                return membership.join(store, job, _epoch + 1, me, expected=old_world - gone + joiners,
                                       min_size=min_size, settle=settle, timeout=wait, gather=gather,
                                       alive=alive)
            except NotAMemberError:
                # Too late for the survivors' epoch (a slower detection): wait to be let into the next.
                return membership.join(store, job, _epoch + 2, me, expected=0, min_size=1, settle=settle,
                                       timeout=JOIN_TIMEOUT_S, may_close=False, ended_key=_ended_key(launch))

        try:
            joined = standby.meet(join, launch, wait)
        except membership.JobEndedError as e:
            _log.logger.warning("%s", e)
            raise SystemExit(0) from None  # the members finished without it: it has nothing left to do
    _epoch = joined.number
    exclude = _nccl_shrink.plan(old_world, [m.old_rank for m in joined.members])
    try:
        _context.init(membership=(joined.rank, joined.size, joined.number),
                      shrink_from=(parent, exclude) if parent is not None else None)
    finally:
        _nccl_shrink.release(parent, _gpu_path.nccl_comm())
    standby.arm()
    return joined


def _posted(store: Any, prefix: str, world: int) -> Any:
    """A function giving the ranks of the world wired under `prefix` that posted a failure on its
    board: they live, and the next epoch waits for them (membership.join's `alive`)."""
    board = _rendezvous.failure_board(store, prefix) if store is not None else None

    def alive() -> set[int]:
        if board is None:
            return set()
        try:
            return {r for r in range(world) if board.check([f"failed/{r}"])}
        except dist.DistError:  # the store is gone: nothing to go by
            return set()
    return alive


def _ended_key(launch: _env.Launch) -> str:
    return _context.elastic_ended_key(_context.job(_context.settings(), launch), launch.restart)


def finished() -> None:
    """Says in the store that this job's members finished (elastic.run calls it when the
    training function returns): a process still waiting to be let in then ends instead of
    waiting for members that are gone."""
    store = _context.wiring()[0] if _context.is_initialized() else None
    store = store or _store
    if store is not None:
        try:
            store.set(_ended_key(_env.detect()), "1")
        except dist.DistError:
            pass  # nobody can be waiting on a store that is gone


def joiners_waiting() -> int:
    """How many processes wait to join the next epoch, the same number on every rank (rank 0
    reads the store, a broadcast tells the rest): State.commit() asks this. STORE_LOST when
    the store failed: the members re-form through a standby while they all still can."""
    store = _context.wiring()[0] or _store
    count = 0
    if _context.rank() == 0 and store is not None:
        try:
            count = membership.pending(store, _job(_env.detect()), _epoch + 1)
        except dist.DistError:  # alone, there is nobody to meet: the job goes on without a store
            count = STORE_LOST if _context.size() > 1 else 0
    if _context.size() == 1:
        return count
    flag = torch.tensor([count], dtype=torch.int64)
    _basic.broadcast(flag, 0)
    return int(flag.item())


def dead_neighbours(store: Any, prefix: str, host: str, rank: int, world: int) -> int:
    """How many ranks of this world ran on this host in a process that is gone now: the epoch
    then closes as soon as the rest arrive, instead of waiting out the settle time (a lost
    host's ranks have no neighbour left to count them, and cost the settle time)."""
    if store is None:
        return 0
    gone = 0
    try:
        for peer in range(world):
            key = prefix + f"info/{peer}"
            if peer == rank or not store.check([key]):
                continue
            info = json.loads(store.get(key))
            if info.get("host") == host and not _status.alive(int(info["pid"])):
                gone += 1
    except dist.DistError:  # the store failed with its host: reform() meets at a standby, settling
        return 0
    return gone


def reform_process_group(backend: str = "torchring", min_size: int | None = None, settle: float = DEFAULT_SETTLE_S,
                         timeout: float | None = None) -> Epoch:
    """reform() for a job on torch.distributed alone (DDP, FSDP on init_process_group): destroys
    the default process group, agrees on the next epoch with the processes that call this too,
    and initializes a new default group of `backend` for it, under the epoch's own store keys.
    Wrap the model in DDP again afterwards (it broadcasts rank 0's parameters)."""
    global _epoch, _store
    old_rank, old_world = dist.get_rank(), dist.get_world_size()
    settings = _context.settings()
    min_size = settings.min_np if min_size is None else min_size
    launch = _env.detect()
    wait = settings.timeout if timeout is None else float(timeout)
    dist.destroy_process_group()
    job = _job(launch)
    joined = standby.meet(lambda s: membership.join(s, job, _epoch + 1, _me(settings, old_rank), expected=old_world,
                                                    min_size=min_size, settle=settle, timeout=wait), launch, wait)
    store = _store = _rendezvous.store(launch, wait)
    _epoch = joined.number
    dist.init_process_group(backend, store=dist.PrefixStore(f"torchring/{job}/process-group-{joined.number}/", store),
                            rank=joined.rank, world_size=joined.size)
    return joined
