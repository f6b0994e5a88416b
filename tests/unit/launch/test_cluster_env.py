"""The variables Kubernetes operators give a pod (from their documentation), fed to torchring as
they arrive: Kubeflow's PyTorchJob (one process per pod: MASTER_ADDR, MASTER_PORT, WORLD_SIZE,
RANK; with nprocPerNode, the PET_* variables that torchrun reads and turns into torch's contract)
and the MPI Operator's MPIJob (Open MPI's OMPI_COMM_WORLD_* and the MASTER_ADDR the manifest
passes with -x). Checked: rank, world size, local rank, the store's address and port."""

from __future__ import annotations

from pathlib import Path

import torch.distributed.run as torchrun

from torchring._core import env as _env

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "kubernetes"


def test_a_pytorchjob_pod_of_one_process_is_read_as_torchs_contract() -> None:
    pod = {"MASTER_ADDR": "torchring-train-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "4", "RANK": "2",
           "PYTHONUNBUFFERED": "0"}
    launch = _env.detect(pod)
    assert (launch.source, launch.rank, launch.world_size) == ("torchrun", 2, 4)
    assert (launch.master_addr, launch.master_port) == ("torchring-train-master-0", 23456)
    assert launch.local_rank is None and launch.local_world_size is None  # init() counts the pod's ranks


def test_a_pytorchjob_with_nproc_per_node_starts_torchrun_whose_ranks_torchring_reads(monkeypatch) -> None:
    pet = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "1",
           "PET_MASTER_ADDR": "torchring-train-master-0", "PET_MASTER_PORT": "23456"}
    for name, value in pet.items():
        monkeypatch.setenv(name, value)
    args = torchrun.get_args_parser().parse_args(["examples/train.py"])
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("2", "4", 1)
    assert (args.master_addr, args.master_port) == ("torchring-train-master-0", 23456)
    # what torchrun's agent then gives local rank 3 of node 1 (torch.distributed.run's contract)
    rank_env = {"RANK": "7", "LOCAL_RANK": "3", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
                "MASTER_ADDR": "torchring-train-master-0", "MASTER_PORT": "23456", "TORCHELASTIC_RUN_ID": "none",
                "TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_RESTART_COUNT": "0"}
    launch = _env.detect(rank_env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.local_world_size) == (7, 8, 3, 4)
    assert (launch.master_addr, launch.master_port, launch.use_agent_store) == ("torchring-train-master-0", 23456, False)


def test_an_mpijob_rank_is_read_from_open_mpis_variables_and_the_manifests_master_addr() -> None:
    rank = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_NODE_RANK": "1",
            "OMPI_MCA_orte_default_hostfile": "/etc/mpi/hostfile", "K_MPI_JOB_ROLE": "worker",
            "MASTER_ADDR": "torchring-horovod-worker-0.torchring-horovod-worker", "MASTER_PORT": "29500"}
    launch = _env.detect(rank)
    assert (launch.source, launch.rank, launch.world_size, launch.local_rank, launch.local_world_size) == \
        ("openmpi", 5, 8, 1, 4)
    assert (launch.master_addr, launch.master_port) == ("torchring-horovod-worker-0.torchring-horovod-worker", 29500)


def test_the_manifests_pass_what_the_tests_feed() -> None:
    import yaml  # PyYAML comes with the test extra (torch's and Lightning's dependencies)

    job = yaml.safe_load((EXAMPLES / "pytorchjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        pod = replica["template"]["spec"]
        assert pod["containers"][0]["command"][:2] == ["torchrun", "examples/train.py"]
        assert pod["containers"][0]["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
        assert pod["volumes"][0]["emptyDir"]["medium"] == "Memory"
    mpi = yaml.safe_load((EXAMPLES / "mpijob.yaml").read_text())
    assert (mpi["apiVersion"], mpi["kind"]) == ("kubeflow.org/v2beta1", "MPIJob")
    command = mpi["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"]
    assert command[0] == "mpirun" and "MASTER_ADDR=torchring-horovod-worker-0.torchring-horovod-worker" in command
    assert (Path(__file__).resolve().parents[3] / command[-1]).is_file()
