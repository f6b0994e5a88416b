"""torchring under a real Spark in local mode: pyspark's TorchDistributor running DDP on the
torchring backend, torchring.horovod.spark.run returning every rank's result in rank order, and a
lost Python worker failing the barrier stage (Spark does not retry a barrier result stage) after
which the same session trains again. Each test runs _spark_driver.py in a
process of its own (a JVM comes and goes with it); every final model must equal the same steps
computed in one process (integer-valued data: the averages are exact)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

if not (shutil.which("java") or os.environ.get("JAVA_HOME")):
    pytest.skip("Spark needs Java 17 (Debian: apt-get install openjdk-17-jre-headless)", allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "ray")]
import _spark_driver as job  # noqa: E402
from test_ray import reference  # noqa: E402


def drive(modes: list[str], tmp_path, timeout: float = 300) -> dict[str, dict]:
    """Runs the driver (one Spark session for every mode); each mode's result.json."""
    argv = [sys.executable, os.path.join(HERE, "_spark_driver.py"), ",".join(modes), str(tmp_path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"the Spark driver ({modes}) failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return {mode: json.loads((tmp_path / mode / "result.json").read_text()) for mode in modes}


def test_spark_local_mode(tmp_path) -> None:
    """TorchDistributor, torchring.horovod.spark.run, then a run that loses a worker and one after it."""
    seen = drive(["distributor", "horovod", "horovod-failure"], tmp_path)
    want = reference()
    assert seen["distributor"]["weights"] == want, seen["distributor"]

    results = seen["horovod"]["results"]
    assert [r["rank"] for r in results] == list(range(job.WORLD)), results
    assert all(r["size"] == job.WORLD for r in results), results
    assert sorted(r["local_rank"] for r in results) == list(range(job.WORLD)), results
    assert [r["weights"] for r in results] == [want] * job.WORLD, results

    failing = seen["horovod-failure"]
    assert (tmp_path / "horovod-failure" / "died").exists(), "rank 1 never died: the test did not test the failure"
    error = failing["first_error"]
    assert error is not None and "barrier" in error and "crashed" in error, error
    # Spark ends the barrier stage's other task; it must not sit out torchring's timeout (15 s) or hang.
    assert failing["first_s"] < 60, f"the failed run took {failing['first_s']:.1f} s"
    assert [r["weights"] for r in failing["results"]] == [want] * job.WORLD, failing["results"]
