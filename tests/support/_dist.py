"""Tiny multi-process harness: run ``fn(rank, *args)`` in ``world_size`` fresh processes.

Each rank gets the torchrun-style environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT). By default the parent hosts the ``TCPStore`` like the torchrun agent
does and sets ``TORCHELASTIC_USE_AGENT_STORE=True``; with ``host_store=False`` rank 0 hosts it.

Inside a rank, ``with session(): ...`` runs the body between ``torchring.init()`` and
``torchring.shutdown()`` (also when the body raises).

``spawn`` returns the per-rank return values and re-raises the first failing rank's traceback;
``spawn(..., expect_fail=True)`` returns an :class:`Outcome` per rank instead (value, exception
text or exit code), for fault tests. A rank that is still running after ``timeout`` seconds gets
its Python stacks dumped, then every rank is killed and the test fails.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import faulthandler
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import traceback
import uuid
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterator, Sequence

import pytest
import torch.distributed as dist

# Env vars that a launcher or an earlier test may have left in the forkserver's environment.
_CLEARED_PREFIXES = ("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "GROUP_", "ROLE_", "TORCHELASTIC_",
                     "TORCHRING_", "SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_")
_GRACE_S = 10.0  # how long the other ranks may run on after one rank failed

_ctx = mp.get_context("forkserver")
_ctx.set_forkserver_preload(["torch"])


@dataclasses.dataclass
class Outcome:
    """What one rank did: returned ``value``, raised (``error`` is the traceback), or died."""

    rank: int
    value: Any = None
    error: str | None = None
    exitcode: int | None = None
    hung: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and not self.hung and self.exitcode == 0

    def describe(self) -> str:
        if self.hung:
            return f"rank {self.rank} hung; its Python stacks:\n{self.error}"
        if self.error is not None:
            return f"rank {self.rank} raised:\n{self.error}"
        if self.exitcode != 0:
            return f"rank {self.rank} exited with code {self.exitcode} without a result"
        return f"rank {self.rank} returned {self.value!r}"


@dataclasses.dataclass
class Job:
    """Handed to ``on_start``: the parent-hosted store and the job id the ranks use."""

    store: dist.TCPStore | None
    job_id: str
    world_size: int

    def key_prefix(self, gen: int = 0, restart: int = 0) -> str:
        """Prefix of torchring's store keys for the ``gen``-th init() in each rank."""
        return f"torchring/{self.job_id}/{restart}/{gen}/"


def free_port() -> int:
    """Return a TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hybrid_env(hosts: Sequence[str]) -> list[dict[str, str]]:
    """Per-rank env that fakes one host per distinct name, with matching LOCAL_* values."""
    out = []
    for rank, host in enumerate(hosts):
        peers = [r for r, h in enumerate(hosts) if h == host]
        out.append({"TORCHRING_HOSTNAME": host, "LOCAL_RANK": str(peers.index(rank)),
                    "LOCAL_WORLD_SIZE": str(len(peers))})
    return out


class StoreGate:
    """A TCP proxy in front of the store for one rank that can freeze that rank's rendezvous.

    Point a rank's MASTER_PORT at ``gate.port`` and call ``gate.open(store_port)`` once the store
    exists. Traffic flows until the rank sends bytes containing ``trigger`` (e.g. the key it
    publishes); that request, and everything after it, waits until ``release()``.
    """

    def __init__(self, trigger: bytes) -> None:
        self.trigger = trigger
        self._upstream: int | None = None
        self._ready, self._released = threading.Event(), threading.Event()
        self.held = threading.Event()  # set once the trigger was seen
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def open(self, store_port: int) -> None:
        self._upstream = store_port
        self._ready.set()

    def release(self) -> None:
        self._released.set()

    def _serve(self) -> None:
        while True:
            client, _ = self._listener.accept()
            self._ready.wait()
            upstream = socket.create_connection(("127.0.0.1", self._upstream))
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, gated: bool) -> None:
        tail = b""
        try:
            while data := src.recv(65536):
                if gated and not self._released.is_set():
                    if self.trigger in tail + data:
                        self.held.set()
                        self._released.wait()
                    tail = data[-len(self.trigger):]
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


@contextlib.contextmanager
def session() -> Iterator[None]:
    """In a rank: torchring.init() on entry, torchring.shutdown() on exit, also after an error."""
    import torchring  # here, not at the top: the parent process never needs the engine

    torchring.init()
    try:
        yield
    finally:
        torchring.shutdown()


def launch_env(rank: int, world_size: int, port: int, job_id: str) -> dict[str, str]:
    """The variables a launcher gives one rank of a single-host job (rendezvous on 127.0.0.1)."""
    return dict(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                TORCHRING_JOB_ID=job_id)


def spawn(world_size: int, fn: Callable[..., Any], *args: Any, env: dict[str, str] | None = None,
          rank_env: Sequence[dict[str, str]] | None = None, timeout: float = 120,
          expect_fail: bool = False, host_store: bool = True,
          on_start: Callable[[Job], None] | None = None) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` ranks and return their results in rank order.

    ``env`` applies to every rank, ``rank_env[r]`` to rank r only (a value of None unsets).
    With ``expect_fail`` the list holds an :class:`Outcome` per rank and only a hang fails.
    ``on_start(job)`` runs in the parent once the ranks have been started.
    """
    job_id = f"test-{uuid.uuid4().hex[:12]}"
    store = None
    if host_store:
        store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=timeout),
                              wait_for_workers=False)
        port = store.port
    else:
        port = free_port()
    envs = []
    for rank in range(world_size):
        e = {k: v for k, v in os.environ.items() if k.startswith("TORCHRING_")}
        e.update(launch_env(rank, world_size, port, job_id))
        if host_store:
            e.update(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
        e.update(env or {})
        e.update(rank_env[rank] if rank_env else {})
        envs.append(e)
    hook = (lambda: on_start(Job(store, job_id, world_size))) if on_start else None
    try:
        outcomes = _launch(envs, fn, args, timeout, hook, stop_on_error=not expect_fail)
    finally:
        del store
    hung = [o for o in outcomes if o.hung]
    if hung:
        pytest.fail(f"timed out after {timeout} s:\n" + "\n\n".join(o.describe() for o in outcomes),
                    pytrace=False)
    if expect_fail:
        return outcomes
    failed = [o for o in outcomes if not o.ok]
    if failed:
        pytest.fail(failed[0].describe() + "".join(f"\n(also: {o.describe().splitlines()[0]})"
                                                   for o in failed[1:]), pytrace=False)
    return [o.value for o in outcomes]


def run_alone(fn: Callable[..., Any], *args: Any, env: dict[str, str] | None = None,
              timeout: float = 60) -> Any:
    """Run ``fn(0, *args)`` in one fresh process with no launcher env at all."""
    e = {k: v for k, v in os.environ.items() if k.startswith("TORCHRING_")}
    e.update(env or {})
    (outcome,) = _launch([e], fn, args, timeout, None, stop_on_error=True)
    if not outcome.ok:
        pytest.fail(outcome.describe(), pytrace=False)
    return outcome.value


def _launch(envs: list[dict[str, str]], fn: Callable[..., Any], args: tuple, timeout: float,
            hook: Callable[[], None] | None, stop_on_error: bool) -> list[Outcome]:
    """Start one process per env, collect an Outcome from each; kill everything at the deadline."""
    dumps = tempfile.mkdtemp(prefix="torchring-stacks-")
    procs, conns = [], []
    for rank, env in enumerate(envs):
        recv, send = _ctx.Pipe(duplex=False)
        # Not daemonic, so a rank may start DataLoader workers; the loop below kills every rank
        # still alive at the deadline, so none outlives the test.
        p = _ctx.Process(target=_child, args=(rank, env, fn, args, send, dumps), daemon=False)
        p.start()
        send.close()
        procs.append(p)
        conns.append(recv)
    outcomes = [Outcome(rank) for rank in range(len(envs))]
    if hook:
        try:
            hook()
        except BaseException:
            for p in procs:
                p.kill()
            raise
    deadline = time.monotonic() + timeout
    first_error: Outcome | None = None
    pending: dict[Any, int] = {c: r for r, c in enumerate(conns)}
    pending.update({p.sentinel: r for r, p in enumerate(procs)})
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        for ready in wait(list(pending), timeout=left):
            rank = pending.pop(ready)
            if isinstance(ready, Connection):
                try:
                    kind, payload = ready.recv()
                except EOFError:
                    continue  # died without a result: its sentinel says how
                if kind == "ok":
                    outcomes[rank].value = payload
                else:
                    outcomes[rank].error = payload
                    first_error = first_error or outcomes[rank]
            else:
                procs[rank].join()
                outcomes[rank].exitcode = procs[rank].exitcode
        if stop_on_error and first_error and deadline > time.monotonic() + _GRACE_S:
            deadline = time.monotonic() + _GRACE_S
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        os.kill(p.pid, signal.SIGUSR1)  # faulthandler writes its stacks
    if alive:
        time.sleep(1.0)
    for rank, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            p.join()
            o = outcomes[rank]
            o.hung = o.error is None
            o.exitcode = p.exitcode
            if o.hung:
                o.error = _read(os.path.join(dumps, f"{rank}.txt")) or "(no stack dump)"
    for c in conns:
        c.close()
    shutil.rmtree(dumps, ignore_errors=True)
    return outcomes


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _child(rank: int, env: dict[str, str], fn: Callable[..., Any], args: tuple, conn: Connection,
           dumps: str) -> None:
    """Process entry point: set the env, run fn, send ("ok", value) or ("error", traceback)."""
    for key in list(os.environ):
        if key.startswith(_CLEARED_PREFIXES):
            del os.environ[key]
    os.environ.update({k: v for k, v in env.items() if v is not None})
    stacks = open(os.path.join(dumps, f"{rank}.txt"), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    import torch

    torch.set_num_threads(1)
    try:
        result = ("ok", fn(rank, *args))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        result = ("error", traceback.format_exc())
    conn.send(result)
    conn.close()
