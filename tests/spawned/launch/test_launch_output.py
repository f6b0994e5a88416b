"""What torchring-run shows, run for real: each rank's lines and each carriage-return redraw
carry the rank's prefix, so a progress bar stays one updating line on a terminal (a pty
here) and a log file has no blank prefixed lines; --rank0-only shows rank 0 as is and
--no-prefix leaves every rank's output as is; OMP_NUM_THREADS is set per rank, said in one
line, and a user's value is kept. The ranks are small scripts, not torchring jobs."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
from pathlib import Path

from torchring._core import env as _env
from torchring.launch import threads as _threads

# rank 0 draws a bar on stderr the way tqdm does; each rank prints lines on stdout
_SCRIPT = r"""
import os, sys, time
rank = os.environ["RANK"]
# one write per line: under -u, print() writes the text and the newline separately, and with
# --no-prefix two ranks' unprefixed bytes may interleave between those writes
sys.stdout.write(f"hello from {rank} threads={os.environ.get('OMP_NUM_THREADS')}\n"); sys.stdout.flush()
if rank == "0":
    time.sleep(0.3)
    for i in range(4):
        sys.stderr.write(f"\rbar {i}/3"); sys.stderr.flush(); time.sleep(0.05)
    sys.stderr.write("\r        \r"); sys.stderr.flush()  # a cleared bar (tqdm's leave=False)
    print("epoch done", flush=True)
"""


def _launch(tmp_path: Path, *flags: str, env: dict[str, str] | None = None, tty: bool = False) -> tuple[int, bytes]:
    """(exit code, what torchring-run wrote to its stdout+stderr): a log file, or a pty."""
    script = tmp_path / "bar.py"
    script.write_text(_SCRIPT)
    argv = [sys.executable, "-m", "torchring.run", "-np", "2", *flags, str(script)]
    run_env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | (env or {})
    if not tty:
        log = tmp_path / "log.txt"
        with open(log, "wb") as f:
            code = subprocess.run(argv, cwd=tmp_path, env=run_env, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=120).returncode
        return code, log.read_bytes()
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, cwd=tmp_path, env=run_env, stdout=slave, stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    out = b""
    while True:  # read until the launcher exits and the pty is drained
        ready, _, _ = select.select([master], [], [], 120)
        try:
            chunk = os.read(master, 1 << 16) if ready else b""
        except OSError:  # EIO: every writer is gone
            chunk = b""
        if not chunk:
            break
        out += chunk
    os.close(master)
    return proc.wait(timeout=60), out


def _threads_line(ranks: int) -> str:
    return f"OMP_NUM_THREADS={_threads.threads_per_rank(ranks, _env.available_cpus())} for each of the {ranks}"


def test_log_file_every_line_and_redraw_prefixed(tmp_path: Path) -> None:
    code, out = _launch(tmp_path)
    assert code == 0, out
    threads = _threads.threads_per_rank(2, _env.available_cpus())
    assert b"\r[0]: bar 0/3\r[0]: bar 1/3\r[0]: bar 2/3\r[0]: bar 3/3\r" in out, out
    for rank in (0, 1):
        assert f"[{rank}]: hello from {rank} threads={threads}\n".encode() in out, out
    assert b"[0]: epoch done\n" in out, out
    blank = [line for line in out.rstrip(b"\n").split(b"\n") if line.strip(b"\r ") in (b"[0]:", b"[1]:", b"")]
    assert not blank, f"prefixed blank lines: {blank}\n{out!r}"
    launcher = [line for line in out.decode().splitlines() if line.startswith("torchring-run:")]
    assert len(launcher) == 1 and _threads_line(2) in launcher[0], out
    assert b"Setting OMP_NUM_THREADS" not in out, out


def test_terminal_the_bar_is_one_updating_line(tmp_path: Path) -> None:
    code, out = _launch(tmp_path, tty=True)
    assert code == 0, out
    bar = out[out.index(b"bar 0/3"):out.index(b"bar 3/3")]
    assert b"\n" not in bar and bar.count(b"\r[0]: ") == 3, out  # redrawn in place
    assert b"[0]: epoch done" in out and b"[1]: hello from 1" in out, out


def test_rank0_only_passes_rank_0_through(tmp_path: Path) -> None:
    code, out = _launch(tmp_path, "--rank0-only", tty=True)
    assert code == 0, out
    assert b"hello from 0" in out and b"\rbar 1/3\rbar 2/3" in out and b"epoch done" in out, out
    assert b"[0]:" not in out and b"hello from 1" not in out, out


def test_no_prefix_and_a_users_threads(tmp_path: Path) -> None:
    code, out = _launch(tmp_path, "--no-prefix", env={"OMP_NUM_THREADS": "3"})
    assert code == 0, out
    assert b"hello from 0 threads=3\n" in out and b"hello from 1 threads=3\n" in out, out
    assert b"\rbar 1/3\rbar 2/3" in out and b"[0]:" not in out, out
    assert b"OMP_NUM_THREADS" not in out.replace(b"threads=3", b""), out  # kept, said nothing


def test_a_reader_that_goes_away_does_not_stall_the_ranks(tmp_path: Path) -> None:
    # `torchring-run ... | head -1`: the ranks must still run to the end, not block on output
    script = tmp_path / "many.py"
    script.write_text("for i in range(100000):\n    print('line', i)\n")
    proc = subprocess.Popen([sys.executable, "-m", "torchring.run", "-np", "2", str(script)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    proc.stdout.close()
    try:
        code = proc.wait(timeout=90)
    finally:
        proc.kill()
    assert first.startswith((b"[0]: line ", b"[1]: line ")) and code == 0, (first, code)
