"""SLURM's srun launches torchring jobs for real, on a one-node cluster the test starts
(tests/support/_slurm.py): world 2 and 3 (more tasks than CPUs with --overcommit); each rank reads its
place from SLURM's variables (torchring._core.env source "slurm", the step's task count) and checks
allreduce sums exactly (tests/support/_mpi_job.py). Skipped, saying why, where SLURM is not installed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from _mpi_job import read_reports
from _slurm import cluster

_ROOT = Path(__file__).resolve().parents[3]
_JOB = str(_ROOT / "tests" / "support" / "_mpi_job.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory):
    with cluster(tmp_path_factory.mktemp("slurm")) as env:
        yield env


@pytest.mark.parametrize("world", [2, 3])
def test_srun_job_reads_slurm_variables(slurm: dict[str, str], tmp_path: Path, world: int) -> None:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_ADDR", "TORCHELASTIC_", "OMPI_", "PMI_", "PMIX_")
    env = {k: v for k, v in slurm.items() if not k.startswith(drop)}
    env.update(PYTHONPATH=os.pathsep.join([str(_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p]),
               MASTER_PORT=str(_free_port()), TORCHRING_TIMEOUT="30")
    argv = ["srun", "-N1", f"-n{world}", "--overcommit", "--time=2", sys.executable, _JOB, str(tmp_path)]
    proc = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    log = f"{' '.join(argv)}\n{proc.stdout}{proc.stderr}"
    assert proc.returncode == 0, log
    reports = read_reports(tmp_path, world, "slurm", log)
    assert sorted(r["local_rank"] for r in reports) == list(range(world)), reports
