"""Where a rank learns its place (torchring._core.env.detect): the torchrun contract, Open MPI,
PMI and SLURM variables, parsed from a dict, no process started."""

from __future__ import annotations

import pytest

from torchring._core import env as _env


def test_torchrun_contract() -> None:
    got = _env.detect({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "node0", "MASTER_PORT": "1234", "TORCHELASTIC_USE_AGENT_STORE": "True",
                       "TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "2"})
    assert (got.rank, got.world_size, got.local_rank, got.local_world_size) == (3, 4, 1, 2)
    assert (got.master_addr, got.master_port, got.use_agent_store) == ("node0", 1234, True)
    assert (got.job_id, got.restart, got.source) == ("abc", 2, "torchrun")


def test_torchrun_on_one_host_needs_no_master_addr() -> None:
    got = _env.detect({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    assert (got.master_addr, got.master_port, got.use_agent_store) == ("127.0.0.1", _env.DEFAULT_PORT, False)
    assert (got.job_id, got.restart) == ("job", 0)


def test_open_mpi_and_pmi() -> None:
    mpi = _env.detect({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
                       "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
                       "MASTER_ADDR": "host0"})
    assert (mpi.rank, mpi.world_size, mpi.local_rank, mpi.source) == (5, 8, 1, "openmpi")
    assert mpi.master_port == _env.DEFAULT_PORT and not mpi.use_agent_store
    pmi = _env.detect({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"})
    assert (pmi.rank, pmi.world_size, pmi.master_addr, pmi.source) == (0, 2, "127.0.0.1", "pmi")


def test_torchrun_variables_win_over_mpi_ones() -> None:
    got = _env.detect({"RANK": "0", "WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "3",
                       "OMPI_COMM_WORLD_SIZE": "4"})
    assert (got.rank, got.world_size, got.source) == (0, 1, "torchrun")


def test_slurm_takes_the_first_node_and_a_job_specific_port() -> None:
    got = _env.detect({"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2",
                       "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-08,11],cpu1"})
    assert (got.rank, got.world_size, got.local_rank, got.source) == (6, 8, 2, "slurm")
    assert got.master_addr == "gpu07" and got.master_port == _env.DEFAULT_PORT + 4242 % 1000
    assert got.job_id == "4242"
    batch = _env.detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "1",
                         "SLURM_JOB_NODELIST": "gpu07"})
    assert batch.world_size == 1, "a batch script run without srun is one task"


@pytest.mark.parametrize("nodelist,first", [("node1", "node1"), ("a[3-5]", "a3"), ("a[9,2]", "a9"),
                                            ("x,y[1-2]", "x"), ("", "127.0.0.1")])
def test_slurm_first_host_of_a_node_list(nodelist: str, first: str) -> None:
    got = _env.detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": nodelist})
    assert got.master_addr == first


def test_slurm_keeps_an_explicit_master_addr_and_port() -> None:
    got = _env.detect({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7",
                       "SLURM_JOB_NODELIST": "n[1-2]", "MASTER_ADDR": "login", "MASTER_PORT": "4000"})
    assert (got.master_addr, got.master_port) == ("login", 4000)


def test_single_process_without_launcher() -> None:
    got = _env.detect({})
    assert (got.rank, got.world_size, got.source) == (0, 1, "single")


def test_the_job_id_comes_from_the_launcher_not_torchring_job_id() -> None:
    # TORCHRING_JOB_ID is a setting (torchring._core.settings), applied by init() over this one.
    got = _env.detect({"RANK": "0", "WORLD_SIZE": "1", "TORCHRING_JOB_ID": "mine",
                       "TORCHELASTIC_RUN_ID": "elastic"})
    assert got.job_id == "elastic"


def test_bad_launcher_variables() -> None:
    with pytest.raises(ValueError, match="RANK is not"):
        _env.detect({"WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match=r"outside \[0, 2\)"):
        _env.detect({"WORLD_SIZE": "2", "RANK": "2"})
    with pytest.raises(ValueError) as caught:  # the settings' message shape: name, value, allowed, fix
        _env.detect({"WORLD_SIZE": "two", "RANK": "0"})
    assert str(caught.value) == ("WORLD_SIZE='two': expected an integer; the launcher sets it: fix the "
                                 "launch command or unset it")
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        _env.detect({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "8",
                     "OMPI_COMM_WORLD_LOCAL_SIZE": "4"})
    with pytest.raises(ValueError, match=r"outside \[0, 0\)"):
        _env.detect({"PMI_RANK": "0", "PMI_SIZE": "0"})


def test_a_world_of_one_needs_no_master_addr() -> None:
    got = _env.detect({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"})
    assert (got.world_size, got.master_addr) == (1, "127.0.0.1")


def test_the_backend_reads_only_the_store_host() -> None:
    # torch.distributed hands the backend its rank and world; partial launch variables (torch's
    # own suite sets WORLD_SIZE without RANK) must not stop it from finding the store's host.
    assert _env.store_host({"WORLD_SIZE": "3", "MASTER_ADDR": "node0"}) == "node0"
    assert _env.store_host({"WORLD_SIZE": "3"}) == "127.0.0.1"
    assert _env.store_host({"MASTER_ADDR": ""}) == "127.0.0.1"
