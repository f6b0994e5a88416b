"""How a launch ends: the first failing rank, the exit code it gives the job, and what is said.

torch's elastic agent reports a failed job as a ChildFailedError holding one failure per rank;
the rank that failed on its own comes first (``first_failure``), and its exit status, shell
style, is the job's (``exit_code``: 128+N for a signal N). ``run_agent`` runs the agent and
turns each way it can end into that code: torchring-run on one host (cli.py) and each host's
node of a -H job (node.py) end the same way.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any, Callable

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from . import output as _output

__all__ = ["first_failure", "exit_code", "shell_code", "describe_failure", "how_it_ended", "run_agent"]


def first_failure(error: BaseException) -> tuple[int, Any] | None:
    """(rank, failure) of the rank that failed on its own first. Ranks that torch's agent
    stopped with SIGTERM after the failure come last; timestamps only have 1 s resolution."""
    failures = getattr(error, "failures", None) or {}
    if not failures:
        return None
    stopped = -signal.SIGTERM
    return min(failures.items(), key=lambda kv: (getattr(kv[1], "exitcode", 1) == stopped,
                                                 getattr(kv[1], "timestamp", 0), kv[0]))


def shell_code(code: int) -> int:
    """A process's exit status as a shell reports it: 128+N for a signal N (a negative code)."""
    return 128 - code if code < 0 else code


def exit_code(error: BaseException) -> int:
    """The first failing rank's exit status, shell style (128+N for a signal N)."""
    first = first_failure(error)
    return shell_code(int(getattr(first[1], "exitcode", 1) or 1) if first else 1)


def how_it_ended(code: Any) -> str:
    """'killed by signal N' for a negative exit code, else 'exit code N'."""
    return f"killed by signal {-code}" if isinstance(code, int) and code < 0 else f"exit code {code}"


def describe_failure(error: BaseException) -> str:
    """'rank R failed first (exit code N)', or 'a rank failed' when torch names none."""
    first = first_failure(error)
    if first is None:
        return "a rank failed"
    rank, failure = first
    return f"rank {rank} failed first ({how_it_ended(getattr(failure, 'exitcode', '?'))})"


def run_agent(config: argparse.Namespace, output: _output.RankOutput | None,
              failed: Callable[[str], str], stopped: Callable[[int], str] | None = None) -> int:
    """Runs torch's agent on `config` and returns the job's exit code: 0; the first failing
    rank's, after printing failed(describe_failure(...)); or 128+N when a signal N stopped it
    (printing stopped(N) when given)."""
    try:
        _output.launch(config, output)
    except ChildFailedError as error:
        print(failed(describe_failure(error)), file=sys.stderr)
        return exit_code(error)
    except SignalException as stop:  # torch's agent turns SIGINT/SIGTERM into this
        if stopped is not None:
            print(stopped(int(stop.sigval)), file=sys.stderr)
        return 128 + int(stop.sigval)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    return 0
