"""torchring-run -H's environment contract over OpenSSH between simulated hosts (root only):
a variable set only in the launcher's environment reaches every rank on every host, a
deny-listed one (the default list and --env-deny) no other host's rank, -x NAME=VALUE sets one for every
rank, and no forwarded value appears in any process's command line on any host while the job
runs (the test reads /proc/*/cmdline of every process of the machine, the hosts' included)."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from pathlib import Path

from test_launch_ssh import _SSHD_PORT, _launcher, _ssh_env, ssh_hosts  # noqa: F401

# Each rank writes what it sees into the shared directory, then waits for the test's "go".
_JOB = """
import json, os, socket, sys, time, torchring
torchring.init()
rank, shared = torchring.rank(), sys.argv[1]
names = ("DATA_DIR", "WANDB_API_KEY", "DENY_ME", "OLDPWD", "FROM_FLAG", "BASH_FUNC_hi%%")
seen = {"host": socket.gethostname(), **{n: os.environ.get(n) for n in names}}
with open(os.path.join(shared, f"env{rank}.json"), "w") as f:
    json.dump(seen, f)
while not os.path.exists(os.path.join(shared, "go")):
    time.sleep(0.1)
torchring.barrier()
"""


def _cmdlines() -> str:
    """Every process's command line on the machine (the simulated hosts' processes included)."""
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                out.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").replace(b"\n", b" ")
                           .decode(errors="replace"))
            except OSError:
                pass
    return "\n".join(out)  # one line per process


def test_the_launchers_environment_reaches_every_host_but_not_the_denied_nor_any_command_line(ssh_hosts, tmp_path):
    hs, keys = ssh_hosts
    (tmp_path / "envjob.py").write_text(_JOB)
    secret = f"s3cret-{uuid.uuid4().hex}"
    env = dict(_ssh_env(keys), DATA_DIR="/data/set 1", WANDB_API_KEY=secret, DENY_ME="no", OLDPWD="/nowhere")
    env["BASH_FUNC_hi%%"] = "() {  echo hi\n}"
    argv = _launcher() + ["-H", "trh1:2,trh2:1,trh0:1", "--ssh-port", str(_SSHD_PORT), "--ssh-identity-file",
                          str(keys / "client_key"), "-x", "FROM_FLAG=set by -x", "--env-deny", "DENY_*",
                          "python", "envjob.py", str(tmp_path)]
    proc = hs[0].popen(argv, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and len(list(tmp_path.glob("env*.json"))) < 4:
            assert proc.poll() is None, proc.communicate()[0]
            time.sleep(0.2)
        lines = _cmdlines()
        assert "envjob.py" in lines, "the job's processes should be running now"
        assert secret not in lines and "/data/set 1" not in lines, "a forwarded value is on a command line"
        # -x's value is where the user typed it, on the launcher's command line, and nowhere else
        shown = [line for line in lines.splitlines() if "set by -x" in line]
        assert shown and all("-m torchring.run -H" in line for line in shown), shown
    finally:
        (tmp_path / "go").touch()
        output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    seen = [json.loads((tmp_path / f"env{r}.json").read_text()) for r in range(4)]
    assert [s["host"] for s in seen] == ["trh1", "trh1", "trh2", "trh0"], seen
    for s in seen:
        assert (s["DATA_DIR"], s["WANDB_API_KEY"], s["FROM_FLAG"]) == ("/data/set 1", secret, "set by -x"), s
        if s["host"] != "trh0":  # the launcher's own host runs its ranks in its own environment
            assert s["DENY_ME"] is None and s["BASH_FUNC_hi%%"] is None, s
            assert s["OLDPWD"] != "/nowhere", s  # the remote shell's cd sets its own
