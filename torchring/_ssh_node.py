"""One host's part of a `torchring-run -H` job, started by torchring/_ssh_launch.py (directly
or over ssh): torch's elastic agent with the static rendezvous (node rank = the host's place in
-H), lines prefixed [host:global rank]: (torchring/_output.py), stopped when its stdin (the
launcher's pipe) closes, exit code the first failing rank's (torchring.run's rule), not the 1
of torchrun."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Mapping, Sequence

import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from . import _build, _output, _threads, run
from ._settings import Settings

__all__ = ["node_main"]


def _parser() -> argparse.ArgumentParser:
    """The node's command line (node_argv in _ssh_launch writes it)."""
    p = argparse.ArgumentParser(prog="python -m torchring._ssh_node",
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
    p.add_argument("command", nargs=argparse.REMAINDER)
    return p


def _watch_lifeline() -> None:
    """Moves stdin aside (ranks get /dev/null); SIGTERM to this process when it closes."""
    lifeline = os.dup(0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)

    def watch() -> None:
        while True:
            try:
                if not os.read(lifeline, 4096):
                    break
            except OSError:
                break
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True, name="torchring-lifeline").start()


def _start_timeout(env: Mapping[str, str]) -> int:
    """Seconds the hosts' agents wait for each other: TORCHRING_TIMEOUT (--start-timeout), at
    least 120 (hosts start torch at different speeds), instead of the static rendezvous's 600."""
    return max(120, int(Settings.from_env(env).timeout))


def node_main(argv: Sequence[str] | None = None) -> int:
    """One host's part: torch's agent with the static rendezvous; the first failing rank's exit code."""
    args = _parser().parse_args(argv)
    _watch_lifeline()
    command = list(args.command[1:] if args.command[:1] == ["--"] else args.command)
    launch_args = [f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}", f"--nproc-per-node={args.nproc}",
                   "--rdzv-backend=static", f"--master-addr={args.master}", f"--master-port={args.port}",
                   f"--rdzv-id={args.job}", "--max-restarts=0", f"--monitor-interval={args.monitor_interval}",
                   f"--rdzv-conf=timeout={_start_timeout(os.environ)}"]
    output = None if args.no_prefix and not args.rank0_only else \
        _output.RankOutput(label=lambda env: f"[{args.host}:{env.get('RANK', '?')}]: ", only_rank0=args.rank0_only)
    threads = _threads.set_rank_threads(os.environ, args.nproc)
    if threads:
        print(threads.replace("torchring-run:", f"torchring-run: {args.host}:", 1), file=sys.stderr)
    _build.load()
    try:
        _output.launch(torchrun.get_args_parser().parse_args(launch_args + command), output)
    except ChildFailedError as error:
        print(f"torchring-run: {args.host}: {run._describe_failure(error)}", file=sys.stderr)
        return run._exit_code(error)
    except SignalException as stop:
        return 128 + int(stop.sigval)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    return 0


if __name__ == "__main__":
    sys.exit(node_main())
