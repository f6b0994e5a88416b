"""torchring-run's pure parts: the torchrun command line it builds, the exit code and
message it derives from torch's ChildFailedError (which rank failed first; launch/failures.py,
shared with each host's node of a -H job), and horovodrun's flags (hosts and slots, the
variables the ranks get, a leading python), without a process."""

from __future__ import annotations

import argparse
import signal
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from torchring.launch import cli as run, failures, output as _output


def _args(**overrides: object) -> SimpleNamespace:
    base = dict(num_proc=4, max_restarts=0, monitor_interval=0.1, no_prefix=False, rank0_only=False,
                script="train.py", script_args=["--epochs", "3"])
    return SimpleNamespace(**(base | overrides))


def test_torchrun_accepts_the_command_line() -> None:
    parsed = torchrun.get_args_parser().parse_args(run.torchrun_args(_args(max_restarts=2)))
    assert (parsed.nproc_per_node, parsed.max_restarts, parsed.standalone) == ("4", 2, True)
    assert (parsed.training_script, parsed.training_script_args) == ("train.py", ["--epochs", "3"])
    # torchring-run shows the ranks' output itself (torchring.launch.output), not torch's tee
    assert parsed.tee == "0" and parsed.redirects == "0" and not parsed.local_ranks_filter


@pytest.mark.parametrize("rank0_only,no_prefix,shown", [(False, False, "prefixed"), (True, False, "rank 0"),
                                                        (True, True, "rank 0"), (False, True, None)])
def test_rank0_only_and_no_prefix(rank0_only: bool, no_prefix: bool, shown: str | None) -> None:
    output = _output.rank_output(_args(rank0_only=rank0_only, no_prefix=no_prefix))
    try:
        got = None if output is None else "rank 0" if output._only_rank0 else "prefixed"
        assert got == shown
    finally:
        if output is not None:
            output.close()


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
    assert failures.exit_code(error) == code
    assert failures.describe_failure(error).startswith(message)


def _child_failed(**ranks: tuple[int, float]) -> ChildFailedError:
    """A real ChildFailedError around _failed's stand-in failures (its message is not built)."""
    error = ChildFailedError.__new__(ChildFailedError)
    error.name, error.failures = "train.py", _failed(**ranks).failures
    return error


@pytest.mark.parametrize("raised,code,said", [
    (None, 0, ""),
    (_child_failed(r0=(SIGTERM, 100), r1=(3, 100)), 3, "failed: rank 1 failed first (exit code 3)\n"),
    (_child_failed(r2=(SIGKILL, 100)), 128 + 9, "failed: rank 2 failed first (killed by signal 9)\n"),
    (SignalException("stop", signal.SIGTERM), 128 + 15, "stopped: 15\n"),
    (KeyboardInterrupt(), 128 + 2, ""),
])
def test_how_the_agent_ends_becomes_the_exit_code(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                                                  raised: BaseException | None, code: int, said: str) -> None:
    def launch(config: object, output: object) -> None:
        assert config == "config" and output is None
        if raised is not None:
            raise raised

    monkeypatch.setattr(_output, "launch", launch)
    got = failures.run_agent("config", None, failed=lambda what: f"failed: {what}",  # type: ignore[arg-type]
                             stopped=lambda sig: f"stopped: {sig}")
    assert got == code and capsys.readouterr().err == said


@pytest.mark.parametrize("argv", [[], ["train.py"], ["-np", "0", "train.py"], ["-np", "2"]])
def test_usage_errors_exit_2_before_anything_starts(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        run.main(argv)
    assert caught.value.code == 2


# horovodrun's flags ---------------------------------------------------------------------------

def _parsed(argv: list[str]) -> object:
    parser = run._parser()
    args = parser.parse_args(argv)
    run._resolve(parser, args)
    return args


@pytest.mark.parametrize("spec,hosts", [
    ("localhost:4", [("localhost", 4)]),
    ("localhost:2, 127.0.0.1:3", [("localhost", 2), ("127.0.0.1", 3)]),
    ("server1", [("server1", 1)]),
    ("[::1]:2,::1", [("::1", 2), ("::1", 1)]),
])
def test_hosts_parse_as_horovodrun_writes_them(spec: str, hosts: list[tuple[str, int]]) -> None:
    assert run.parse_hosts(spec) == hosts


@pytest.mark.parametrize("spec", ["localhost:0", "localhost:four", ":2", ",", "[::1]:x"])
def test_bad_hosts_say_what_is_expected(spec: str) -> None:
    with pytest.raises(ValueError, match="host:slots"):
        run.parse_hosts(spec)


def test_this_host_under_any_of_its_names_counts_its_slots() -> None:
    hostname = socket.gethostname()
    hosts = [("localhost", 1), ("127.0.0.1", 2), (hostname, 3), ("::1", 4)]
    assert run.local_slots(hosts) == 10


def test_local_slots_names_the_other_hosts_and_the_launch_that_takes_them() -> None:
    with pytest.raises(ValueError) as caught:
        run.local_slots([("localhost", 2), ("gpu-node-17.example", 4)])
    text = str(caught.value)
    assert "gpu-node-17.example" in text and "torchring-run -H" in text


def test_np_defaults_to_the_slots_and_may_use_fewer(tmp_path: Path) -> None:
    assert _parsed(["-H", "localhost:3", "train.py"]).num_proc == 3
    assert _parsed(["-np", "2", "-H", "localhost:3", "train.py"]).num_proc == 2
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# this machine\nlocalhost slots=2\n\n127.0.0.1 slots=2  # again\n")
    assert _parsed(["--hostfile", str(hostfile), "python", "train.py"]).num_proc == 4
    assert _parsed(["-hostfile", str(hostfile), "train.py"]).num_proc == 4


@pytest.mark.parametrize("argv,message", [
    (["-np", "5", "-H", "localhost:4", "train.py"], "-np 5 is more than the 4 slots"),
    (["-np", "2", "python"], "give the script after python"),
    (["-np", "2", "--fusion-threshold-mb", "-1", "train.py"], "expected a number >= 0"),
    (["-np", "2", "--start-timeout", "0", "train.py"], "--start-timeout"),
    (["-np", "2", "--start-timeout", "9999999", "train.py"], "TORCHRING_TIMEOUT='9999999'"),
    (["-np", "2", "--log-level", "loud", "train.py"], "--log-level"),
    (["-H", "localhost:0", "train.py"], "not host:slots"),
])
def test_bad_horovodrun_flags_exit_2_naming_the_problem(argv: list[str], message: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        _parsed(argv)
    assert caught.value.code == 2
    assert message in capsys.readouterr().err


def test_a_hostfile_line_that_is_not_host_slots_is_named(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\nlocalhost 4\n")
    with pytest.raises(SystemExit):
        _parsed(["--hostfile", str(hostfile), "train.py"])
    assert "line 2: 'localhost 4' is not 'host slots=N'" in capsys.readouterr().err


def test_flags_become_the_variables_horovodrun_sets() -> None:
    args = _parsed(["-np", "2", "--fusion-threshold-mb", "32", "--cycle-time-ms", "2.5",
                    "--cache-capacity", "0", "--timeline-filename", "t.json", "--timeline-mark-cycles",
                    "--no-stall-check", "--stall-check-warning-time-seconds", "20",
                    "--stall-check-shutdown-time-seconds", "90.5", "--start-timeout", "45", "train.py"])
    assert run.rank_env(args) == {
        "HOROVOD_FUSION_THRESHOLD": str(32 * 1024 * 1024), "HOROVOD_CYCLE_TIME": "2.5",
        "HOROVOD_CACHE_CAPACITY": "0", "HOROVOD_TIMELINE": "t.json", "HOROVOD_TIMELINE_MARK_CYCLES": "1",
        "HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_STALL_CHECK_TIME_SECONDS": "20",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "90.5", "TORCHRING_TIMEOUT": "45"}
    assert run.rank_env(_parsed(["-np", "2", "train.py"])) == {}
    assert run.rank_env(_parsed(["-np", "2", "--fusion-threshold-mb", "0.5", "t.py"])) == {
        "HOROVOD_FUSION_THRESHOLD": str(512 * 1024)}


def test_verbose_asks_for_debug_logs_unless_a_level_is_given() -> None:
    assert run.rank_env(_parsed(["-np", "2", "--verbose", "t.py"])) == {"HOROVOD_LOG_LEVEL": "debug"}
    assert run.rank_env(_parsed(["-np", "2", "--verbose", "--log-level", "WARNING", "t.py"])) == {
        "HOROVOD_LOG_LEVEL": "warning"}


def test_gloo_mpi_and_interfaces_are_accepted_with_a_note(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parsed(["-np", "2", "--gloo", "--network-interfaces", "eth0,eth1", "python", "t.py"])
    err = capsys.readouterr().err
    assert "--gloo ignored" in err and "--network-interfaces eth0,eth1 has no effect" in err
    assert run.rank_env(args) == {}
    _parsed(["-np", "2", "--mpi", "t.py"])
    assert "--mpi ignored" in capsys.readouterr().err


def _launched(argv: list[str]) -> argparse.Namespace:
    """What torch.distributed.run makes of torchring-run's command line."""
    return torchrun.get_args_parser().parse_args(run.torchrun_args(_parsed(["-np", "2", *argv])))


def test_a_leading_python_runs_the_script_with_this_interpreter() -> None:
    for python in ("python", "python3", "python3.12", sys.executable):
        parsed = _launched([python, "train.py", "--epochs", "3"])
        assert (parsed.training_script, parsed.training_script_args) == ("train.py", ["--epochs", "3"])
        assert not parsed.no_python and not parsed.module
    parsed = _launched(["python", "-u", "train.py"])  # torchrun runs python -u anyway
    assert (parsed.training_script, parsed.no_python) == ("train.py", False)


def test_python_m_runs_a_module() -> None:
    parsed = _launched(["python", "-m", "pkg.train", "--lr", "0.1"])
    assert parsed.module and (parsed.training_script, parsed.training_script_args) == ("pkg.train", ["--lr", "0.1"])


def test_other_interpreters_flags_and_programs_run_as_given(tmp_path: Path) -> None:
    parsed = _launched(["python", "-O", "train.py"])
    assert parsed.no_python and [parsed.training_script, *parsed.training_script_args] == ["python", "-O", "train.py"]
    other = str(tmp_path / "python3.8")  # an interpreter named by path, not this one
    parsed = _launched([other, "train.py"])
    assert parsed.no_python and parsed.training_script == other
    parsed = _launched(["bash", "-c", "echo $RANK"])
    assert parsed.no_python and [parsed.training_script, *parsed.training_script_args] == ["bash", "-c", "echo $RANK"]


def test_existing_files_run_with_python_unless_they_are_other_executables(tmp_path: Path) -> None:
    shell, py, plain = tmp_path / "run.sh", tmp_path / "tool", tmp_path / "train.py"
    shell.write_text("#!/bin/sh\necho hi\n")
    py.write_text("#!/usr/bin/env python3\nprint('hi')\n")
    plain.write_text("print('hi')\n")
    for path in (shell, py, plain):
        path.chmod(0o755)
    assert _launched([str(shell), "x"]).no_python
    assert not _launched([str(py), "x"]).no_python
    assert not _launched([str(plain), "x"]).no_python
