"""The in-process engine tier's harness: N communicators on N threads of this process, wired
through one in-memory HashStore (gloo's tests do the same with threads).

``run_world(world, fn)`` calls ``fn(rank, comm)`` on every rank's thread with a started
communicator and returns the results in rank order; the first rank's exception is re-raised
(its communicator is shut down; a peer waiting on it in a collective fails within the timeout). ``hosts`` fakes host
identities (``"aab"``: ranks 0 and 1 share memory, rank 2 is another host), ``transport="tcp"``
makes every rank its own host. ``segment_kb`` and ``one_shot_bytes`` shrink the shared-memory
segment and the one-shot limit so small tensors reach the multi-segment and chunked paths.
Every blocking engine call releases the GIL, so the threads run truly in parallel.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any, Callable

import torch
import torch.distributed as dist

from torchring import CollectiveMismatchError
from torchring._core import build as _build, rendezvous as _rendezvous
from torchring._core.settings import Settings
from torchring._core.types import OpKind, ReduceOp

ENGINE = _build.load()


def run_world(world: int, fn: Callable[[int, Any], Any], hosts: str = "", transport: str = "shm",
              segment_kb: int = 4, one_shot_bytes: int | None = None, timeout: float = 20.0,
              arena_mb: int = 16, algo: str = "auto", header: str = "",
              options: dict[str, Any] | None = None) -> list[Any]:
    """Runs ``fn(rank, comm)`` on `world` wired communicators (`algo`: TORCHRING_ALGO's value;
    `header`: "doubling" or "multiplying" gives every rank a link cost that makes the header
    exchange that shape, "" keeps the measured one; `options`: CommOptions fields to set);
    returns the results by rank."""
    hosts = hosts or "a" * world
    assert len(hosts) == world, f"hosts {hosts!r} must name one host per rank"
    groups = ([[r] for r in range(world)] if transport == "tcp"
              else _rendezvous.host_groups(list(hosts)))
    settings = Settings(timeout=timeout, shm_segment_kb=segment_kb, shm_arena_mb=arena_mb, algo=algo)
    overrides = {} if one_shot_bytes is None else {"one_shot_bytes": one_shot_bytes}
    overrides.update(options or {})
    store, prefix = dist.HashStore(), f"engine-test/{uuid.uuid4().hex[:8]}/"
    results: list[Any] = [None] * world
    errors: list[BaseException | None] = [None] * world

    def rank_main(rank: int) -> None:
        comm = None  # connect() shuts down what it could not start
        try:
            comm = _rendezvous.connect(ENGINE, store, prefix, rank, world, settings, hosts[rank], "127.0.0.1",
                                       secret="secret", groups=groups, **overrides).comm
            if header:
                shaped(comm, header)
            results[rank] = fn(rank, comm)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors[rank] = exc
        finally:
            if comm is not None:
                comm.shutdown()

    # Daemons: a rank that hangs (the failure the test looks for) must not keep pytest alive.
    threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank{r}", daemon=True)
               for r in range(world)]
    for t in threads:
        t.start()
    limit = timeout * 3 + 10  # a failure may take the timeout plus a few seconds of explaining
    for t in threads:
        t.join(limit)
    hung = [t.name for t in threads if t.is_alive()]
    assert not hung, f"{hung} still running after {limit:g} s"
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results


def shaped(comm: Any, header: str) -> None:
    """Gives `comm` a link cost (the same on every rank) under which the header exchange among
    4 or more hosts takes `header`'s shape: a group of transfers at once costing half a step
    (Multiplying; with a copy that costs next to nothing, so every allreduce up to the limit
    whose algorithm can ride on it does) or three (Doubling)."""
    alpha, beta, gamma, _ = comm.link_cost
    if header == "multiplying":
        comm.set_link_cost(alpha, beta, gamma * 1e-6, alpha * 0.5)
    else:
        comm.set_link_cost(alpha, beta, gamma, alpha * 3.0)
    assert ENGINE.header_algo(8, alpha, comm.link_cost[3]) == header


def allreduce(comm: Any, t: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
    """Blocking allreduce on the engine directly."""
    return comm.submit(int(OpKind.ALLREDUCE), t, int(op), -1, True).wait()


def submit(comm: Any, kind: OpKind, t: torch.Tensor | None, op: int = 0, root: int = -1,
           inline: bool = True) -> Any:
    """Queues one collective; returns its Work."""
    return comm.submit(int(kind), t, int(op), root, inline)


def submit_op(comm: Any, kind: OpKind, t: torch.Tensor | None, op: ReduceOp = ReduceOp.SUM,
              root: int = -1, inline: bool = True, **options: Any) -> Any:
    """Queues one collective with issue #12's keyword options (out=, tensors=, splits, scales)."""
    return comm.submit(int(kind), t, int(op), root, inline, **options)


# (modulus, offset) per dtype: integers every dtype holds exactly (bfloat16: |x| <= 256).
_PAYLOAD_RANGE = {torch.uint8: (256, 0), torch.int8: (255, 127), torch.bfloat16: (255, 127),
                  torch.float16: (4001, 2000), torch.int16: (60001, 30000)}


def payload(key: int, numel: int, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """A message's content: exact integers of `dtype`, a different sequence for every `key`."""
    i = torch.arange(numel, dtype=torch.int64)
    h = i * 7 + (i >> 6) * 3 + key * 1009
    if dtype == torch.bool:
        x = (h % 5) < 2
    else:
        mod, off = _PAYLOAD_RANGE.get(dtype, (1_000_003, 500_000))
        x = h % mod - off
    return x.to(dtype).reshape(shape if shape is not None else (numel,))


def mismatch_text(work: Any) -> str | None:
    """The CollectiveMismatchError text wait() raises, or None when the operation succeeded."""
    try:
        work.wait()
    except CollectiveMismatchError as e:
        return str(e)
    return None
