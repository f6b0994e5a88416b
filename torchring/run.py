"""torchring-run: start N ranks of a training script on this host.

    torchring-run -np 4 train.py --epochs 3
    python -m torchring.run -np 2 --max-restarts 3 train.py --resume
    torchring-run --check-build

It is torch's own elastic launcher (torch.distributed.run, the engine behind torchrun) with
the horovodrun conveniences on top: the engine is built once before any rank starts, every
output line carries its rank (or only rank 0 prints, with --rank0-only), --check-build says
what the engine was built with, and the exit code is the first failing rank's. When a rank
fails or is killed, torch's agent stops all the others; with --max-restarts K the whole job
restarts (torchring re-initializes under a new restart count) up to K times. Ctrl-C stops
everything. For several hosts, run torchrun with its c10d rendezvous on each host (README).
"""

from __future__ import annotations

import argparse
import signal
import sys
import uuid
from typing import Any

import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from . import _build, build

__all__ = ["main", "torchrun_args"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchring-run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-np", "--num-proc", type=int, default=None, help="ranks to start on this host")
    p.add_argument("--max-restarts", type=int, default=0, help="restart the job this many times on failure")
    p.add_argument("--rank0-only", action="store_true", help="show only rank 0's output")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with the rank")
    p.add_argument("--check-build", action="store_true", help="build the engine, say what it has, exit")
    p.add_argument("--monitor-interval", type=float, default=0.1, help="seconds between health checks of ranks")
    p.add_argument("script", nargs="?", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments of the script")
    return p


def torchrun_args(args: argparse.Namespace) -> list[str]:
    """The torch.distributed.run command line that carries out `args`."""
    out = ["--standalone", f"--nproc-per-node={args.num_proc}", f"--max-restarts={args.max_restarts}",
           f"--monitor-interval={args.monitor_interval}", f"--rdzv-id={uuid.uuid4().hex[:12]}"]
    if not args.no_prefix:
        out.append("--tee=3")  # torch prefixes each line with [default<local rank>]:
    if args.rank0_only:
        out.append("--local-ranks-filter=0")
    return out + [args.script, *args.script_args]


def _first_failure(error: BaseException) -> tuple[int, Any] | None:
    """(rank, failure) of the rank that failed on its own first. Ranks that torch's agent
    stopped with SIGTERM after the failure come last; timestamps only have 1 s resolution."""
    failures = getattr(error, "failures", None) or {}
    if not failures:
        return None
    stopped = -signal.SIGTERM
    return min(failures.items(), key=lambda kv: (getattr(kv[1], "exitcode", 1) == stopped,
                                                 getattr(kv[1], "timestamp", 0), kv[0]))


def _exit_code(error: BaseException) -> int:
    """The first failing rank's exit status, shell style (128+N for a signal N)."""
    first = _first_failure(error)
    code = int(getattr(first[1], "exitcode", 1) or 1) if first else 1
    return 128 - code if code < 0 else code


def _describe_failure(error: BaseException) -> str:
    first = _first_failure(error)
    if first is None:
        return "a rank failed"
    rank, failure = first
    code = getattr(failure, "exitcode", "?")
    how = f"killed by signal {-code}" if isinstance(code, int) and code < 0 else f"exit code {code}"
    return f"rank {rank} failed first ({how})"


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    args = _parser().parse_args(argv)
    if args.check_build:
        return build.main([])
    if not args.script or not args.num_proc:
        _parser().error("give -np N and a script, e.g. torchring-run -np 2 train.py")
    if args.num_proc < 1:
        _parser().error(f"-np must be at least 1, got {args.num_proc}")
    _build.load()  # build once here, not in N ranks at once
    launch = torchrun.get_args_parser().parse_args(torchrun_args(args))
    try:
        torchrun.run(launch)
    except ChildFailedError as error:
        code = _exit_code(error)
        print(f"torchring-run: the job failed: {_describe_failure(error)}; its "
              "output is above" + ("" if not args.rank0_only else " if it was rank 0 (--rank0-only)"),
              file=sys.stderr)
        return code
    except SignalException as stop:  # torch's agent turns SIGINT/SIGTERM into this
        print(f"torchring-run: stopped by signal {stop.sigval}; every rank was stopped", file=sys.stderr)
        return 128 + int(stop.sigval)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    return 0


if __name__ == "__main__":
    sys.exit(main())
