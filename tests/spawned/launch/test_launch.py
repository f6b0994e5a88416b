"""End to end through the real launchers: torchring-run and torchrun start the examples,
failures stop the whole job quickly with the first failing rank's exit code, a killed job
restarts from its checkpoint to the same final model as an uninterrupted run, and a
horovodrun command line (-H, the HOROVOD_* flags, a leading python) runs unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from torchring import build

ROOT = Path(__file__).resolve().parents[3]
TRAIN = ["--epochs", "3", "--train-size", "2048", "--eval-size", "512"]


def _run(args: list[str], tmp_path: Path, timeout: float = 120) -> tuple[int, str, float]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCHRING_TIMEOUT="20")
    start = time.monotonic()
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def _launcher() -> list[str]:
    return [sys.executable, "-m", "torchring.run"]


def test_ranks_succeed_with_prefixed_output(tmp_path: Path) -> None:
    code, out, _ = _run(_launcher() + ["-np", "3", str(ROOT / "examples/collectives.py")], tmp_path)
    assert code == 0, out
    assert "[0]: world 3 over shm: all checks passed" in out


def test_check_build_says_what_was_built(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(_launcher() + ["--check-build"], tmp_path)
    assert code == 0, out
    build.main([])  # what python -m torchring.build prints, made here
    report = [line for line in capsys.readouterr().out.splitlines() if "load time" not in line]
    missing = [line for line in report if line not in out.splitlines()]
    assert report and not missing, f"--check-build lacks these lines of the build report: {missing}\n{out}"


_FAILING = """
import os, signal, sys, time, torch, torchring
torchring.init()
open(os.path.join(sys.argv[2], f"pid{torchring.rank()}"), "w").write(str(os.getpid()))
torchring.allreduce(torch.ones(3))
if torchring.rank() == 1:
    if sys.argv[1] == "wait":
        time.sleep(120)
    if sys.argv[1] == "raise":
        raise SystemExit(7)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)
"""


@pytest.mark.parametrize("how,expected", [("raise", 7), ("kill", 128 + 9)])
def test_a_failing_rank_stops_the_job(tmp_path: Path, how: str, expected: int) -> None:
    script = tmp_path / "failing.py"
    script.write_text(_FAILING)
    code, out, took = _run(_launcher() + ["-np", "3", str(script), how, str(tmp_path)], tmp_path)
    assert code == expected, out
    assert "rank 1 failed first" in out, out
    assert took < 30, f"the launcher took {took:.1f} s to stop the job"
    for rank in range(3):
        pid = int((tmp_path / f"pid{rank}").read_text())
        alive = os.path.exists(f"/proc/{pid}") and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
        assert not alive, f"rank {rank} (pid {pid}) outlived the job"


def test_torchrun_launches_the_example_unchanged(tmp_path: Path) -> None:
    code, out, _ = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                         str(ROOT / "examples/train.py"), *TRAIN, "--checkpoint", "ck.pt"], tmp_path)
    assert code == 0, out
    assert out.count("accuracy") == 3 and (tmp_path / "ck.pt").exists()


def test_restart_resumes_to_the_same_final_model(tmp_path: Path) -> None:
    train = str(ROOT / "examples/train.py")
    code, out, _ = _run(_launcher() + ["-np", "2", train, *TRAIN, "--checkpoint", "plain.pt"], tmp_path)
    assert code == 0, out
    code, out, _ = _run(_launcher() + ["-np", "2", "--max-restarts", "1", train, *TRAIN, "--resume",
                                       "--kill-rank-at-epoch", "1", "--checkpoint", "restarted.pt"], tmp_path)
    assert code == 0, out
    assert "resumed from restarted.pt after epoch 0" in out, out
    plain = torch.load(tmp_path / "plain.pt")
    restarted = torch.load(tmp_path / "restarted.pt")
    assert plain["epoch"] == restarted["epoch"] == 2
    for key, value in plain["model"].items():
        assert torch.equal(value, restarted["model"][key]), f"{key} differs after the restart"


def test_ctrl_c_stops_every_rank(tmp_path: Path) -> None:
    script = tmp_path / "waiting.py"
    script.write_text(_FAILING)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(_launcher() + ["-np", "2", str(script), "wait", str(tmp_path)], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"pid{r}").exists() for r in range(2)) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    proc.send_signal(2)  # SIGINT, what Ctrl-C sends
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 128 + 2, out
    for rank in range(2):
        pid = int((tmp_path / f"pid{rank}").read_text())
        alive = os.path.exists(f"/proc/{pid}") and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
        assert not alive, f"rank {rank} (pid {pid}) survived Ctrl-C"


_SHOW_ENV = """
import os
names = ["RANK", "HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME", "HOROVOD_TIMELINE",
         "HOROVOD_TIMELINE_MARK_CYCLES", "HOROVOD_LOG_LEVEL", "TORCHRING_TIMEOUT"]
print("seen " + " ".join(f"{n}={os.environ.get(n)}" for n in names))
"""


def test_horovodrun_command_line_runs_unchanged(tmp_path: Path) -> None:
    script = tmp_path / "show_env.py"
    script.write_text(_SHOW_ENV)
    code, out, _ = _run(_launcher() + ["-H", "localhost:2", "--gloo", "--verbose", "--fusion-threshold-mb", "2",
                                       "--cycle-time-ms", "3.5", "--timeline-filename", "tl.json",
                                       "--timeline-mark-cycles", "--start-timeout", "40", "python", str(script)],
                        tmp_path)
    assert code == 0, out
    for rank in range(2):
        assert (f"seen RANK={rank} HOROVOD_FUSION_THRESHOLD={2 * 1024 * 1024} HOROVOD_CYCLE_TIME=3.5 "
                "HOROVOD_TIMELINE=tl.json HOROVOD_TIMELINE_MARK_CYCLES=1 HOROVOD_LOG_LEVEL=debug "
                "TORCHRING_TIMEOUT=40") in out, out
    assert "--gloo ignored" in out and "running torch.distributed.run" in out


def test_any_program_runs_in_each_rank(tmp_path: Path) -> None:
    code, out, _ = _run(_launcher() + ["-np", "2", "--no-prefix", "bash", "-c", "echo rank $RANK of $WORLD_SIZE"],
                        tmp_path)
    assert code == 0, out
    assert sorted(line for line in out.splitlines() if line.startswith("rank ")) == ["rank 0 of 2", "rank 1 of 2"]
