"""A Ray cluster of two namespace test hosts (tests/support/_hosts.py): `ray start --head` on host 0,
`ray start --address` on host 1, one CPU each, so every job has one rank per host and torchring
joins them over TCP. DDP under Ray Train's TorchTrainer on the torchring backend and
torchring.horovod under RayExecutor (num_hosts=2) must end with the single-process weights, each
rank on its own host; `ray stop` on both hosts ends the cluster, and nothing of it may be left."""

from __future__ import annotations

import json
import os
import sys

from _hosts import hosts

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _ray_driver as job  # noqa: E402
from test_ray import reference  # noqa: E402

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def _ray(host, argv: list[str], timeout: float = 120) -> None:
    done = host.run([RAY, *argv], timeout=timeout, env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, f"ray {' '.join(argv)} on {host.name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


def test_ray_cluster_on_two_hosts(tmp_path) -> None:
    with hosts(2, shared=str(tmp_path)) as (head, other):
        address = f"{head.addr}:6379"
        try:
            _ray(head, ["start", "--head", f"--node-ip-address={head.addr}", "--port=6379", "--num-cpus=1",
                        "--include-dashboard=false", "--disable-usage-stats"])
            _ray(other, ["start", f"--address={address}", f"--node-ip-address={other.addr}", "--num-cpus=1",
                         "--disable-usage-stats"])
            want = reference()
            modes = ("trainer-ddp", "executor")
            done = head.run([sys.executable, os.path.join(HERE, "_ray_driver.py"), ",".join(modes), str(tmp_path),
                             address], timeout=300, env=ENV, capture_output=True, text=True)
            assert done.returncode == 0, f"{modes} on the cluster failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
            for mode in modes:
                out = tmp_path / mode
                ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(job.WORLD)]
                assert sorted(r["host"] for r in ranks) == ["trh0", "trh1"], f"{mode}: {ranks}"
                for rank, r in enumerate(ranks):
                    assert r["weights"] == want, f"{mode}: rank {rank} on {r['host']} ended with {r['weights']}, one process with {want}"
        finally:
            for host in (other, head):
                if host.alive:
                    host.run([RAY, "stop", "--force"], timeout=60, env=ENV, capture_output=True)
        left = [p for h in (head, other) for p in h.pids()
                if any(k in _cmdline(p) for k in ("raylet", "gcs_server", "ray::", "default_worker"))]
        assert not left, f"Ray processes left after ray stop: {left}"


def _cmdline(pid: int) -> str:
    """A process's command line ('' once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""
