"""A Ray driver for tests/spawned/ray: starts a real local Ray instance (or joins ADDRESS), runs
torchring jobs on it, writes what it saw to OUT/MODE/result.json and stops Ray.

    python _ray_driver.py MODE[,MODE...] OUT [ADDRESS]   # ADDRESS: a running Ray cluster's head (host:port)

MODE: trainer-wrap, trainer-ddp, trainer-horovod (ray.train.torch.TorchTrainer with
TorchConfig(backend="torchring") and nothing else torchring-specific on the driver), trainer-failure
(rank 1 dies at step 3 of the first attempt; FailureConfig(max_failures=1) restarts the group, which
resumes from the last Ray checkpoint), executor (torchring.horovod.ray.RayExecutor).

The model and data are integer-valued so every average is exact: a bias-free Linear(4, 1) from
weights [1, 2, 3, 4], loss = (model(x) * y).sum() on rank r's step-s batch (batch(r, s)), SGD at
lr 1/8; tests/spawned/ray/test_ray.py computes the same steps in one process.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Callable

import torch

STEPS, WORLD, LR = 6, 2, 0.125


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s step-`step` batch: 8 rows of 4 small integers and 8 integer targets."""
    i = torch.arange(32, dtype=torch.float32).view(8, 4)
    return (i + rank * 3 + step) % 7 - 3, (torch.arange(8, dtype=torch.float32) + rank + 2 * step) % 5 - 2


def model() -> torch.nn.Module:
    """The starting model, the same on every rank."""
    m = torch.nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        m.weight.copy_(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    return m


def _steps(m: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, first: int, every: object = None) -> None:
    for step in range(first, STEPS):
        x, y = batch(rank, step)
        opt.zero_grad()
        (m(x).squeeze(1) * y).sum().backward()
        opt.step()
        if every is not None:
            every(step, m)


def _report(out: str, rank: int, weights: list[float], **extra: object) -> None:
    import socket

    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"weights": weights, "pid": os.getpid(), "host": socket.gethostname(), **extra}, f)


def train_wrap(config: dict) -> None:
    """torchring.wrap inside a Ray Train worker, whose process group Ray made on torchring."""
    import torch.distributed as dist

    import torchring

    torchring.init()
    m = torchring.wrap(model())
    _steps(m, torch.optim.SGD(m.parameters(), lr=LR), dist.get_rank(), 0)
    _report(config["out"], dist.get_rank(), m.module.weight.flatten().tolist(), backend=dist.get_backend())


def train_ddp(config: dict) -> None:
    """DDP on the process group Ray made with backend="torchring"."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    m = DistributedDataParallel(model())
    _steps(m, torch.optim.SGD(m.parameters(), lr=LR), dist.get_rank(), 0)
    _report(config["out"], dist.get_rank(), m.module.weight.flatten().tolist(), backend=dist.get_backend())


def train_horovod(out: str) -> list[float]:
    """A torchring.horovod script's body (RayExecutor actor, or Ray Train worker: train_hvd)."""
    import torchring.horovod as hvd

    hvd.init()
    m = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=LR), named_parameters=m.named_parameters())
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    _steps(m, opt, hvd.rank(), 0)
    weights = m.weight.flatten().tolist()
    _report(out, hvd.rank(), weights, size=hvd.size(), local_rank=hvd.local_rank())
    return weights


def train_hvd(config: dict) -> None:
    """torchring.horovod in a Ray Train worker (whose process group Ray made on torchring)."""
    train_horovod(config["out"])


def train_failing(config: dict) -> None:
    """DDP with a Ray checkpoint after every step; rank 1 dies at step 3 of the first attempt."""
    import ray.train
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank = dist.get_rank()
    m = DistributedDataParallel(model())
    first = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            saved = torch.load(os.path.join(d, "state.pt"))
        m.module.load_state_dict(saved["model"])
        first = saved["step"] + 1
    with open(os.path.join(config["out"], f"attempt_rank{rank}.txt"), "a") as f:
        f.write(f"{os.getpid()} {first}\n")

    def every(step: int, mod: torch.nn.Module) -> None:
        marker = os.path.join(config["out"], "died")
        if rank == 1 and step == 3 and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(17)  # a worker process lost mid-training
        with tempfile.TemporaryDirectory() as d:
            if rank == 0:
                torch.save({"model": mod.module.state_dict(), "step": step}, os.path.join(d, "state.pt"))
            ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(d) if rank == 0 else None)

    _steps(m, torch.optim.SGD(m.parameters(), lr=LR), rank, first, every)
    _report(config["out"], rank, m.module.weight.flatten().tolist(), first=first)


def each_mode(modes: list[str], out: str, run: Callable[[str, str], dict]) -> None:
    """run(mode, OUT/MODE) for each mode in turn, its result written to OUT/MODE/result.json."""
    for mode in modes:
        os.makedirs(os.path.join(out, mode), exist_ok=True)
        seen = run(mode, os.path.join(out, mode))
        with open(os.path.join(out, mode, "result.json"), "w") as f:
            json.dump(seen, f)


def run_mode(mode: str, out: str, address: str | None) -> dict:
    """One job on the running Ray; what the driver saw."""
    seen: dict = {"mode": mode}
    if mode == "executor":
        from torchring.horovod.ray import RayExecutor

        # On a cluster (ADDRESS), one worker per node, as horovodrun's -H a:1,b:1.
        shape = {"num_hosts": WORLD, "num_workers_per_host": 1} if address else {"num_workers": WORLD}
        executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), cpus_per_worker=1, **shape)
        executor.start()
        seen["num_workers"] = executor.num_workers
        seen["run"] = executor.run(train_horovod, kwargs={"out": out})
        seen["execute"] = executor.execute(lambda _: int(os.environ["RANK"]))
        executor.shutdown()
        return seen
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    fn = {"trainer-wrap": train_wrap, "trainer-ddp": train_ddp, "trainer-horovod": train_hvd,
          "trainer-failure": train_failing}[mode]
    trainer = TorchTrainer(
        fn, train_loop_config={"out": out},
        scaling_config=ScalingConfig(num_workers=WORLD, resources_per_worker={"CPU": 1}),
        torch_config=TorchConfig(backend="torchring"),
        run_config=RunConfig(storage_path=os.path.join(out, "ray_results"), name=mode,
                             failure_config=FailureConfig(max_failures=1 if mode == "trainer-failure" else 0)))
    result = trainer.fit()
    seen["error"] = None if result.error is None else repr(result.error)
    return seen


def main() -> None:
    """Each MODE (comma-separated) in OUT/MODE/, on one Ray instance."""
    modes, out = sys.argv[1].split(","), sys.argv[2]
    address = sys.argv[3] if len(sys.argv) > 3 else None
    import ray

    env = {"TORCHRING_TIMEOUT": "15"}  # a lost worker fails its peer's collective in seconds
    if address:
        ray.init(address=address, runtime_env={"env_vars": env})
    else:
        ray.init(num_cpus=WORLD, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        each_mode(modes, out, lambda mode, where: run_mode(mode, where, address))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
