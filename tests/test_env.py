"""Where a rank learns its place: torchrun, Open MPI, PMI and SLURM variables; and shared
memory left behind by nobody, even when a rank is killed."""

from __future__ import annotations

import glob
import os
import signal

import pytest

from torchring import _env
from _dist import spawn


def test_torchrun_contract() -> None:
    got = _env.detect({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "node0", "MASTER_PORT": "1234", "TORCHELASTIC_USE_AGENT_STORE": "True",
                       "TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "2"})
    assert (got.rank, got.world_size, got.local_rank, got.local_world_size) == (3, 4, 1, 2)
    assert (got.master_addr, got.master_port, got.use_agent_store) == ("node0", 1234, True)
    assert (got.job_id, got.restart, got.source) == ("abc", 2, "torchrun")


def test_open_mpi_and_pmi() -> None:
    mpi = _env.detect({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
                       "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
                       "MASTER_ADDR": "host0"})
    assert (mpi.rank, mpi.world_size, mpi.local_rank, mpi.source) == (5, 8, 1, "openmpi")
    assert mpi.master_port == _env.DEFAULT_PORT and not mpi.use_agent_store
    pmi = _env.detect({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"})
    assert (pmi.rank, pmi.world_size, pmi.master_addr, pmi.source) == (0, 2, "127.0.0.1", "pmi")


def test_slurm_takes_the_first_node_and_a_job_specific_port() -> None:
    got = _env.detect({"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2",
                       "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-08,11],cpu1"})
    assert (got.rank, got.world_size, got.local_rank, got.source) == (6, 8, 2, "slurm")
    assert got.master_addr == "gpu07" and got.master_port == _env.DEFAULT_PORT + 4242 % 1000
    assert got.job_id == "4242"
    batch = _env.detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "1",
                         "SLURM_JOB_NODELIST": "gpu07"})
    assert batch.world_size == 1, "a batch script run without srun is one task"


def test_single_process_without_launcher() -> None:
    got = _env.detect({})
    assert (got.rank, got.world_size, got.source) == (0, 1, "single")


def test_bad_launcher_variables() -> None:
    with pytest.raises(ValueError, match="RANK is not"):
        _env.detect({"WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match=r"outside \[0, 2\)"):
        _env.detect({"WORLD_SIZE": "2", "RANK": "2"})
    with pytest.raises(ValueError, match="must be an integer"):
        _env.detect({"WORLD_SIZE": "two", "RANK": "0"})
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        _env.detect({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "8",
                     "OMPI_COMM_WORLD_LOCAL_SIZE": "4"})


def _killed_after_init(rank: int) -> None:
    import torch
    import torchring
    torchring.init()
    torchring.allreduce(torch.ones(10))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    torchring.allreduce(torch.ones(10))


def test_nothing_is_left_in_dev_shm_after_a_crash() -> None:
    before = set(glob.glob("/dev/shm/torchring-*"))
    outcomes = spawn(3, _killed_after_init, expect_fail=True, env={"TORCHRING_TIMEOUT": "5"})
    assert outcomes[1].exitcode == -signal.SIGKILL
    assert all("rank 1" in (o.error or "") for o in (outcomes[0], outcomes[2]))
    assert set(glob.glob("/dev/shm/torchring-*")) - before == set()
