"""A Spark standalone cluster on two namespace test hosts (tests/support/_hosts.py): the master and a
one-core worker on host 0, a one-core worker on host 1, so each job has one rank per host and
torchring joins them over TCP. pyspark's TorchDistributor (local_mode=False: a barrier task per
rank, each running torchrun) with DDP on the torchring backend, and torchring.horovod.spark.run,
must end with the single-process weights; the master and workers are stopped and nothing of them
may be left."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from _hosts import hosts

if not (shutil.which("java") or os.environ.get("JAVA_HOME")):
    pytest.skip("Spark needs Java 17 (Debian: apt-get install openjdk-17-jre-headless)", allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "ray")]
import _spark_driver as job  # noqa: E402
from test_ray import reference  # noqa: E402
from test_ray_hosts import _cmdline  # noqa: E402

import pyspark  # noqa: E402

SPARK_CLASS = os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-class")


def _env(host) -> dict[str, str]:
    return {**os.environ, "SPARK_LOCAL_IP": host.addr, "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_DRIVER_PYTHON": sys.executable, "SPARK_LOG_DIR": host.shared, "SPARK_NO_DAEMONIZE": "1"}


def _wait_for_workers(master_log: str, n: int, timeout: float = 90) -> None:
    """Until the master's log says `n` workers registered."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(master_log) as f:
            if f.read().count("Registering worker") >= n:
                return
        time.sleep(0.5)
    with open(master_log) as f:
        raise AssertionError(f"{n} Spark workers did not register in {timeout} s; master log:\n{f.read()[-4000:]}")


def test_spark_standalone_cluster_on_two_hosts(tmp_path) -> None:
    with hosts(2, shared=str(tmp_path)) as (head, other):
        master = f"spark://{head.addr}:7077"
        master_log = str(tmp_path / "master.log")
        daemons = []
        try:
            with open(master_log, "w") as log:
                daemons.append(head.popen([SPARK_CLASS, "org.apache.spark.deploy.master.Master", "--host", head.addr,
                                           "--port", "7077", "--webui-port", "8080"], env=_env(head),
                                          stdout=log, stderr=subprocess.STDOUT))
            for i, host in enumerate((head, other)):
                with open(tmp_path / f"worker{i}.log", "w") as log:
                    daemons.append(host.popen([SPARK_CLASS, "org.apache.spark.deploy.worker.Worker", master,
                                               "--host", host.addr, "--cores", "1", "--memory", "2g",
                                               "--webui-port", "8081"], env=_env(host),
                                              stdout=log, stderr=subprocess.STDOUT))
            _wait_for_workers(master_log, 2)
            want = reference()
            modes = ("distributor", "horovod")
            done = head.run([sys.executable, os.path.join(HERE, "_spark_driver.py"), ",".join(modes), str(tmp_path),
                             master], timeout=300, env=_env(head), capture_output=True, text=True)
            assert done.returncode == 0, f"{modes} on the cluster failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
            for mode in modes:
                seen = json.loads((tmp_path / mode / "result.json").read_text())
                if mode == "distributor":
                    assert seen["weights"] == want, seen
                else:
                    results = seen["results"]
                    assert [r["rank"] for r in results] == [0, 1], results
                    assert sorted(r["host"] for r in results) == ["trh0", "trh1"], results
                    assert [r["weights"] for r in results] == [want] * job.WORLD, results
        finally:
            # The JVMs are nsenter's children inside each host: stop them there (SIGTERM, as
            # Spark's stop scripts do), then wait for the nsenter processes.
            stopped = {h.name: _stop_spark(h) for h in (head, other)}
            for d in daemons:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    d.wait(timeout=10)
        assert all(stopped.values()), f"Spark processes still running 30 s after SIGTERM: {stopped}"


def _spark_pids(host) -> list[int]:
    return [p for p in host.pids() if "org.apache.spark" in _cmdline(p)]


def _stop_spark(host, timeout: float = 30) -> bool:
    """SIGTERM every Spark JVM of `host`; True once none is left."""
    for pid in _spark_pids(host):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _spark_pids(host):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True
