"""A one-node SLURM cluster for tests, from Debian's packages (slurmctld, slurmd, slurm-client,
munge), private to the test: its own munge key and socket, slurm.conf, state and logs in a
temporary directory, free ports, nothing read from or written to /etc.

    with cluster(tmp_path) as env:      # env: os.environ plus SLURM_CONF
        subprocess.run(["srun", "-N1", "-n2", "hostname"], env=env)

The node is this machine's hostname with its CPUs; the daemons run in the foreground as
children of the test and are stopped when the block is left. Skips the test (saying why)
where the programs are missing or the test is not root (slurmd must be).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

__all__ = ["cluster", "missing"]

_PROGRAMS = ("munged", "slurmctld", "slurmd", "srun", "sinfo")
_READY_S = 30.0


def missing() -> str | None:
    """Why no cluster can be made here, or None."""
    absent = [p for p in _PROGRAMS if shutil.which(p) is None]
    if absent:
        return (f"no SLURM here ({', '.join(absent)} not found): apt-get install -y "
                "--no-install-recommends slurmctld slurmd slurm-client munge")
    if os.geteuid() != 0:
        return "slurmd must run as root (CI runs these tests as root)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _conf(d: Path, node: str) -> str:
    """slurm.conf of a one-node cluster whose files all lie in `d`."""
    return "\n".join([
        "ClusterName=torchringtest", f"SlurmctldHost={node}(127.0.0.1)",
        f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
        "AuthType=auth/munge", f"AuthInfo=socket={d}/munge.sock", "CredType=cred/munge",
        "SlurmUser=root", "SlurmdUser=root",  # missing() requires root
        f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool",
        f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd.pid",
        f"SlurmctldLogFile={d}/slurmctld.log", f"SlurmdLogFile={d}/slurmd.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SwitchType=switch/none",
        "MpiDefault=none", "ReturnToService=2", "SchedulerType=sched/builtin",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "JobCompType=jobcomp/none",
        "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
        "PlugStackConfig=/dev/null",
        f"NodeName={node} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} State=UNKNOWN",
        f"PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP", ""])


@contextlib.contextmanager
def cluster(directory: Path) -> Iterator[dict[str, str]]:
    """Start munged, slurmctld and slurmd with their files in `directory`; yields srun's env."""
    why = missing()
    if why:
        pytest.skip(why)
    d = Path(directory) / "slurm"
    for sub in ("state", "spool"):
        (d / sub).mkdir(parents=True)
    d.chmod(0o700)
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    node = socket.gethostname()
    (d / "slurm.conf").write_text(_conf(d, node))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SLURM_CONF"] = str(d / "slurm.conf")
    log = open(d / "daemons.out", "w")
    daemons: list[subprocess.Popen] = []
    try:
        for argv in ([shutil.which("munged"), "--foreground", "--force", f"--key-file={key}",
                      f"--socket={d}/munge.sock", f"--pid-file={d}/munged.pid",
                      f"--log-file={d}/munged.log", f"--seed-file={d}/munge.seed"],
                     ["slurmctld", "-D", "-f", str(d / "slurm.conf")],
                     ["slurmd", "-D", "-N", node, "-f", str(d / "slurm.conf")]):
            daemons.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL))
            if argv[0].endswith("munged"):
                _wait(lambda: (d / "munge.sock").exists(), "munged's socket", d)
        _wait(lambda: subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                                     text=True, timeout=10).stdout.strip() == "idle", "the node idle", d)
        yield env
    finally:
        for p in reversed(daemons):
            p.terminate()
        for p in reversed(daemons):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        log.close()


def _wait(ready, what: str, d: Path) -> None:
    """Polls `ready()` for up to 30 s; raises with the daemons' logs if it never holds."""
    deadline = time.monotonic() + _READY_S
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.2)
    logs = "".join(f"--- {p.name}:\n{p.read_text(errors='replace')[-2000:]}\n"
                   for p in sorted(d.glob("*.log")) + [d / "daemons.out"] if p.exists())
    raise RuntimeError(f"SLURM test cluster: no {what} after {_READY_S:.0f} s\n{logs}")
