"""A Spark driver for tests/spawned/spark: runs one torchring job on a real Spark (local mode, or the
standalone master MASTER) and writes what it saw to OUT/MODE/result.json.

    python _spark_driver.py MODE[,MODE...] OUT [MASTER]

MODE: distributor (pyspark's TorchDistributor running DDP on init_process_group("torchring");
local_mode when no MASTER is given), horovod (torchring.horovod.spark.run of a torchring.horovod
training function), horovod-failure (rank 1's Python worker dies in a first run(): Spark cannot
retry a barrier result stage, so the job fails on the driver and its other task is ended; a second
run() in the same session then trains). The model, data and steps are tests/spawned/ray/_ray_driver.py's, whose
test computes the same steps in one process.
"""

from __future__ import annotations

import os
import sys

# The training functions use _ray_driver's model and data; Spark's Python workers and torchrun's
# ranks import both modules by name (cloudpickle pickles functions of a module by reference).
HELPERS = [os.path.dirname(os.path.abspath(__file__)),
           os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ray"))]
sys.path[:0] = HELPERS
os.environ["PYTHONPATH"] = os.pathsep.join(HELPERS + [p for p in [os.environ.get("PYTHONPATH")] if p])
import _ray_driver as job  # noqa: E402

WORLD = job.WORLD


def train_ddp() -> list[float]:
    """DDP on the torchring backend under TorchDistributor (torchrun's environment); rank 0's weights."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("torchring")
    m = DistributedDataParallel(job.model())
    opt = torch.optim.SGD(m.parameters(), lr=job.LR)
    for step in range(job.STEPS):
        x, y = job.batch(dist.get_rank(), step)
        opt.zero_grad()
        (m(x).squeeze(1) * y).sum().backward()
        opt.step()
    weights = m.module.weight.flatten().tolist()
    dist.destroy_process_group()
    return weights


def train_hvd(out: str, fail_once: bool = False) -> dict:
    """A torchring.horovod training function; with fail_once, rank 1 dies in the first attempt."""
    import socket

    import torchring.horovod as hvd

    if fail_once and int(os.environ["RANK"]) == 1 and not os.path.exists(os.path.join(out, "died")):
        open(os.path.join(out, "died"), "w").close()
        os._exit(19)  # the Python worker is lost mid-stage
    weights = job.train_horovod(out)
    return {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(), "weights": weights,
            "host": socket.gethostname()}


def run_mode(mode: str, out: str, local: bool) -> dict:
    """One job on the running Spark session; what the driver saw."""
    import time

    seen: dict = {"mode": mode}
    if mode == "distributor":
        from pyspark.ml.torch.distributor import TorchDistributor

        seen["weights"] = TorchDistributor(num_processes=WORLD, local_mode=local, use_gpu=False).run(train_ddp)
        return seen
    import torchring.horovod.spark

    if mode == "horovod-failure":
        start = time.monotonic()
        try:
            torchring.horovod.spark.run(train_hvd, args=(out,), kwargs={"fail_once": True}, num_proc=WORLD)
            seen["first_error"] = None
        except Exception as e:  # noqa: BLE001 - what Spark raised is the result
            seen["first_error"] = f"{type(e).__name__}: {e}"[:4000]
        seen["first_s"] = time.monotonic() - start
    seen["results"] = torchring.horovod.spark.run(train_hvd, args=(out,), num_proc=WORLD)
    return seen


def main() -> None:
    """Each MODE (comma-separated) in OUT/MODE/, in one Spark session."""
    modes, out = sys.argv[1].split(","), sys.argv[2]
    master = sys.argv[3] if len(sys.argv) > 3 else None
    from pyspark.sql import SparkSession

    builder = (SparkSession.builder.master(master or f"local[{WORLD}]").appName("torchring-tests")
               .config("spark.ui.enabled", "false").config("spark.executorEnv.TORCHRING_TIMEOUT", "15")
               .config("spark.executorEnv.PYTHONPATH", os.environ["PYTHONPATH"]))
    if master:
        builder = builder.config("spark.cores.max", str(WORLD)).config("spark.executor.cores", "1")
    spark = builder.getOrCreate()
    try:
        job.each_mode(modes, out, lambda mode, where: run_mode(mode, where, master is None))
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
