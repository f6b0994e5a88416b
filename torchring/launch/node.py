"""One host's part of a `torchring-run -H` job, started by torchring/launch/ssh.py (directly
or over ssh): torch's elastic agent with the static rendezvous (node rank = the host's place in
-H), lines prefixed [host:global rank]: (torchring/launch/output.py), stopped when its stdin (the
launcher's pipe) closes, exit code the first failing rank's (failures.py, as torchring-run on
one host), not the 1 of torchrun. On another host than the launcher's (--relay), it copies its
ranks' status files and flight-recorder dumps onto its output for the launcher (relay.py).

A safety net: once every local rank has exited and one failed, torch's agent has AGENT_GRACE_S to
return; if it has not (stuck on a store whose host is unreachable, as torchrun's c10d rendezvous
is: the static one returns in torch 2.13), the node kills what is left of its ranks' process
groups and exits with the first failing rank's code itself."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from typing import Any, Mapping, Sequence

import torch.distributed.run as torchrun
from torch.distributed.elastic.agent.server import local_elastic_agent

from .._core import build as _build
from . import failures as _failures, lifeline as _lifeline, output as _output, relay as _relay, \
    remote_env as _remote_env, threads as _threads
from .._core.settings import Settings

__all__ = ["node_main", "AGENT_GRACE_S"]

AGENT_GRACE_S = 15.0  # after every local rank exited, one failed: then the node ends without the agent


def _parser() -> argparse.ArgumentParser:
    """The node's command line (node_argv in _ssh_launch writes it)."""
    p = argparse.ArgumentParser(prog="python -m torchring.launch.node",
                                description="one host's part of a torchring-run -H job (started by it)")
    p.add_argument("--host", required=True)
    p.add_argument("--node-rank", type=int, required=True)
    p.add_argument("--nnodes", type=int, required=True)
    p.add_argument("--nproc", type=int, required=True)
    p.add_argument("--master", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--monitor-interval", type=float, default=0.1)
    p.add_argument("--no-prefix", action="store_true")
    p.add_argument("--rank0-only", action="store_true")
    p.add_argument("--env-stdin", action="store_true",
                   help="first read the launcher's environment from stdin (remote_env.py)")
    p.add_argument("--relay", default=None, metavar="DIR",
                   help="copy the ranks' status files and dumps in DIR onto stdout for the launcher")
    p.add_argument("command", nargs=argparse.REMAINDER)
    return p


def _capture_rank_processes() -> list[Any]:
    """The process contexts torch's local agent starts its ranks with, appended as it starts them."""
    contexts: list[Any] = []
    start = getattr(local_elastic_agent, "start_processes", None)
    if start is None:  # another torch: no safety net, the agent's own exit stands
        return contexts

    def start_and_keep(*args: Any, **kwargs: Any) -> Any:
        context = start(*args, **kwargs)
        contexts.append(context)
        return context

    local_elastic_agent.start_processes = start_and_keep
    return contexts


def _watch_ranks(contexts: list[Any], host: str, grace_s: float) -> None:
    """Exits the node (first failing rank's code) when its ranks are all gone, one failed, and
    torch's agent has not returned `grace_s` later; runs in a daemon thread."""
    failed: dict[int, tuple[float, int]] = {}  # local rank -> (when seen, exit code)
    all_gone: float | None = None  # when every local rank was first seen exited, one failed
    while True:
        time.sleep(0.2)
        context = contexts[-1] if contexts else None
        handlers = dict(getattr(context, "subprocess_handlers", None) or {})
        if not handlers:
            continue
        codes = {local_rank: handler.proc.poll() for local_rank, handler in handlers.items()}
        for local_rank, code in codes.items():
            if code not in (None, 0) and local_rank not in failed:
                failed[local_rank] = (time.monotonic(), code)
        if None in codes.values() or not failed:
            all_gone = None
            continue
        all_gone = all_gone or time.monotonic()
        if time.monotonic() - all_gone < grace_s:
            continue
        first, (_, code) = min(failed.items(), key=lambda item: item[1][0])
        rank = (getattr(context, "envs", None) or {}).get(first, {}).get("RANK", f"local {first}")
        for handler in handlers.values():  # what the ranks left behind (their own process groups)
            try:
                os.killpg(handler.proc.pid, signal.SIGKILL)
            except OSError:
                pass
        print(f"torchring-run: {host}: rank {rank} failed first ({_failures.how_it_ended(code)}) and "
              f"every rank here has exited, but torch's agent had not returned {grace_s:.0f} s later "
              "(likely waiting on the rendezvous store of an unreachable first host): this host's "
              "part ends here", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_failures.shell_code(code))


def _start_timeout(env: Mapping[str, str]) -> int:
    """Seconds the hosts' agents wait for each other: TORCHRING_TIMEOUT (--start-timeout), at
    least 120 (hosts start torch at different speeds), instead of the static rendezvous's 600."""
    return max(120, int(Settings.from_env(env).timeout))


def node_main(argv: Sequence[str] | None = None) -> int:
    """One host's part: torch's agent with the static rendezvous; the first failing rank's exit code."""
    args = _parser().parse_args(argv)
    if args.env_stdin:  # before the lifeline takes stdin over
        _remote_env.take()
    _lifeline.watch(lambda: os.kill(os.getpid(), signal.SIGTERM))  # torch's agent then stops the ranks
    command = list(args.command[1:] if args.command[:1] == ["--"] else args.command)
    launch_args = [f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}", f"--nproc-per-node={args.nproc}",
                   "--rdzv-backend=static", f"--master-addr={args.master}", f"--master-port={args.port}",
                   f"--rdzv-id={args.job}", "--max-restarts=0", f"--monitor-interval={args.monitor_interval}",
                   f"--rdzv-conf=timeout={_start_timeout(os.environ)}"]
    output = _output.rank_output(args, label=lambda env: f"[{args.host}:{env.get('RANK', '?')}]: ")
    threads = _threads.set_rank_threads(os.environ, args.nproc)
    if threads:
        print(threads.replace("torchring-run:", f"torchring-run: {args.host}:", 1), file=sys.stderr)
    _build.load()
    contexts = _capture_rank_processes()
    threading.Thread(target=_watch_ranks, args=(contexts, args.host, AGENT_GRACE_S), daemon=True,
                     name="torchring-rank-watch").start()
    relay = _relay.Sender(args.relay, Settings.from_env(os.environ).status_s).start() if args.relay else None
    try:
        return _failures.run_agent(torchrun.get_args_parser().parse_args(launch_args + command), output,
                                   failed=lambda what: f"torchring-run: {args.host}: {what}")
    finally:
        if relay is not None:  # the ranks are gone: their last statuses and any dumps
            relay.finish()


if __name__ == "__main__":
    sys.exit(node_main())
