"""torchring-run across hosts: one torch elastic agent per -H host, over ssh.

    torchring-run -H node0:2,node1:2 python train.py --epochs 3

The launcher starts a *node* process on every host: directly on this host, through
`ssh [-p PORT] [-i KEY] HOST 'cd CWD && exec env VAR=... PYTHON -u -m torchring.launch.node ...'`
on the others (TORCHRING_SSH replaces `ssh`, e.g. TORCHRING_SSH='ssh -o StrictHostKeyChecking=no').
Each node runs torch's elastic agent (torch.distributed.run) with the static rendezvous: node i
has --node-rank=i and the store lives on the first host, so host i's ranks come before host
i+1's in the -H/hostfile order (torch's c10d rendezvous would order hosts by its own sort).

Every host's ranks get this launcher's environment, as horovodrun gives it, less a deny-list
(remote_env.py; -x NAME / -x NAME=VALUE and --env-deny PATTERN adjust it): the remote command
line carries only what starting Python needs, the rest goes through the node's standard input,
so no value shows in `ps` on either host. The remote side runs this launcher's interpreter
(sys.executable) in this launcher's working directory.

Cleanup: a node watches its stdin, the launcher's pipe (through ssh for a remote node). When it
closes (the launcher stopped the job, exited, or was killed, or the ssh connection dropped), the
node gives itself SIGTERM and torch's agent stops its ranks. When a node fails, the launcher
closes every other node's stdin; the launcher's exit code is the first failing node's, which is
its first failing rank's exit status (failures.exit_code), not the 1 of torchrun.

A pulled cable closes nothing: the default ssh command sends keepalives (ALIVE_INTERVAL_S apart)
and gives up on a host silent for TORCHRING_TIMEOUT (ssh exits 255). The nodes cut off from the
first host need no launcher: their ranks raise within TORCHRING_TIMEOUT, and the static
rendezvous's agent does not touch the store after a failure (torch 2.13), so it returns.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Callable, Mapping, Sequence

from .._core import env as _env
from . import output as _output, relay as _relay, remote_env as _remote_env
from .._core.settings import Settings

__all__ = ["plan_hosts", "master_address", "node_argv", "remote_command", "ssh_argv", "client_argv", "launch", "launch_args"]

STOP_GRACE_S = 30.0  # after a node's stdin closes: then SIGTERM, and SIGKILL 10 s later
ALIVE_INTERVAL_S = 5  # the default ssh client probes a silent host this often (ServerAliveInterval)


def plan_hosts(hosts: Sequence[tuple[str, int]], num_proc: int) -> list[tuple[str, int]]:
    """[(host, ranks)] filling `hosts`' slots in order until `num_proc` ranks (hosts left empty dropped)."""
    out, left = [], num_proc
    for host, slots in hosts:
        if left <= 0:
            break
        out.append((host, min(slots, left)))
        left -= slots
    if left > 0:
        raise ValueError(f"-np {num_proc} is more than the {num_proc - left} slots of -H/--hostfile")
    return out


def _address_towards(host: str) -> str | None:
    """This host's address on the route to `host` (no packet is sent); None if unknown or loopback."""
    try:
        addr = _env.source_address(host)
    except OSError:
        return None
    return None if addr.startswith("127.") else addr


def master_address(first_host: str, is_this_host: bool, towards: str | None = None) -> str:
    """The address the other hosts reach the first host's store at: its name, or when it is this
    host, this host's address on the route to `towards` (another host of the job): a name of this
    host may resolve to a loopback address here (Debian maps the hostname to 127.0.1.1)."""
    if not is_this_host:
        return first_host
    routed = _address_towards(towards) if towards else None
    if routed:
        return routed
    loopback = first_host.lower() == "localhost" or first_host.startswith("127.") or first_host == "::1"
    return socket.gethostname() if loopback else first_host


def free_port(local: bool) -> int:
    """A port for the store: a free one of this host's, else a random high one."""
    if not local:
        return random.randrange(20000, 40000)
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def node_argv(*, host: str, node_rank: int, nnodes: int, nproc: int, master: str, port: int,
              job: str, monitor_interval: float, prefix: bool, rank0_only: bool,
              command: Sequence[str], relay: str | None = None, env_stdin: bool = False) -> list[str]:
    """The command line of node `node_rank` (this interpreter, this module) running `command`."""
    out = [sys.executable, "-u", "-m", "torchring.launch.node", f"--host={host}",
           f"--node-rank={node_rank}", f"--nnodes={nnodes}", f"--nproc={nproc}",
           f"--master={master}", f"--port={port}", f"--job={job}",
           f"--monitor-interval={monitor_interval}"]
    out += ["--no-prefix"] if not prefix else []
    out += ["--rank0-only"] if rank0_only else []
    out += [f"--relay={relay}"] if relay else []
    out += ["--env-stdin"] if env_stdin else []
    return out + ["--", *command]


def remote_command(argv: Sequence[str], env: Mapping[str, str], cwd: str) -> str:
    """One sh command line: cd to `cwd`, then `argv` with `env` set, every word quoted."""
    assigns = [shlex.quote(f"{name}={value}") for name, value in env.items()]
    return (f"cd {shlex.quote(cwd)} && exec env " + " ".join(assigns) + " "
            + " ".join(shlex.quote(word) for word in argv))


def ssh_argv(host: str, command: str, *, port: int | None = None, identity: str | None = None,
             ssh: str | None = None, alive_s: float | None = None) -> list[str]:
    """The ssh client command running `command` on `host` (TORCHRING_SSH's words replace `ssh`);
    with `alive_s`, the default client gives up on a host silent that long (at least 15 s)."""
    base = shlex.split(ssh) if ssh else ["ssh", "-T", "-o", "BatchMode=yes"]
    if alive_s is not None and not ssh:
        base += ["-o", f"ServerAliveInterval={ALIVE_INTERVAL_S}",
                 "-o", f"ServerAliveCountMax={max(3, math.ceil(alive_s / ALIVE_INTERVAL_S))}"]
    base += ["-p", str(port)] if port is not None else []
    base += ["-i", identity] if identity else []
    return base + [host, command]


@dataclass
class _Node:
    host: str
    proc: subprocess.Popen
    threads: list[threading.Thread] = field(default_factory=list)
    stopped_at: float | None = None


_write_lock = threading.Lock()


def _pump(source: IO[bytes], sink: IO[bytes], relayed: _relay.Receiver | None = None) -> None:
    """Copies `source` to `sink` in whole lines (ended by \\n or \\r), so hosts never split a line;
    once `sink` is gone (a reader such as `| head` quit) it keeps draining `source`, dropping the
    rest, so that no node and no rank blocks on a full pipe. `relayed` takes out the files a
    remote node sends (relay.py) and writes them."""
    pending, console = b"", _output.Console(sink)

    def write(data: bytes) -> None:
        with _write_lock:
            console.write(data)
            console.flush()

    while chunk := source.read1(65536):  # type: ignore[attr-defined]
        if console.broken:
            continue
        text, pending = _output.whole_lines(pending + chunk)
        if text and relayed is not None:
            text = relayed.take(text)
        if text:  # all of it may have been relayed files
            write(text)
    if pending:
        write(pending)


def _start(host: str, argv: list[str], relayed: _relay.Receiver | None = None,
           env: Mapping[str, str] | None = None) -> _Node:
    """Starts one node's command with its stdin a pipe (the node's lifeline; `env` is written to
    it first) and its output pumped (`relayed`: the files it sends on its stdout are written)."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    node = _Node(host, proc)
    if env is not None:
        try:
            _remote_env.send(proc.stdin, env)  # type: ignore[arg-type]
        except OSError:
            pass  # the node is already gone: its exit code says why
    for source, sink, files in ((proc.stdout, sys.stdout.buffer, relayed), (proc.stderr, sys.stderr.buffer, None)):
        thread = threading.Thread(target=_pump, args=(source, sink, files), daemon=True)
        thread.start()
        node.threads.append(thread)
    return node


def _stop(nodes: list[_Node]) -> None:
    """Closes the lifeline of every running node; SIGTERM/SIGKILL those that outlive the grace."""
    now = time.monotonic()
    for node in nodes:
        if node.stopped_at is None and node.proc.poll() is None:
            node.stopped_at = now
            try:
                node.proc.stdin.close()  # type: ignore[union-attr]
            except OSError:
                pass
        elif node.stopped_at is not None and node.proc.poll() is None:
            waited = now - node.stopped_at
            if waited > STOP_GRACE_S:
                node.proc.send_signal(signal.SIGKILL if waited > STOP_GRACE_S + 10 else signal.SIGTERM)


def client_argv(host: str, command: str, *, port: int | None = None, identity: str | None = None) -> list[str]:
    """ssh_argv() as this launcher's environment asks: TORCHRING_SSH's command, and keepalives
    that give up on a host silent as long as the ranks would wait (TORCHRING_TIMEOUT)."""
    ssh = Settings.from_env({"TORCHRING_SSH": os.environ.get("TORCHRING_SSH", "")}).ssh
    return ssh_argv(host, command, port=port, identity=identity, ssh=ssh, alive_s=_timeout_s(os.environ))


def _timeout_s(environ: Mapping[str, str]) -> float:
    """TORCHRING_TIMEOUT in seconds as the ranks read it (its default when malformed: the ranks
    then say what is wrong with it)."""
    try:
        return Settings.from_env({"TORCHRING_TIMEOUT": environ.get("TORCHRING_TIMEOUT", "")}).timeout
    except ValueError:
        return Settings().timeout


def _ssh_hint(host: str, code: int) -> str:
    """What to check when ssh to `host` failed with `code` (255: ssh's own error)."""
    return (f"torchring-run: ssh to {host} failed (exit code {code}, its message is above): if it never "
            f"connected, check that `ssh {host} true` works without a password prompt (keys; --ssh-port, "
            "--ssh-identity-file or TORCHRING_SSH for the options); if it did, the host or its network "
            "stopped answering")


def launch(hosts: Sequence[tuple[str, int]], is_this_host: Callable[[str], bool], command: Sequence[str],
           *, monitor_interval: float = 0.1, prefix: bool = True, rank0_only: bool = False,
           ssh_port: int | None = None, ssh_identity: str | None = None, verbose: bool = False,
           trace_dir: str | None = None, env: Mapping[str, str] | None = None) -> int:
    """Runs `command` (torchrun's script tail) on `hosts` [(host, ranks)]; the first failure's exit
    code. `trace_dir`: where the other hosts' status files and dumps are relayed to; `env`: what
    the other hosts' ranks get (default: remote_env of this environment)."""
    local = [is_this_host(h) for h, _ in hosts]
    remote = next((h for (h, _), here in zip(hosts, local) if not here), None)
    master, port = master_address(hosts[0][0], local[0], remote), free_port(local[0])
    job, cwd = f"{os.getpid():x}{random.getrandbits(32):08x}", os.getcwd()
    env = dict(env) if env is not None else _remote_env.remote_env(os.environ)
    nodes: list[_Node] = []
    stop_signal: list[int] = []
    previous = {s: signal.signal(s, lambda sig, _f: stop_signal.append(sig))
                for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        for rank, ((host, nproc), here) in enumerate(zip(hosts, local)):
            relay = None if here or not trace_dir else trace_dir
            argv = node_argv(host=host, node_rank=rank, nnodes=len(hosts), nproc=nproc, master=master,
                             port=port, job=job, monitor_interval=monitor_interval, prefix=prefix,
                             rank0_only=rank0_only, command=command, relay=relay, env_stdin=not here)
            if not here:
                command_line = remote_command(argv, _remote_env.bootstrap_env(env), cwd)
                argv = client_argv(host, command_line, port=ssh_port, identity=ssh_identity)
            if verbose:
                print(f"torchring-run: {host}: {shlex.join(argv)}", file=sys.stderr)
            nodes.append(_start(host, argv, _relay.Receiver(trace_dir) if relay else None, None if here else env))
        return _supervise(nodes, local, stop_signal)
    finally:
        _stop(nodes)  # leave nothing behind, whatever happened above (normally all have exited)
        for node in nodes:
            try:
                node.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait()
        for node in nodes:
            for thread in node.threads:
                thread.join(timeout=5)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _supervise(nodes: list[_Node], local: list[bool], stop_signal: list[int]) -> int:
    """Waits for every node; on the first failure or a signal, stops the others. The exit code."""
    first: tuple[_Node, int, bool] | None = None  # the node, its exit code, whether it is this host's
    while True:
        running = False
        for node, here in zip(nodes, local):
            code = node.proc.poll()
            running |= code is None
            if code not in (None, 0) and first is None and node.stopped_at is None and not stop_signal:
                first = (node, code, here)
                if code == 255 and not here:
                    print(_ssh_hint(node.host, code), file=sys.stderr)
        if first is not None or stop_signal:
            _stop(nodes)
        if not running:
            break
        time.sleep(0.05)
    lost = [node.host for node, here in zip(nodes, local)
            if not here and node.proc.returncode == 255 and (first is None or node is not first[0])]
    stopped = "every host's ranks were stopped"
    if lost:  # ssh's own error after the job ran: the connection died (keepalives unanswered)
        print(f"torchring-run: the ssh connection to {', '.join(lost)} was lost (exit code 255): "
              "the host or its network stopped answering, so its ranks could not be stopped from here "
              "(they stop on their own once they lose a peer, within TORCHRING_TIMEOUT)", file=sys.stderr)
        stopped = "every other host's ranks were stopped"
    if stop_signal:
        print(f"torchring-run: stopped by signal {stop_signal[0]}; {stopped}", file=sys.stderr)
        return 128 + stop_signal[0]
    if first is not None:
        node, code, here = first
        what = f"the ssh connection to {node.host} failed first" if code == 255 and not here else \
            f"{node.host}'s ranks failed first"
        print(f"torchring-run: the job failed: {what} (exit code {code}); {stopped}; the output is above",
              file=sys.stderr)
        return code
    return 0


def launch_args(args: argparse.Namespace, is_this_host: Callable[[str], bool], command: Sequence[str]) -> int:
    """launch() for torchring-run's parsed `args` (args.remote_hosts: its -H/--hostfile hosts)."""
    return launch(plan_hosts(args.remote_hosts, args.num_proc), is_this_host, command,
                  monitor_interval=args.monitor_interval, prefix=not args.no_prefix, rank0_only=args.rank0_only,
                  ssh_port=args.ssh_port, ssh_identity=args.ssh_identity_file, verbose=args.verbose,
                  trace_dir=os.environ.get("TORCHRING_TRACE_DIR"),
                  env=_remote_env.remote_env(os.environ, args.env_deny or (), *_remote_env.parse_settings(args.env or ())))
