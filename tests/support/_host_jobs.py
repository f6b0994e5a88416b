"""Jobs on test hosts (tests/support/_hosts.py) without a launcher: one process per rank, started
directly in its host with torch.distributed's environment, its output in a log file in the
host's shared directory. The multi-host tests and the cross-host benchmarks start their jobs
this way.

    env = job_env(hs, per_host=2, TORCHRING_TIMEOUT="60")
    procs, logs = start_ranks(hs, [sys.executable, __file__, hs[0].shared], env, per_host=2)
    codes = wait_all(procs, timeout=300)   # None: still running then (every process killed)
"""

from __future__ import annotations

import os
import subprocess
from typing import Any

_SUPPORT = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_SUPPORT))
# What a launcher would have set for this process; a job's ranks get their own.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC_", "GROUP_", "OMPI_", "PMIX_")

__all__ = ["job_env", "start_ranks", "wait_all", "log_tails"]


def job_env(hs: list[Any], per_host: int = 1, port: int = 29500, **extra: str) -> dict[str, str]:
    """The environment every rank of a job on `hs` shares (RANK and LOCAL_RANK come per rank)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_VARS)}
    env.update(PYTHONPATH=os.pathsep.join([_ROOT, _SUPPORT] + [p for p in [env.get("PYTHONPATH")] if p]),
               OMP_NUM_THREADS="1", MASTER_ADDR=hs[0].addr, MASTER_PORT=str(port),
               WORLD_SIZE=str(len(hs) * per_host), LOCAL_WORLD_SIZE=str(per_host))
    env.update(extra)
    return env


def start_ranks(hs: list[Any], argv: list[str], env: dict[str, str], per_host: int = 1,
                log: str = "log{rank}.txt") -> tuple[list[subprocess.Popen], list[str]]:
    """Starts rank host.index * per_host + local in each host; returns the processes and log paths."""
    procs, logs = [], []
    for h in hs:
        for local in range(per_host):
            rank = h.index * per_host + local
            logs.append(os.path.join(h.shared, log.format(rank=rank)))
            with open(logs[-1], "w") as out:
                procs.append(h.popen(argv, env={**env, "RANK": str(rank), "LOCAL_RANK": str(local)},
                                     cwd=h.shared, stdout=out, stderr=subprocess.STDOUT))
    return procs, logs


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int] | None:
    """Every exit code, or None when one still ran after `timeout` s; none is left running."""
    try:
        return [p.wait(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        return None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def log_tails(logs: list[str], chars: int = 2000) -> str:
    """The end of every log that exists, each under its file name."""
    return "".join(f"--- {os.path.basename(p)}:\n{open(p).read()[-chars:]}\n" for p in logs if os.path.exists(p))
