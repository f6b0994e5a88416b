"""A smoke subset of torch's own distributed suite on the torchring backend (issue #14).

tests/peers/run_torch_suite.py runs ``distributed_test.py``'s ``_DistTestBase`` unmodified at
world 3 over env://; here only a few of its tests, one per kind of operation and one DDP
training, each in three freshly spawned ranks (about ten seconds a test on two cores). Every
selected test must pass, or be skipped for a reason the runner lists. The full comparison
with gloo is the runner's documented command (its docstring), not part of this run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("expecttest", reason="torch's test helpers need expecttest (the `test` extra)")

RUNNER = Path(__file__).resolve().parents[2] / "peers" / "run_torch_suite.py"

# One test per operation kind, each of which checks values on every rank.
MUST_PASS = [
    "test_all_reduce_sum",              # all_reduce, every rank as the odd one out
    "test_broadcast",                   # broadcast from every root, several dtypes
    "test_all_gather",                  # list-form all_gather
    "test_reduce_sum",                  # rooted reduce, every root
    "test_gather",                      # gather to every root
    "test_scatter",                     # scatter from every root
    "test_send_recv",                   # point-to-point between every pair
    "test_send_recv_any_source",        # recv from any source, the sender from the Work
    "test_barrier",                     # barrier against wall-clock sleeps
    "test_DistributedDataParallelCPU",  # DDP training on CPU against a single-process model
]
# Skipped by the suite without spawning: a gate by backend name and a CUDA-only test. They check
# that a skip's message is one the runner accounts for.
MUST_SKIP = ["test_scatter_object_list", "test_all_reduce_sum_cuda"]


def test_torch_suite_smoke_on_torchring(tmp_path: Path) -> None:
    """The selected tests pass on torchring (env://, world 3), the two gated ones skip for a listed reason."""
    summary = tmp_path / "summary.json"
    cmd = [sys.executable, str(RUNNER), "--backend", "torchring", "--init", "env", "--out", str(tmp_path),
           "--json", str(summary), "--timeout", "120"]
    for name in MUST_PASS + MUST_SKIP:
        cmd += ["-t", name]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500,
                          env={k: v for k, v in os.environ.items() if k not in ("BACKEND", "INIT_METHOD")})
    log = (tmp_path / "torchring-env.log")
    detail = f"runner output:\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}\npytest log tail:\n" + (
        log.read_text()[-6000:] if log.exists() else "(no log)")
    assert summary.exists(), detail
    result = json.loads(summary.read_text())
    outcomes = result["runs"]["torchring-env"]
    assert sorted(outcomes) == sorted(MUST_PASS + MUST_SKIP), detail
    not_passed = {n: outcomes[n] for n in MUST_PASS if outcomes[n][0] != "passed"}
    assert not not_passed, f"expected to pass on torchring: {not_passed}\n{detail}"
    for name in MUST_SKIP:
        assert outcomes[name][0] == "skipped", f"{name}: {outcomes[name]}\n{detail}"
    assert result["problems"] == [], detail  # every skip has a listed reason, nothing failed
    assert proc.returncode == 0, detail
