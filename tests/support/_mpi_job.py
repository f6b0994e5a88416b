"""A rank of a job started by a launcher other than torchrun (mpirun, srun): it reports where
torchring says it sits (rank, size, which launcher's variables it read), the CPUs it may run
on and its hostname, and allreduces integer tensors, checking the sums exactly.

    mpirun -np 3 python tests/support/_mpi_job.py OUT_DIR

Each rank writes OUT_DIR/rank<r>.json; the test reads them with `read_reports`.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import torch

import torchring
from torchring._core import env as _env


def main(out_dir: str) -> None:
    """Runs the checks and writes this rank's report."""
    launch = _env.detect()
    torchring.init()
    rank, world = torchring.rank(), torchring.size()
    wrong = []
    for n in (1, 1000, 1 << 18):
        for dtype in (torch.int64, torch.float32):
            x = torch.arange(n, dtype=dtype) * (rank + 1)
            torchring.allreduce(x)
            want = torch.arange(n, dtype=dtype) * (world * (world + 1) // 2)
            if not torch.equal(x, want):
                wrong.append(f"allreduce of {n} {dtype}")
    report = {"rank": rank, "world": world, "source": launch.source, "env_rank": launch.rank,
              "env_world": launch.world_size, "local_rank": launch.local_rank,
              "cpus": sorted(os.sched_getaffinity(0)), "host": socket.gethostname(), "wrong": wrong}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


def read_reports(out: Path, world: int, source: str, log: str) -> list[dict]:
    """Every rank's report, checked: each rank once, sizes and sums right, `source`'s variables read."""
    reports = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == list(range(world)), f"ranks that reported: {reports}\n{log}"
    for r in reports:
        assert (r["world"], r["env_world"], r["env_rank"]) == (world, world, r["rank"]), r
        assert r["source"] == source, f"rank {r['rank']} read its place from {r['source']}, not {source}"
        assert not r["wrong"], f"rank {r['rank']}: wrong results: {r['wrong']}"
    return reports


if __name__ == "__main__":
    main(sys.argv[1])
