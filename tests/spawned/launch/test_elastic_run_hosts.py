"""torchring-run's elastic mode across hosts: the launcher in simulated host trh0 starts the
workers on trh1..trh3 over OpenSSH (sshd in each host, key login, as in test_launch_ssh.py),
each under torchring/launch/worker.py, and supervises them; the workers train the exact job of
tests/support/_elastic_job.py (final weights exact iff every sample was applied once).

- a host leaves the discovery script's list: its worker is stopped through its lifeline and the
  other hosts' workers re-form in process;
- a host dies (every process of it, sshd too): the launcher reports its ssh connection's end,
  the others re-form;
- a host joins the list while two ranks share trh1: the newcomer starts over ssh and is let in
  at the members' next commit; before it does, torchring-run --status on the launcher's host
  shows both ranks of trh1 (their workers relay their status files over ssh).

The job is test_elastic_run.py's (``python test_elastic_run.py OUT HOW``)."""

from __future__ import annotations

import glob
import json
import subprocess
import time
from pathlib import Path

import pytest

from test_elastic_run import _finish, _wait_for
from test_launch_ssh import _SSHD_PORT, _launcher, _ssh_env, sshd_hosts

ROOT = Path(__file__).resolve().parents[3]
JOB = Path(__file__).resolve().parent / "test_elastic_run.py"


@pytest.fixture
def elastic_hosts(tmp_path: Path):
    """Four simulated hosts sharing tmp_path; sshd in trh1..trh3 (the launcher runs in trh0)."""
    yield from sshd_hosts(tmp_path, 4)


def _launch(hs: list, keys: Path, tmp: Path, how: str, slots: str, *flags: str) -> subprocess.Popen:
    (tmp / "slots").write_text(slots)
    argv = _launcher() + ["--min-np", "2", "--max-np", "4", "--host-discovery-script", f"cat {tmp / 'slots'}",
                          "--discovery-interval", "0.2", "--ssh-port", str(_SSHD_PORT),
                          "--ssh-identity-file", str(keys / "client_key"), *flags, str(JOB), str(tmp), how]
    env = {**_ssh_env(keys), "TORCHRING_TIMEOUT": "10",
           "PYTHONPATH": f"{ROOT / 'tests' / 'support'}:{ROOT}"}
    return hs[0].popen(argv, env=env, cwd=str(tmp), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _exact(tmp: Path, output: str, size: int, hosts: list[str]) -> None:
    """The job ended as a world of `size` on `hosts` with exact weights and every sample once."""
    from _elastic_job import check

    results = []
    for path in sorted(glob.glob(str(tmp / "result-*.json"))):
        with open(path) as f:
            results.append(json.load(f))
    assert len(results) == size and check(results, size) == [], f"{check(results, size)}\n{output[-4000:]}"
    assert sorted({r["host"] for r in results}) == sorted(hosts), [r["host"] for r in results]


def _job_processes(host: object) -> list[int]:
    out = []
    for pid in host.pids():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"test_elastic_run.py" in cmdline or b"torchring.launch.worker" in cmdline:
            out.append(pid)
    return out


def test_a_host_left_out_by_discovery_is_stopped_and_the_others_re_form(elastic_hosts, tmp_path: Path) -> None:
    hs, keys = elastic_hosts
    proc = _launch(hs, keys, tmp_path, "wait", "trh1:1\ntrh2:1\ntrh3:1\n")
    _wait_for(tmp_path / "victim2.json", proc)  # w2 on trh3 (rank 2) waits at step 3
    (tmp_path / "slots").write_text("trh1:1\ntrh2:1\n")
    code, output = _finish(proc)
    assert code == 0, output[-4000:]
    assert "host discovery: trh1:1, trh2:1, trh3:1 -> trh1:1, trh2:1" in output, output[-4000:]
    assert "stopping worker w2 on trh3" in output, output[-4000:]
    _exact(tmp_path, output, 2, ["trh1", "trh2"])
    assert not _job_processes(hs[3]), "trh3's worker outlived its stop"


def test_a_dead_host_is_reported_and_the_others_re_form(elastic_hosts, tmp_path: Path) -> None:
    hs, keys = elastic_hosts
    proc = _launch(hs, keys, tmp_path, "wait", "trh1:1\ntrh2:1\ntrh3:1\n")
    _wait_for(tmp_path / "victim2.json", proc)
    hs[3].kill_all()  # trh3: its worker and its sshd
    code, output = _finish(proc)
    assert code == 0, output[-4000:]
    assert "worker w2 on trh3" in output and "exited with code 255" in output, output[-4000:]
    _exact(tmp_path, output, 2, ["trh1", "trh2"])


def test_a_host_added_by_discovery_joins_at_the_next_commit(elastic_hosts, tmp_path: Path) -> None:
    hs, keys = elastic_hosts
    proc = _launch(hs, keys, tmp_path, "hold", "trh1:2\n", "-np", "2")
    _wait_for(tmp_path / "holding", proc)  # both ranks of trh1 commit again and again at step 3
    out, deadline = "", time.monotonic() + 30
    while time.monotonic() < deadline:
        out = hs[0].run(_launcher() + ["--status"], timeout=30, capture_output=True, text=True).stdout
        ranks = [line for line in out.splitlines() if line.startswith("  rank ")]
        if "2 of 2 ranks report" in out and len(ranks) == 2 and all("(trh1, pid " in r for r in ranks):
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"--status on trh0 never showed trh1's two ranks:\n{out}")
    (tmp_path / "slots").write_text("trh1:2\ntrh2:1\n")
    code, output = _finish(proc)
    assert code == 0, output[-4000:]
    assert "started worker w2 on trh2" in output, output[-4000:]
    _exact(tmp_path, output, 3, ["trh1", "trh2"])
    for h in hs[1:3]:
        assert not _job_processes(h), f"{h.name}: a worker outlived the job"
