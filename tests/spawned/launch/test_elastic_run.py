"""torchring-run's elastic mode (--min-np/--max-np, --host-discovery-script): the launcher
supervises the workers itself, so a lost worker leaves the others running and they re-form in
process (tests/support/_elastic_job.py: exact final weights iff every sample was applied once).

- a worker SIGKILLs itself: the other two finish, the launcher exits 0 and says what happened;
- the discovery script's slots go 2 -> 3: the launcher starts a newcomer, which joins;
- the slots go 3 -> 2: the launcher stops the newest worker, the other two re-form;
- an hvd.elastic job's killed worker is replaced (--max-restarts 1): the newcomer joins;
- fewer than --min-np are left: the job fails within the timeouts, saying so, nothing left running.

This file is also the job (``__main__``): ``python this.py OUT HOW``; each worker writes
``result-<host>-<pid>.json`` into OUT when it ends.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from _elastic_job import check

ROOT = Path(__file__).resolve().parents[3]
SUPPORT = ROOT / "tests" / "support"


def _launch(tmp: Path, how: str, *flags: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SUPPORT), str(ROOT)]), "TORCHRING_TIMEOUT": "10"}
    cmd = [sys.executable, "-m", "torchring.run", *flags, str(Path(__file__).resolve()), str(tmp), how]
    return subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _results(tmp: Path) -> list[dict]:
    out = []
    for path in sorted(glob.glob(str(tmp / "result-*.json"))):
        with open(path) as f:
            out.append(json.load(f))
    return out


def _left_running(tmp: Path) -> list[str]:
    """Processes whose command line names this test's directory (workers of the job)."""
    done = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True)
    return [line for line in done.stdout.splitlines() if str(tmp) in line and "ps -eo" not in line]


def _finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        raise AssertionError(f"torchring-run did not end within {timeout} s:\n{output[-4000:]}")
    return proc.returncode, output


def _assert_exact(tmp: Path, output: str, size: int) -> None:
    """The job ended as a world of `size` with exact weights, every sample once, nothing left running."""
    results = _results(tmp)
    assert len(results) == size and check(results, size) == [], f"{check(results, size)}\n{output[-4000:]}"
    assert _left_running(tmp) == []


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"torchring-run ended early:\n{proc.communicate()[0][-4000:]}"
        assert time.monotonic() < deadline, f"{path.name} did not appear within {timeout} s"
        time.sleep(0.1)


def test_a_killed_worker_leaves_the_others_running(tmp_path: Path) -> None:
    code, output = _finish(_launch(tmp_path, "kill", "-np", "3", "--min-np", "2", "--max-np", "3"))
    assert code == 0, output[-4000:]
    assert "worker w2" in output and "exited with signal SIGKILL; the other 2 go on" in output, output[-4000:]
    _assert_exact(tmp_path, output, 2)


def test_discovery_adds_a_worker_that_joins(tmp_path: Path) -> None:
    slots = tmp_path / "slots"
    slots.write_text("localhost:2\n")
    proc = _launch(tmp_path, "hold", "--min-np", "2", "--max-np", "3", "-np", "2",
                   "--host-discovery-script", f"cat {slots}", "--discovery-interval", "0.2")
    # Step 3 of 2 ranks leaves 36 samples: 12 for each of 3, none repeated to even them out.
    _wait_for(tmp_path / "holding", proc)  # the members commit again and again at step 3
    slots.write_text("localhost:3\n")
    code, output = _finish(proc)
    assert code == 0, output[-4000:]
    assert "host discovery: localhost:2 -> localhost:3" in output and "started worker w2" in output, output[-4000:]
    _assert_exact(tmp_path, output, 3)


def test_discovery_removes_a_worker_and_the_others_re_form(tmp_path: Path) -> None:
    slots = tmp_path / "slots"
    slots.write_text("localhost:3\n")
    proc = _launch(tmp_path, "wait", "--min-np", "2", "--max-np", "3",
                   "--host-discovery-script", f"cat {slots}", "--discovery-interval", "0.2")
    _wait_for(tmp_path / "victim2.json", proc)  # launch rank 2 (w2, the newest) waits at step 3
    slots.write_text("localhost:2\n")
    code, output = _finish(proc)
    assert code == 0, output[-4000:]
    assert "host discovery: localhost:3 -> localhost:2" in output and "stopping worker w2" in output, output[-4000:]
    _assert_exact(tmp_path, output, 2)


def test_hvd_job_gets_a_replacement_for_a_killed_worker(tmp_path: Path) -> None:
    from _elastic_job import expected_weights

    code, output = _finish(_launch(tmp_path, "hvd-kill", "-np", "3", "--min-np", "2", "--max-np", "3",
                                   "--max-restarts", "1"))
    assert code == 0, output[-4000:]
    assert "exited with signal SIGKILL" in output and "started worker w3" in output, output[-4000:]
    results = _results(tmp_path)
    assert sorted((r["rank"], r["size"]) for r in results) == [(0, 3), (1, 3), (2, 3)], output[-4000:]
    assert all(r["epoch"] >= 1 for r in results)
    want = expected_weights().tolist()
    assert all(r["w"] == want for r in results), ([r["w"] for r in results], want)
    assert _left_running(tmp_path) == []


def test_below_min_np_the_job_fails_saying_so(tmp_path: Path) -> None:
    start = time.monotonic()
    code, output = _finish(_launch(tmp_path, "kill", "-np", "3", "--min-np", "3", "--elastic-timeout", "3"))
    took = time.monotonic() - start
    assert code != 0, output[-4000:]
    assert "fewer than --min-np 3" in output or "the 3 members it needs" in output, output[-4000:]
    assert took < 60, f"the job took {took:.0f} s to fail"
    assert _results(tmp_path) == []
    assert _left_running(tmp_path) == []


def main() -> None:
    from _elastic_job import train, train_hvd

    out, how = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    if how == "hvd-kill":  # hvd.init() and hvd.elastic; launch rank 2 SIGKILLs itself at step 3
        result = train_hvd(rank, 2, 3, refill=3)  # the survivors wait for the replacement
    else:
        victim = 2 if how in ("kill", "wait") else -1
        result = train(rank, victim, 3, how=how, out_dir=out)
    result["host"] = socket.gethostname()  # where it ran (test_elastic_run_hosts.py checks it)
    # pids repeat across hosts (each has its own PID namespace): the host is in the name too
    with open(os.path.join(out, f"result-{result['host']}-{os.getpid()}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
