"""torchring-run -H over OpenSSH between simulated hosts (private /tmp each, so a rank's status
file and dump exist only on its own host): the other hosts' nodes relay them to the launcher, so
--status on the launcher's host shows every rank with its host, and a failed job's diagnosis
names the culprit on another host with its operation and Python line."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))  # the sshd hosts of the launcher's tests
from test_launch_ssh import _SSHD_PORT, _launcher, _ssh_env, ssh_hosts  # noqa: F401
from test_seeded_faults import JOB as TRACE_JOB, line_of as trace_line
from test_status import JOB as STATUS_JOB, line_of as status_line, rank_line

SPEC = "trh1:1,trh2:1,trh0:1"  # rank 1 on trh2, rank 2 on the launcher's host


def _launch(hs: list, keys: Path, tmp_path: Path, job: Path, mode: str, timeout_s: str):
    env = dict(_ssh_env(keys), TORCHRING_TIMEOUT=timeout_s, PYTHONUNBUFFERED="1")
    argv = _launcher() + ["-H", SPEC, "--ssh-port", str(_SSHD_PORT), "--ssh-identity-file", str(keys / "client_key"),
                          sys.executable, str(job), mode, str(tmp_path)]
    return hs[0].popen(argv, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)


def test_status_shows_the_ranks_of_every_host_and_the_stop_names_the_blocked_one(ssh_hosts, tmp_path):
    hs, keys = ssh_hosts
    job = _launch(hs, keys, tmp_path, STATUS_JOB, "hang", "120")
    out = ""
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            begin = time.monotonic()
            proc = hs[0].run(_launcher() + ["--status"], timeout=30, capture_output=True, text=True)
            out = proc.stdout + proc.stderr
            assert time.monotonic() - begin < 5.0, out
            if "3 of 3 ranks report" in out and "in allreduce #6" in out and "now at" in out:
                break
            assert job.poll() is None, job.communicate()[0]
            time.sleep(0.5)
        else:
            raise AssertionError(f"--status never showed every host's ranks:\n{out}")
        assert rank_line(out, 0).startswith("  rank 0 (trh1, pid "), out
        blocked = rank_line(out, 1)
        assert blocked.startswith("  rank 1 (trh2, pid ") and f"now at {status_line('lock')} in main" in blocked, out
        assert rank_line(out, 2).startswith("  rank 2 (trh0, pid ") and "in allreduce #6" in rank_line(out, 2), out
    finally:  # SIGTERM to the launcher inside trh0, found by its registration there
        hs[0].run(["sh", "-c", "kill -TERM $(basename -s .json /tmp/torchring-run-*/*.json)"], timeout=30)
        try:
            output, _ = job.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for h in hs:
                h.signal_all(signal.SIGKILL)
            raise AssertionError(f"the launcher did not end on SIGTERM:\n{job.communicate()[0]}") from None
    said = output[output.index("what the ranks' flight recorders say"):]
    assert "rank 1 (host trh2) never reached it" in said and f"{status_line('lock')} in main" in said, output


def test_a_failed_job_across_hosts_is_diagnosed_from_every_hosts_dumps(ssh_hosts, tmp_path):
    hs, keys = ssh_hosts
    job = _launch(hs, keys, tmp_path, TRACE_JOB, "skip", "4")
    output, _ = job.communicate(timeout=180)
    assert job.returncode != 0, output
    said = output[output.index("what the ranks' flight recorders say"):]
    assert "3 of 3 ranks wrote a dump" in said, output
    assert (f"ranks 0, 2 issued broadcast float32[256] root=0 at {trace_line('broadcast')} in main; "
            f"rank 1 issued allreduce float32[256] SUM at {trace_line('allreduce')} in main.") in said, output
