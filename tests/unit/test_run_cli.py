"""torchring-run's pure parts: the torchrun command line it builds, and the exit code and
message it derives from torch's ChildFailedError (which rank failed first), without a process."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest
import torch.distributed.run as torchrun

from torchring import run


def _args(**overrides: object) -> SimpleNamespace:
    base = dict(num_proc=4, max_restarts=0, monitor_interval=0.1, no_prefix=False, rank0_only=False,
                script="train.py", script_args=["--epochs", "3"])
    return SimpleNamespace(**(base | overrides))


def test_torchrun_accepts_the_command_line() -> None:
    parsed = torchrun.get_args_parser().parse_args(run.torchrun_args(_args(max_restarts=2)))
    assert (parsed.nproc_per_node, parsed.max_restarts, parsed.standalone) == ("4", 2, True)
    assert (parsed.training_script, parsed.training_script_args) == ("train.py", ["--epochs", "3"])
    assert parsed.tee == "3" and not parsed.local_ranks_filter


def test_rank0_only_and_no_prefix() -> None:
    parsed = torchrun.get_args_parser().parse_args(run.torchrun_args(_args(rank0_only=True, no_prefix=True)))
    assert parsed.local_ranks_filter == "0" and parsed.tee == "0"  # "0": no prefixes


def test_each_job_gets_its_own_rendezvous_id() -> None:
    ids = {next(a for a in run.torchrun_args(_args()) if a.startswith("--rdzv-id=")) for _ in range(3)}
    assert len(ids) == 3


def _failed(**failures: tuple[int, float]) -> SimpleNamespace:
    """A ChildFailedError stand-in: rank -> (exitcode, timestamp)."""
    return SimpleNamespace(failures={int(r[1:]): SimpleNamespace(exitcode=code, timestamp=ts)
                                     for r, (code, ts) in failures.items()})


SIGTERM, SIGKILL = -int(signal.SIGTERM), -int(signal.SIGKILL)


@pytest.mark.parametrize("error,code,message", [
    (_failed(r1=(7, 100)), 7, "rank 1 failed first (exit code 7)"),
    (_failed(r2=(SIGKILL, 100)), 128 + 9, "rank 2 failed first (killed by signal 9)"),
    # The agent stops the others with SIGTERM, often within the same second: they come last.
    (_failed(r0=(SIGTERM, 100), r1=(3, 100), r2=(SIGTERM, 100)), 3, "rank 1 failed first (exit code 3)"),
    (_failed(r0=(SIGTERM, 99), r1=(3, 100)), 3, "rank 1 failed first"),
    # Two real failures: the earlier one, then the lower rank.
    (_failed(r0=(4, 101), r3=(5, 100)), 5, "rank 3 failed first"),
    (_failed(r2=(4, 100), r1=(5, 100)), 5, "rank 1 failed first"),
    # Only SIGTERMs (the job itself was terminated).
    (_failed(r0=(SIGTERM, 100), r1=(SIGTERM, 100)), 128 + 15, "rank 0 failed first (killed by signal 15)"),
    # No usable status: still a failure.
    (_failed(r0=(0, 100)), 1, "rank 0 failed first (exit code 0)"),
    (SimpleNamespace(failures={}), 1, "a rank failed"),
    (RuntimeError("no failures attribute"), 1, "a rank failed"),
])
def test_exit_code_and_message_name_the_first_failing_rank(error: object, code: int, message: str) -> None:
    assert run._exit_code(error) == code
    assert run._describe_failure(error).startswith(message)


@pytest.mark.parametrize("argv", [[], ["train.py"], ["-np", "0", "train.py"], ["-np", "2"]])
def test_usage_errors_exit_2_before_anything_starts(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        run.main(argv)
    assert caught.value.code == 2
