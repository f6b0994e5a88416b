"""torchring-run -H when the first host (the launcher's and the rendezvous store's) loses its
link mid-job, over OpenSSH's sshd between simulated hosts (tests/support/_hosts.py, root only).

A pulled cable sends no FIN: the ssh connections to the other hosts stay open, and torch's
agent on those hosts may never return although its ranks raised (TORCHRING_TIMEOUT) and exited.
Each host's node (torchring/launch/node.py) must then end on its own: every remote node exits
non-zero within a bound and leaves nothing running; the launcher exits non-zero too.

The remote nodes' exit codes cannot come back over the dead link, so the ssh command
(TORCHRING_SSH, a wrapper around the fixture's client) has each remote shell write its node's
exit code into the shared directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from test_launch_ssh import _SSHD_PORT, _job_processes, _launcher, _ssh_env, ssh_hosts  # noqa: F401

TIMEOUT_S = 5            # TORCHRING_TIMEOUT of the job
NODES_END_S = 45.0       # fault -> every remote node and rank gone (about 10 s seen): timeout + slack
LAUNCHER_END_S = 45.0    # fault -> the launcher on the cut-off host exited (about 18 s seen: its ssh
#                          clients give up after 3 unanswered keepalives 5 s apart)
_START_S = 150.0         # launch, rendezvous over ssh, first steps, on a loaded 2-core machine

RANK_CODE = 7            # a rank's exit code once its allreduce raised (not torchrun's 1)

# Each rank: allreduces until one raises, then exits RANK_CODE; after a few steps its host and
# pid in ready<rank>.
_LOOP = f"""
import os, socket, sys, time, traceback, torch, torchring
torchring.init()
rank, shared = torchring.rank(), sys.argv[1]
try:
    for step in range(1000000):
        torchring.allreduce(torch.ones(1000))
        if step == 5:
            with open(os.path.join(shared, f".ready{{rank}}"), "w") as f:
                f.write(f"{{socket.gethostname()}} {{os.getpid()}}")
            os.replace(os.path.join(shared, f".ready{{rank}}"), os.path.join(shared, f"ready{{rank}}"))
        time.sleep(0.01)
except Exception:
    traceback.print_exc()
    sys.exit({RANK_CODE})
"""

# `ssh` first on the launcher's PATH: torchring-run's default client command (its keepalive
# options included) goes to the real client with the fixture's options (test host keys, no
# ~/.ssh) added, and the remote command wrapped so that the remote shell writes the node's exit
# code into <codes>/<host> (the launcher cannot learn it over a dead link). Its argv: <codes>/argv.
_SSH_WRAPPER = """#!{python}
import os, shlex, sys
args = sys.argv[1:]
host, command = args[-2], args[-1]
with open(os.path.join({codes!r}, "argv"), "a") as f:
    f.write(shlex.join(args[:-1]) + "\\n")
wrapped = "(" + command + "); echo $? > " + shlex.quote(os.path.join({codes!r}, host))
fixture = shlex.split({fixture!r})
os.execv({ssh!r}, [{ssh!r}] + fixture[1:] + args[:-1] + [wrapped])
"""


def _wait_ready(folder: Path, ranks: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + _START_S
    while time.monotonic() < deadline:
        if all((folder / f"ready{r}").exists() for r in range(ranks)):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    out, err = proc.communicate(timeout=30)
    raise AssertionError(f"the job did not start (launcher exit {proc.poll()})\n{out}\n{err}")


def test_sshd_the_store_and_launcher_host_losing_its_link_ends_every_node(ssh_hosts, tmp_path):
    hs, keys = ssh_hosts
    (tmp_path / "loop_job.py").write_text(_LOOP)
    codes = tmp_path / "codes"
    codes.mkdir()
    env = _ssh_env(keys)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(_SSH_WRAPPER.format(python=sys.executable, codes=str(codes),
                                                     fixture=env.pop("TORCHRING_SSH"), ssh=shutil.which("ssh")))
    (bin_dir / "ssh").chmod(0o755)
    env.update(PATH=f"{bin_dir}:{env['PATH']}", TORCHRING_TIMEOUT=str(TIMEOUT_S))
    argv = _launcher() + ["-H", "trh0:1,trh1:1,trh2:1", "--ssh-port", str(_SSHD_PORT),
                          "--ssh-identity-file", str(keys / "client_key"), "python", "loop_job.py", str(tmp_path)]
    proc = hs[0].popen(argv, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)
    try:
        _wait_ready(tmp_path, 3, proc)
        ready = {r: (tmp_path / f"ready{r}").read_text().split()[0] for r in range(3)}
        assert ready == {0: "trh0", 1: "trh1", 2: "trh2"}, ready
        running = {h.name: len(_job_processes(h)) for h in hs[1:]}
        assert running == {"trh1": 3, "trh2": 3}, running  # the remote shell, its node, its rank
        hs[0].link(False)
        fault = time.monotonic()
        left: dict[str, list[int]] = {}
        while time.monotonic() < fault + NODES_END_S:
            left = {h.name: _job_processes(h) for h in hs[1:]}
            if not any(left.values()):
                break
            time.sleep(0.5)
        nodes_took = time.monotonic() - fault
        try:
            code = proc.wait(timeout=max(1.0, fault + LAUNCHER_END_S - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = None
        launcher_took = time.monotonic() - fault
        if proc.poll() is None:
            proc.kill()
        out, err = proc.communicate(timeout=30)
        print(f"remote nodes gone after {nodes_took:.1f} s; launcher exit {code} after {launcher_took:.1f} s")
        found = {h: (codes / h).read_text().strip() if (codes / h).exists() else None for h in ("trh1", "trh2")}
        print(f"remote nodes' exit codes: {found}")
        argvs = (codes / "argv").read_text().splitlines()
        assert len(argvs) == 2 and all("-o ServerAliveInterval=5 -o ServerAliveCountMax=3" in a for a in argvs), \
            argvs  # the default client's keepalive: TORCHRING_TIMEOUT=5 is below 3 probes 5 s apart
        assert not any(left.values()), \
            f"still running {NODES_END_S:.0f} s after trh0's link went down: {left}\n{out}\n{err}"
        assert found == {"trh1": str(RANK_CODE), "trh2": str(RANK_CODE)}, \
            f"the remote nodes' exit codes: {found}, expected their ranks' {RANK_CODE}\n{out}\n{err}"
        assert code == RANK_CODE, f"the launcher exited {code} within {LAUNCHER_END_S:.0f} s\n{out}\n{err}"
        assert f"trh0: rank 0 failed first (exit code {RANK_CODE})" in err, err
        assert "the ssh connection to trh1, trh2 was lost (exit code 255)" in err, err
        assert f"trh0's ranks failed first (exit code {RANK_CODE}); every other host's ranks were stopped" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)


def test_the_default_ssh_client_gives_up_on_a_host_silent_for_torchring_timeout() -> None:
    from torchring.launch import ssh as sl
    argv = sl.ssh_argv("h1", "cmd", alive_s=300.0)
    assert argv[-2:] == ["h1", "cmd"] and argv[:2] == ["ssh", "-T"]
    # probes 5 s apart; as many unanswered as fit in the ranks' own timeout, at least 3
    assert "ServerAliveInterval=5" in argv and "ServerAliveCountMax=60" in argv, argv
    assert "ServerAliveCountMax=3" in sl.ssh_argv("h1", "cmd", alive_s=2.0)
    assert sl.ssh_argv("h1", "cmd", ssh="myssh -v", alive_s=300.0) == ["myssh", "-v", "h1", "cmd"]  # user's own


# A node whose torch agent never returns after its ranks failed (as torchrun's c10d agent does
# when the store's host is unreachable): the agent is made to hang in what it does after its run.
_STUCK_NODE = """
import sys, time
from torch.distributed.elastic.agent.server import api
api.SimpleElasticAgent._record_worker_events = lambda self, result: time.sleep(3600)
from torchring.launch import node
node.AGENT_GRACE_S = float(sys.argv[1])
sys.exit(node.node_main(sys.argv[2:]))
"""

_EXIT_BY_RANK = """
import os, sys
rank = int(os.environ["RANK"])
open(os.path.join(sys.argv[1], f"pid{rank}"), "w").write(str(os.getpid()))
sys.exit(5 if rank == 0 else 0)
"""


def test_a_node_whose_agent_does_not_return_after_a_rank_failed_ends_on_its_own(tmp_path: Path) -> None:
    import socket
    (tmp_path / "ranks.py").write_text(_EXIT_BY_RANK)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    grace = 3.0
    argv = [sys.executable, "-c", _STUCK_NODE, str(grace), "--host=here", "--node-rank=0", "--nnodes=1",
            "--nproc=2", "--master=127.0.0.1", f"--port={port}", "--job=stuck", "--",
            str(tmp_path / "ranks.py"), str(tmp_path)]
    lifeline, keep = os.pipe()  # the node's stdin stays open (it stops when its launcher's pipe closes)
    start = time.monotonic()
    with open(tmp_path / "out", "w+") as out_file, open(tmp_path / "err", "w+") as err_file:
        proc = subprocess.Popen(argv, stdin=lifeline, stdout=out_file, stderr=err_file,
                                env=dict(os.environ, TORCHRING_TIMEOUT="30"))
        os.close(lifeline)
        try:
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            os.close(keep)
    out, err = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    took = time.monotonic() - start
    assert proc.returncode == 5, f"exit {proc.returncode} after {took:.1f} s\n{out}\n{err}"
    assert "torchring-run: here: rank 0 failed first (exit code 5) and every rank here has exited, " \
           "but torch's agent had not returned 3 s later" in err, err
    assert sorted(p.name for p in tmp_path.glob("pid*")) == ["pid0", "pid1"]  # both ranks ran
    assert took >= grace, took
