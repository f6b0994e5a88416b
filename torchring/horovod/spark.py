"""Horovod's Spark runner on torchring: horovod.spark.run(fn) as a Spark barrier stage.

    import torchring.horovod.spark                 # was: import horovod.spark
    results = torchring.horovod.spark.run(train, args=(epochs,), num_proc=4)   # one result per rank

run() takes the active SparkSession (or makes one), runs num_proc barrier tasks (all start
together or none does), and in each sets the torchrun environment that torchring.init() and
hvd.init() read before it calls fn(*args, **kwargs): RANK = the task's partition, WORLD_SIZE,
LOCAL_RANK and LOCAL_WORLD_SIZE among the tasks on the same executor host (ranks of a host
consecutive or not: torchring groups them by host), MASTER_ADDR = rank 0's host and MASTER_PORT
a port free there, agreed through the barrier's allGather. The results come back in rank order,
as Horovod's do. A task that fails fails the barrier stage, and Spark ends its other tasks; Spark
does not retry a barrier result stage, so run() raises on the driver and may be called again. Horovod runs fn in a process of its own; here it runs in the
Spark Python worker, so the environment is restored and torchring shut down when fn returns.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Iterator, Sequence

from .._core import context as _context
from ..launch.ssh import free_port
from .cluster_env import rank_environments

__all__ = ["run"]


def _rank_env(rank: int, peers: list[dict[str, Any]], extra: dict[str, str]) -> dict[str, str]:
    """Rank `rank`'s torchrun environment from every task's {"host", "port"} (rank order; cluster_env.py)."""
    return rank_environments([p["host"] for p in peers], peers[0]["host"], peers[0]["port"], extra)[rank]


def _task(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any],
          env: dict[str, str]) -> Callable[[Iterator[Any]], Iterator[tuple[int, Any]]]:
    """The barrier task: agree on the environment, run fn, yield (rank, result)."""

    def task(_: Iterator[Any]) -> Iterator[tuple[int, Any]]:
        from pyspark import BarrierTaskContext  # Spark's Python worker has it; torchring does not need it

        ctx = BarrierTaskContext.get()
        rank = ctx.partitionId()
        host = ctx.getTaskInfos()[rank].address.rsplit(":", 1)[0]
        port = free_port(local=True) if rank == 0 else 0
        peers = [json.loads(m) for m in ctx.allGather(json.dumps({"host": host, "port": port}))]
        mine = _rank_env(rank, peers, env)
        saved = {k: os.environ.get(k) for k in mine}
        os.environ.update(mine)
        try:
            result = fn(*args, **kwargs)
        finally:
            _shutdown_torchring()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        yield rank, result

    return task


def _shutdown_torchring() -> None:
    """Ends a torchring world fn left running (the Python worker may run the next task)."""
    if _context.is_initialized():
        _context.shutdown()


def run(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
        num_proc: int | None = None, start_timeout: int | None = None, env: dict[str, str] | None = None,
        stdout: Any = None, stderr: Any = None, verbose: int = 1, nics: Any = None,
        prefix_output_with_timestamp: bool = False) -> list[Any]:
    """Runs fn(*args, **kwargs) on num_proc Spark tasks as one torchring job; the results in rank order."""
    from pyspark.sql import SparkSession  # optional dependency: only run() needs Spark

    spark = SparkSession.builder.getOrCreate()
    sc = spark.sparkContext
    num_proc = num_proc or sc.defaultParallelism
    if num_proc < 1:
        raise ValueError(f"torchring.horovod.spark.run: num_proc={num_proc}: must be at least 1")
    extra = dict(env or {})
    if start_timeout is not None:
        extra.setdefault("TORCHRING_TIMEOUT", str(start_timeout))
    rdd = sc.parallelize(range(num_proc), num_proc).barrier()
    pairs = rdd.mapPartitions(_task(fn, tuple(args), dict(kwargs or {}), extra)).collect()
    ranks = sorted(rank for rank, _ in pairs)
    if ranks != list(range(num_proc)):
        raise RuntimeError(f"torchring.horovod.spark.run: results came back from ranks {ranks}, "
                           f"expected 0..{num_proc - 1}")
    return [result for _, result in sorted(pairs, key=lambda p: p[0])]
