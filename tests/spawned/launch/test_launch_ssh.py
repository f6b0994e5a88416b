"""torchring-run -H across hosts, end to end: the launcher starts one torch agent per host,
this host's directly and the others' through ssh. Two tiers:
- a stand-in ssh (TORCHRING_SSH) that runs the remote command on this machine with an emptied
  environment: what reaches the ranks came on the command line; failure and cleanup paths;
- OpenSSH's sshd inside simulated hosts (tests/support/_hosts.py, root only), key login set up in a
  temporary directory: order across hosts whose names sort the other way, a remote failure's
  exit code, and nothing left running on any host after the launcher is killed."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

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
if what[0] == "ok":  # a progress bar's redraws: each keeps its prefix through the hosts' pipes
    sys.stdout.write(f"bar {rank}a\\rbar {rank}b\\n")
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
                          timeout=150)  # bytes: a text stream would turn each \r into \n
    stdout = proc.stdout.decode()
    out = stdout + proc.stderr.decode()
    assert proc.returncode == 0, out
    seen = _seen(stdout)
    assert sorted(seen) == [0, 1, 2], out
    prefixes = ["[localhost:0]: ", "[fakehost:1]: ", "[fakehost:2]: "]
    assert [seen[r][0] for r in range(3)] == prefixes
    for rank, prefix in enumerate(prefixes):
        assert f"{prefix}bar {rank}a\r{prefix}bar {rank}b\n" in stdout, repr(stdout)
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


def test_an_ssh_failure_is_named_and_stops_this_hosts_ranks(tmp_path: Path) -> None:
    _job(tmp_path)
    broken = tmp_path / "broken ssh"
    broken.write_text("#!/bin/sh\necho 'ssh: connect to host fakehost port 22: Connection refused' >&2\nexit 255\n")
    broken.chmod(0o755)
    env = dict(_fake_env(tmp_path), TORCHRING_SSH=f"'{broken}'")
    proc = subprocess.run(_launcher() + ["-H", "localhost:1,fakehost:1", "job.py", "ok", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 255, proc.stdout + proc.stderr
    assert "Connection refused" in proc.stderr and "ssh to fakehost failed (exit code 255" in proc.stderr
    assert "`ssh fakehost true` works" in proc.stderr, proc.stderr
    assert not list(tmp_path.glob("pid*")), "a rank started though the job could not"


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
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


# ---- over OpenSSH's sshd between simulated hosts -------------------------------------------

_SSHD_CONFIG = """Port {port}
ListenAddress {addr}
HostKey {dir}/host_key
PidFile {dir}/sshd-{name}.pid
AuthorizedKeysFile {dir}/authorized_keys
StrictModes no
UsePAM no
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
X11Forwarding no
PrintMotd no
LogLevel ERROR
"""
_SSHD_PORT = 2222  # not 22; each test host has its own network namespace, so no clash


def _keys(folder: Path) -> None:
    """A host key and a client key whose public half is the authorized key, in `folder`."""
    folder.mkdir(mode=0o700)
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"torchring-test-{name}",
                        "-f", str(folder / name)], check=True, timeout=30)
    (folder / "authorized_keys").write_text((folder / "client_key.pub").read_text())


def _start_sshd(host: object, folder: Path) -> subprocess.Popen:
    """sshd in `host` on its own address and _SSHD_PORT; /run/sshd on a tmpfs private to the host."""
    config = folder / f"sshd-{host.name}.conf"
    config.write_text(_SSHD_CONFIG.format(port=_SSHD_PORT, addr=host.addr, dir=folder, name=host.name))
    script = ("mount -t tmpfs -o mode=755 tmpfs /run && mkdir -m 755 /run/sshd && "
              f"exec /usr/sbin/sshd -D -e -f '{config}'")
    proc = host.popen(["sh", "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    pidfile = folder / f"sshd-{host.name}.pid"
    deadline = time.monotonic() + 20
    while not pidfile.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"sshd did not start in {host.name}: {proc.stderr.read()}")
        time.sleep(0.1)
    return proc


def _ssh_env(folder: Path) -> dict[str, str]:
    """The launcher's environment: a client that trusts the test host keys and reads no ~/.ssh."""
    ssh = ("ssh -F /dev/null -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o BatchMode=yes "
           "-o IdentitiesOnly=yes -o LogLevel=ERROR")
    return dict(os.environ, TORCHRING_SSH=ssh, TORCHRING_TIMEOUT="30", TORCHRING_TEST_VAR="it's a $var")


def _job_processes(host: object) -> list[int]:
    """Machine-side pids of `host`'s processes that belong to a job (a node or a rank)."""
    out = []
    for pid in host.pids():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if (b"job.py" in cmdline or b"torchring.launch.node" in cmdline) and _alive(pid):
            out.append(pid)
    return out


def sshd_hosts(tmp_path: Path, count: int):
    """`count` simulated hosts sharing tmp_path, sshd in all but trh0 (where the launcher runs),
    key login set up; yields (hosts, keys folder); a generator for fixtures."""
    if not Path("/usr/sbin/sshd").exists() or not shutil.which("ssh-keygen") or not shutil.which("ssh"):
        pytest.skip("OpenSSH's server and client are not installed (Debian: apt-get install openssh-server)")
    from _hosts import hosts
    keys = tmp_path / "keys"
    _keys(keys)
    with hosts(count, shared=str(tmp_path)) as hs:
        daemons = [_start_sshd(h, keys) for h in hs[1:]]
        try:
            yield hs, keys
        finally:
            for h in hs:
                h.signal_all(signal.SIGKILL)
            for sshd in daemons:
                sshd.kill()
                sshd.wait(timeout=10)


@pytest.fixture
def ssh_hosts(tmp_path: Path):
    """Three simulated hosts sharing tmp_path; sshd in trh1 and trh2 (the launcher runs in trh0)."""
    _job(tmp_path)
    yield from sshd_hosts(tmp_path, 3)


def _launch_on(host: object, keys: Path, tmp_path: Path, job_args: list[str], spec: str = "trh1:2,trh0:1",
               **kw: object) -> subprocess.Popen:
    argv = _launcher() + ["-H", spec, "--ssh-port", str(_SSHD_PORT), "--ssh-identity-file",
                          str(keys / "client_key"), "python", "job.py", *job_args]
    return host.popen(argv, env=_ssh_env(keys), cwd=str(tmp_path), stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True, **kw)


def test_sshd_ranks_follow_the_hosts_order_with_environment_directory_and_arguments(ssh_hosts, tmp_path):
    hs, keys = ssh_hosts
    proc = _launch_on(hs[0], keys, tmp_path, ["ok", str(tmp_path), "with space", "it's"], "trh2:1,trh1:2,trh0:1")
    stdout, stderr = proc.communicate(timeout=150)
    assert proc.returncode == 0, stdout + stderr
    seen = _seen(stdout)
    assert sorted(seen) == [0, 1, 2, 3], stdout + stderr
    # -H order, the reverse of the names' order: trh2 (remote, holds the store) has rank 0
    assert [(seen[r][0], seen[r][1]["host"]) for r in range(4)] == \
        [("[trh2:0]: ", "trh2"), ("[trh1:1]: ", "trh1"), ("[trh1:2]: ", "trh1"), ("[trh0:3]: ", "trh0")]
    for _, record in seen.values():
        assert (record["size"], record["sum"]) == (4, 1 + 2 + 3 + 4), record
        assert (Path(record["cwd"]), record["var"], record["args"], record["python"]) == \
            (tmp_path, "it's a $var", ["with space", "it's"], sys.executable), record


def test_sshd_a_remote_failure_gives_its_exit_code_and_stops_every_host(ssh_hosts, tmp_path):
    hs, keys = ssh_hosts
    proc = _launch_on(hs[0], keys, tmp_path, ["fail 1 9", str(tmp_path)])
    stdout, stderr = proc.communicate(timeout=150)
    assert proc.returncode == 9, stdout + stderr
    assert "trh1: rank 1 failed first (exit code 9)" in stderr, stderr
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (_job_processes(hs[0]) or _job_processes(hs[1])):
        time.sleep(0.2)
    assert not _job_processes(hs[0]) and not _job_processes(hs[1]), stdout + stderr


def test_sshd_the_launcher_host_dying_leaves_nothing_running_on_the_others(ssh_hosts, tmp_path):
    hs, keys = ssh_hosts
    proc = _launch_on(hs[0], keys, tmp_path, ["wait", str(tmp_path)])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list(tmp_path.glob("pid*"))) < 3:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    assert len(_job_processes(hs[1])) >= 3, "trh1 should run its node and its two ranks"
    hs[0].signal_all(signal.SIGKILL)  # the launcher, its ssh client, trh0's node and rank: all at once
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline and _job_processes(hs[1]):
        time.sleep(0.2)
    assert not _job_processes(hs[1]), "trh1's ranks outlived the launcher's host"
