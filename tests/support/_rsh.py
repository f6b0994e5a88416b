"""An "rsh agent" into the test hosts (tests/support/_hosts.py) for launchers that start their remote
daemons over ssh, such as Open MPI's mpirun (--mca plm_rsh_agent AGENT).

A launcher running inside test host 0 cannot enter another host itself (host 1's processes
are invisible from host 0's PID namespace), so the agent asks the test for it: it sends
(host name, command) over a unix socket in the directory every host shares, and a thread of
the test runs the command in that host (`Host.nsenter_prefix()`, through `sh -c`, as sshd
would) with its output sent back over the socket; the agent copies it to its own stdout and
exits when the command ends.

    with rsh_agent(hs) as agent:
        hs[0].run([mpirun, "--mca", "plm_rsh_agent", agent, "--host", "trh0,trh1", ...])
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import subprocess
import sys
import threading
from typing import Iterator

__all__ = ["rsh_agent"]

# The agent, run by the launcher as: AGENT [ssh-style options] HOST COMMAND...
_AGENT = r'''#!{python}
import json, os, socket, sys
args = sys.argv[1:]
while args and args[0].startswith("-"):  # ssh-style options some launchers add: ignored
    args = args[1:]
host, command = args[0], " ".join(args[1:])
s = socket.socket(socket.AF_UNIX)
s.connect({sock!r})
s.sendall(json.dumps({{"host": host, "command": command}}).encode() + b"\n")
while True:
    data = s.recv(65536)
    if not data:
        break
    os.write(1, data)
'''


def _serve(server: socket.socket, prefixes: dict[str, list[str]], env: dict[str, str],
           children: list[subprocess.Popen]) -> None:
    """Accepts agents until the server socket is closed; runs each one's command in its host."""
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        with conn:
            line = conn.makefile("rb").readline()
            try:
                request = json.loads(line)
                prefix = prefixes[request["host"]]
            except (ValueError, KeyError) as error:
                conn.sendall(f"rsh agent: bad request {line!r}: {error}\n".encode())
                continue
            children.append(subprocess.Popen(prefix + ["sh", "-c", request["command"]], env=env,
                                             stdin=subprocess.DEVNULL, stdout=conn.fileno(),
                                             stderr=conn.fileno()))


@contextlib.contextmanager
def rsh_agent(hs: list, env: dict[str, str] | None = None) -> Iterator[str]:
    """Yields the path of an agent that runs `AGENT HOST COMMAND` in test host HOST (its name
    or address); the commands it started are killed when the block is left."""
    shared = hs[0].shared
    sock_path, agent = os.path.join(shared, "rsh.sock"), os.path.join(shared, "rsh-agent")
    with open(agent, "w") as f:
        f.write(_AGENT.format(python=sys.executable, sock=sock_path))
    os.chmod(agent, os.stat(agent).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    prefixes = {key: h.nsenter_prefix() for h in hs for key in (h.name, h.addr)}
    server = socket.socket(socket.AF_UNIX)
    server.bind(sock_path)
    server.listen(16)
    children: list[subprocess.Popen] = []
    thread = threading.Thread(target=_serve, args=(server, prefixes, dict(env or os.environ), children),
                              daemon=True)
    thread.start()
    try:
        yield agent
    finally:
        server.shutdown(socket.SHUT_RDWR)
        server.close()
        thread.join(timeout=10)
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                child.kill()
            child.wait()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(sock_path)
