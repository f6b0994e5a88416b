"""torchring-run -H across hosts, end to end: the launcher starts one torch agent per host,
this host's directly and the others' through ssh. Two tiers:
- a stand-in ssh (TORCHRING_SSH) that runs the remote command on this machine with an emptied
  environment: what reaches the ranks came on the command line; failure and cleanup paths;
- OpenSSH's sshd inside simulated hosts (tests/_hosts.py, root only), key login set up in a
  temporary directory: order across hosts whose names sort the other way, a remote failure's
  exit code, and nothing left running on any host after the launcher is killed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_FAKE_SSH = """#!/bin/sh
# ssh stand-in: [-T] [-o OPT] [-p PORT] [-i KEY] HOST COMMAND; runs COMMAND here, environment emptied
while [ $# -gt 2 ]; do
  case "$1" in
    -o|-p|-i) echo "option $1 $2" >> "$FAKE_SSH_LOG"; shift 2;;
    *) echo "option $1" >> "$FAKE_SSH_LOG"; shift;;
  esac
done
echo "host $1" >> "$FAKE_SSH_LOG"
exec env -i HOME="$HOME" PATH=/usr/bin:/bin sh -c "$2"
"""

# Each rank: its pid in the shared directory, an allreduce, one line of what it sees; then
# what the first argument says: "ok", "fail R C" (rank R exits with C, the others wait), "wait".
_JOB = """
import json, os, socket, sys, time, torch, torchring
torchring.init()
rank, what, shared = torchring.rank(), sys.argv[1].split(), sys.argv[2]
open(os.path.join(shared, f"pid{rank}"), "w").write(f"{socket.gethostname()} {os.getpid()}")
total = torchring.allreduce(torch.tensor([rank + 1]))
print("seen " + json.dumps({"rank": rank, "size": torchring.size(), "sum": int(total.item()),
      "cwd": os.getcwd(), "var": os.environ.get("TORCHRING_TEST_VAR"), "python": sys.executable,
      "host": socket.gethostname(), "args": sys.argv[3:]}), flush=True)
if what[0] == "fail" and rank == int(what[1]):
    sys.exit(int(what[2]))
if what[0] != "ok":
    time.sleep(120)
"""


def _seen(out: str) -> dict[int, tuple[str, dict]]:
    """{rank: (line prefix, what the rank printed)} of the 'seen' lines in `out`."""
    import json
    found = {}
    for prefix, body in re.findall(r"^(\[[^\]]*\]: )seen (.*)$", out, re.M):
        record = json.loads(body)
        found[record["rank"]] = (prefix, record)
    return found


def _launcher() -> list[str]:
    return [sys.executable, "-m", "torchring.run"]


def _fake_env(tmp_path: Path) -> dict[str, str]:
    ssh = tmp_path / "fake ssh"
    ssh.write_text(_FAKE_SSH)
    ssh.chmod(0o755)
    return dict(os.environ, TORCHRING_SSH=f"'{ssh}'", FAKE_SSH_LOG=str(tmp_path / "ssh.log"),
                TORCHRING_TIMEOUT="30", TORCHRING_TEST_VAR="it's a $var")


def _job(tmp_path: Path) -> Path:
    (tmp_path / "job.py").write_text(_JOB)
    return tmp_path / "job.py"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_dead(pids: list[int], within: float) -> list[int]:
    """The pids still alive after `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


def _pids(shared: Path, ranks: int) -> list[int]:
    return [int((shared / f"pid{r}").read_text().split()[1]) for r in range(ranks)]


def _kill_left(shared: Path) -> None:
    """SIGKILL the ranks of a failed test that still run on this machine (never the test's own)."""
    for path in shared.glob("pid*"):
        words = path.read_text().split()
        if len(words) == 2 and _alive(int(words[1])):
            os.kill(int(words[1]), signal.SIGKILL)


def test_fake_ssh_forwards_environment_directory_arguments_and_keeps_host_order(tmp_path: Path) -> None:
    _job(tmp_path)
    args = ["-H", "localhost:1,fakehost:2", "-p", "2222", "-i", str(tmp_path / "key"),
            "python", "job.py", "ok", str(tmp_path), "with space", "it's"]
    proc = subprocess.run(_launcher() + args, cwd=tmp_path, env=_fake_env(tmp_path), capture_output=True,
                          text=True, timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    seen = _seen(proc.stdout)
    assert sorted(seen) == [0, 1, 2], out
    assert [seen[r][0] for r in range(3)] == ["[localhost:0]: ", "[fakehost:1]: ", "[fakehost:2]: "]
    for prefix, record in seen.values():
        assert (record["size"], record["sum"]) == (3, 1 + 2 + 3), record
        assert (Path(record["cwd"]), record["var"], record["args"]) == \
            (tmp_path, "it's a $var", ["with space", "it's"]), record
        assert record["python"] == sys.executable, record
    log = (tmp_path / "ssh.log").read_text().splitlines()
    assert log.count("host fakehost") == 1 and "host localhost" not in log  # one ssh, none for localhost
    assert "option -p 2222" in log and f"option -i {tmp_path / 'key'}" in log, log


def test_a_remote_rank_failing_stops_every_host_with_its_exit_code(tmp_path: Path) -> None:
    _job(tmp_path)
    start = time.monotonic()
    proc = subprocess.run(_launcher() + ["-H", "localhost:1,fakehost:2", "job.py", "fail 2 7", str(tmp_path)],
                          cwd=tmp_path, env=_fake_env(tmp_path), capture_output=True, text=True, timeout=150)
    took, out = time.monotonic() - start, proc.stdout + proc.stderr
    assert proc.returncode == 7, out
    assert "fakehost: rank 2 failed first (exit code 7)" in out and "fakehost's ranks failed first" in out, out
    try:
        assert not _wait_dead(_pids(tmp_path, 3), 5), f"ranks outlived the job\n{out}"
    finally:
        _kill_left(tmp_path)
    assert took < 100, out


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_the_launcher_stopped_or_killed_leaves_no_rank_running(tmp_path: Path, how: int) -> None:
    _job(tmp_path)
    proc = subprocess.Popen(_launcher() + ["-H", "localhost:1,fakehost:2", "job.py", "wait", str(tmp_path)],
                            cwd=tmp_path, env=_fake_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(list(tmp_path.glob("pid*"))) < 3:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        time.sleep(0.5)  # every pid file written in full
        pids = _pids(tmp_path, 3)
        proc.send_signal(how)
        code = proc.wait(timeout=60)
        left = _wait_dead(pids, 45)
        out = proc.stdout.read()
        assert not left, f"ranks {left} still run after the launcher got signal {how}\n{out}"
        assert code == (-how if how == signal.SIGKILL else 128 + how), out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _kill_left(tmp_path)
