"""Horovod's RayExecutor on torchring: Ray actors as the ranks of a torchring.horovod job.

    from torchring.horovod.ray import RayExecutor     # was: from horovod.ray import RayExecutor
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=4, cpus_per_worker=1)
    executor.start()
    results = executor.run(train, kwargs={"epochs": 2})   # train() calls hvd.init(); one result per rank
    executor.shutdown()

start() places one actor per worker in a placement group (num_workers bundles packed, or
num_hosts bundles of num_workers_per_host spread one per node), orders the actors node by node
(ranks of a node are consecutive, as horovodrun numbers them), and gives each the torchrun
environment that torchring.init() and hvd.init() read: RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, and MASTER_ADDR/MASTER_PORT, a free port on rank 0's node. run(), execute()
and their variants call into every actor and return the results in rank order. Horovod's elastic
mode (min_workers, max_workers, ...) is not here: torchring.horovod.elastic runs under
torchring-run instead, and asking for it raises. use_current_placement_group is accepted for
Horovod's signature; start() always makes a placement group of its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..launch.ssh import free_port
from .cluster_env import rank_environments

__all__ = ["RayExecutor", "RaySettings"]

_ELASTIC = ("min_workers", "max_workers", "reset_limit", "cooldown_range", "elastic_timeout",
            "override_discovery")


def _ray() -> Any:
    """The ray module, with the parts used here (imported on use: this module loads without Ray)."""
    import ray  # optional dependency: only RayExecutor's calls and its actors need it
    import ray.util.scheduling_strategies  # noqa: F401 - the same

    return ray


@dataclass
class RaySettings:
    """What RayExecutor.create_settings() returns; the ssh and NIC fields are Horovod's, unused here."""

    timeout_s: int = 30
    placement_group_timeout_s: int = 100
    ssh_identity_file: str | None = None
    ssh_str: str | None = None
    nics: set[str] | None = None


class _Worker:
    """One rank: a Ray actor that holds the job's environment and runs what it is given."""

    def __init__(self) -> None:
        self.executable: Any = None

    def where(self) -> tuple[str, str]:
        """(Ray node id, node IP address)."""
        ray = _ray()
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        """A TCP port free on this node now (for the job's store, on rank 0's node)."""
        return free_port(local=True)

    def setup(self, env: dict[str, str], cls: type | None, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Takes the job's environment and builds the executable object, if one is given."""
        os.environ.update(env)
        self.executable = cls(*args, **kwargs) if cls is not None else None

    def run(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """fn(*args, **kwargs) in this rank."""
        return fn(*args, **kwargs)

    def execute(self, fn: Callable[[Any], Any]) -> Any:
        """fn(executable) in this rank (the executable_cls object, or None)."""
        return fn(self.executable)


class RayExecutor:
    """Runs a torchring.horovod job on Ray actors, with Horovod's RayExecutor API (non-elastic)."""

    @staticmethod
    def create_settings(timeout_s: int = 30, ssh_identity_file: str | None = None, ssh_str: str | None = None,
                        placement_group_timeout_s: int = 100, nics: set[str] | None = None) -> RaySettings:
        """Horovod's settings object: the timeouts count; no ssh is needed, so the rest is kept unused."""
        return RaySettings(timeout_s, placement_group_timeout_s, ssh_identity_file, ssh_str, nics)

    def __init__(self, settings: RaySettings | None = None, num_workers: int | None = None,
                 num_hosts: int | None = None, num_workers_per_host: int = 1, cpus_per_worker: int = 1,
                 use_gpu: bool = False, gpus_per_worker: int | None = None,
                 use_current_placement_group: bool = True, **elastic: Any) -> None:
        asked = sorted(k for k, v in elastic.items() if k in _ELASTIC and v is not None)
        unknown = sorted(k for k in elastic if k not in _ELASTIC)
        if unknown:
            raise TypeError(f"RayExecutor: unexpected arguments {unknown}")
        if asked:
            raise NotImplementedError(
                f"RayExecutor: elastic mode ({', '.join(asked)}) is not supported by torchring.horovod.ray; "
                "run torchring.horovod.elastic under torchring-run (--min-np/--max-np) instead")
        if (num_workers is None) == (num_hosts is None):
            raise ValueError("RayExecutor: give either num_workers, or num_hosts with num_workers_per_host")
        if num_workers is not None and num_workers < 1 or num_hosts is not None and num_hosts < 1:
            raise ValueError(f"RayExecutor: num_workers={num_workers}, num_hosts={num_hosts}: must be at least 1")
        self.settings = settings or RaySettings()
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.use_current_placement_group = use_current_placement_group
        self._num_workers = num_workers if num_workers is not None else num_hosts * num_workers_per_host
        self._workers: list[Any] = []
        self._placement_group: Any = None

    @property
    def num_workers(self) -> int:
        """The number of ranks."""
        return self._num_workers

    def _bundles(self) -> tuple[list[dict[str, float]], str]:
        """The placement group's bundles and strategy: a bundle per worker packed, or per host spread."""
        one = {"CPU": float(self.cpus_per_worker), **({"GPU": float(self.gpus_per_worker)} if self.use_gpu else {})}
        if self.num_hosts is None:
            return [one] * self._num_workers, "PACK"
        per_host = {k: v * self.num_workers_per_host for k, v in one.items()}
        return [per_host] * self.num_hosts, "STRICT_SPREAD"

    def start(self, executable_cls: type | None = None, executable_args: Sequence[Any] | None = None,
              executable_kwargs: dict[str, Any] | None = None, extra_env_vars: dict[str, str] | None = None) -> None:
        """Places the workers, numbers them node by node, and gives each its rank's environment."""
        ray = _ray()
        if self._workers:
            raise RuntimeError("RayExecutor.start(): already started; call shutdown() first")
        bundles, strategy = self._bundles()
        self._placement_group = ray.util.placement_group(bundles, strategy=strategy)
        ready, _ = ray.wait([self._placement_group.ready()], timeout=self.settings.placement_group_timeout_s)
        if not ready:
            self.shutdown()
            raise TimeoutError(f"RayExecutor.start(): Ray could not place {len(bundles)} bundles of {bundles[0]} "
                               f"({strategy}) within {self.settings.placement_group_timeout_s} s; the cluster "
                               f"has {ray.available_resources()}")
        actor = ray.remote(_Worker)
        per_bundle = 1 if self.num_hosts is None else self.num_workers_per_host
        workers = [actor.options(num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker,
                                 scheduling_strategy=ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy(
                                     self._placement_group, placement_group_bundle_index=i // per_bundle)).remote()
                   for i in range(self._num_workers)]
        self._workers = workers  # shutdown() can kill them from here on
        # Actors start here: a new worker process each, so the placement timeout bounds it.
        where = ray.get([w.where.remote() for w in workers], timeout=self.settings.placement_group_timeout_s)
        nodes: list[str] = []
        for node, _ in where:
            if node not in nodes:
                nodes.append(node)
        order = sorted(range(len(workers)), key=lambda i: (nodes.index(where[i][0]), i))
        self._workers = [workers[i] for i in order]
        where = [where[i] for i in order]
        port = ray.get(self._workers[0].free_port.remote(), timeout=self.settings.timeout_s)
        env = self._environments(where, port, extra_env_vars or {})
        ray.get([w.setup.remote(e, executable_cls, tuple(executable_args or ()), dict(executable_kwargs or {}))
                 for w, e in zip(self._workers, env)], timeout=self.settings.timeout_s)

    def _environments(self, where: list[tuple[str, str]], port: int, extra: dict[str, str]) -> list[dict[str, str]]:
        """Each rank's torchrun environment (cluster_env.py): local ranks per Ray node, the store on rank 0's."""
        timeout = os.environ.get("TORCHRING_TIMEOUT", str(self.settings.timeout_s))
        return rank_environments([node for node, _ in where], where[0][1], port,
                                 {**extra, "TORCHRING_TIMEOUT": timeout})

    def _started(self, what: str) -> list[Any]:
        if not self._workers:
            raise RuntimeError(f"RayExecutor.{what}(): call start() first")
        return self._workers

    def run_remote(self, fn: Callable[..., Any], args: Sequence[Any] | None = None,
                   kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Starts fn(*args, **kwargs) on every rank; Ray object refs in rank order."""
        return [w.run.remote(fn, tuple(args or ()), dict(kwargs or {})) for w in self._started("run_remote")]

    def run(self, fn: Callable[..., Any], args: Sequence[Any] | None = None, kwargs: dict[str, Any] | None = None,
            callbacks: list[Callable[[Any], None]] | None = None) -> list[Any]:
        """fn(*args, **kwargs) on every rank; the results in rank order."""
        results = _ray().get(self.run_remote(fn, args, kwargs))
        for callback in callbacks or ():
            for result in results:
                callback(result)
        return results

    def execute(self, fn: Callable[[Any], Any], callbacks: list[Callable[[Any], None]] | None = None) -> list[Any]:
        """fn(executable) on every rank (the executable_cls object given to start()); results in rank order."""
        results = _ray().get([w.execute.remote(fn) for w in self._started("execute")])
        for callback in callbacks or ():
            for result in results:
                callback(result)
        return results

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """fn(executable) on rank 0 only."""
        return _ray().get(self._started("execute_single")[0].execute.remote(fn))

    def shutdown(self) -> None:
        """Kills the workers and frees their placement group; start() may be called again."""
        ray = _ray()
        for worker in self._workers:
            ray.kill(worker)
        self._workers = []
        if self._placement_group is not None:
            ray.util.remove_placement_group(self._placement_group)
            self._placement_group = None
