"""Seeded faults under torchring-run, each diagnosed from the ranks' flight-recorder dumps: the
diagnosis names the culprit rank, its host, the operation and the Python line; torch's own
analyzer reads the same dumps and names the same culprit for the mismatches."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchring.trace import diagnose, dump

ROOT = Path(__file__).resolve().parents[3]
JOB = ROOT / "tests" / "support" / "_trace_job.py"
HOST = socket.gethostname()


def line_of(marker: str) -> str:
    """'_trace_job.py:N' of the job's line marked '# line: <marker>'."""
    for n, text in enumerate(JOB.read_text().splitlines(), 1):
        if text.rstrip().endswith(f"# line: {marker}"):
            return f"{JOB.name}:{n}"
    raise AssertionError(f"no line marked {marker!r} in {JOB}")


def run_job(mode: str, tmp_path: Path, world: int = 3, timeout_s: str = "4") -> tuple[int, str, Path]:
    """torchring-run -np `world` of the job in `mode`: (exit code, output, dump directory)."""
    dumps = tmp_path / "dumps"
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCHRING_TIMEOUT=timeout_s, TORCHRING_TRACE_DIR=str(dumps))
    proc = subprocess.run([sys.executable, "-m", "torchring.run", "-np", str(world), sys.executable, str(JOB),
                           mode, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr, dumps


def fr_trace(dumps: Path) -> str:
    """What torch's Flight Recorder analyzer prints for `dumps`."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(dumps)],
                          capture_output=True, text=True, timeout=60)
    return proc.stdout + proc.stderr


def report(out: str) -> list[str]:
    """The launcher's diagnosis lines in the job's output."""
    lines = out.splitlines()
    start = lines.index("torchring-run: what the ranks' flight recorders say:")
    return lines[start + 1:]


def test_a_rank_that_skips_a_collective_is_named_with_both_lines(tmp_path: Path) -> None:
    code, out, dumps = run_job("skip", tmp_path)
    assert code != 0, out
    said = "\n".join(report(out))
    assert "world (3 ranks): operation #7 is the first that not every rank finished." in said, out
    assert (f"ranks 0, 2 issued broadcast float32[256] root=0 at {line_of('broadcast')} in main; "
            f"rank 1 issued allreduce float32[256] SUM at {line_of('allreduce')} in main.") in said, out
    assert "rank 1 issued something the others did not there" in said, out
    assert "Culprit rank 1; Error type: COLLECTIVE_TYPE_MISMATCH" in fr_trace(dumps)


def test_a_rank_that_issues_another_shape_is_named(tmp_path: Path) -> None:
    code, out, dumps = run_job("shape", tmp_path)
    assert code != 0, out
    said = "\n".join(report(out))
    assert f"rank 1 issued allreduce float32[3] SUM at {line_of('shape')} in main." in said, out
    assert "rank 1 issued something the others did not there" in said, out
    analyzed = fr_trace(dumps)
    assert "Culprit rank 1; Error type: COLLECTIVE_TYPE_MISMATCH" in analyzed, analyzed
    # torch's analyzer shows the stack of the operation the others expected
    assert f"main at {JOB}:{line_of('broadcast').split(':')[1]}" in analyzed, analyzed


@pytest.mark.parametrize("mode", ["sleep", "lock"])
def test_a_rank_stuck_in_its_own_code_is_named_with_its_line(mode: str, tmp_path: Path) -> None:
    start = time.monotonic()
    code, out, dumps = run_job(mode, tmp_path)
    assert code != 0 and time.monotonic() - start < 60, out
    said = "\n".join(report(out))
    assert (f"rank 1 (host {HOST}) never reached it: its last operation was #6 allreduce float32[256] SUM "
            f"at {line_of('allreduce')} in main (completed); it is now in its own code at "
            f"{line_of(mode)} in main, not in a collective.") in said, out
    assert f"ranks 0, 2 reached #7 broadcast float32[256] root=0 at {line_of('broadcast')} in main" in said, out
    assert "hit the 4 s timeout waiting for rank 1" in said, out
    ranks, world = diagnose.load(dumps)
    assert sorted(ranks) == [0, 1, 2] and world == 3
    assert ranks[1].reason == "SIGTERM" and ranks[0].reason == "failure"


def test_sigusr1_dumps_a_hung_job_while_it_runs(tmp_path: Path) -> None:
    """No rank failed yet (a long timeout): SIGUSR1 makes every rank dump, the one blocked on a
    lock and the ones waiting in the collective alike; the diagnosis names the blocked one."""
    dumps = tmp_path / "dumps"
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCHRING_TIMEOUT="120", TORCHRING_TRACE_DIR=str(dumps))
    job = subprocess.Popen([sys.executable, "-m", "torchring.run", "-np", "3", sys.executable, str(JOB), "lock",
                            str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        pids = _wait_for(lambda: [int((tmp_path / f"pid{r}").read_text()) for r in range(3)], 60)
        time.sleep(2)  # ranks 0 and 2 are in broadcast #7, rank 1 on its lock
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)
        _wait_for(lambda: [dump.read(dump.path_of(dumps, r)) for r in range(3)], 20)
        lines, findings = diagnose.diagnose(dumps)
        said = "\n".join(lines)
        assert f"it is now in its own code at {line_of('lock')} in main, not in a collective." in said, said
        assert findings[0].behind == [1] and findings[0].seq == 7, said
        assert "ranks 0, 2 reached #7 broadcast" in said, said
        assert job.poll() is None, "the dumps must not stop the job"
    finally:
        job.terminate()
        job.wait(60)


def _wait_for(read, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return read()
        except (OSError, EOFError, ValueError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_c10d_operations_are_recorded_with_the_users_lines(tmp_path: Path) -> None:
    code, out, _ = run_job("c10d", tmp_path, world=2, timeout_s="30")
    assert code == 0, out
    for rank in (0, 1):
        d = dump.read((tmp_path / f"dump{rank}").read_text())
        entries = [e for e in d["entries"] if e["process_group"][0] == "c10d:0"]
        names = [e["profiling_name"] for e in entries]
        p2p = "gloo:send 0->1" if rank == 0 else "gloo:recv 1<-0"
        assert names == ["gloo:all_reduce"] * 3 + [p2p, "gloo:barrier"], names
        assert all(e["state"] == "completed" for e in entries), entries
        where = [f"{Path(e['frames'][0]['filename']).name}:{e['frames'][0]['line']}" for e in entries[:4]]
        mark = "c10d send" if rank == 0 else "c10d recv"
        assert where == [line_of("c10d all_reduce")] * 3 + [line_of(mark)], where
        assert d["pg_config"]["c10d:0"]["ranks"] == "[0, 1]" and d["pg_config"]["c10d:0"]["desc"] == "default_pg"
