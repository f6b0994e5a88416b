"""A container's small /dev/shm, made here with a private mount namespace (root only): with
docker's default 64 MiB, a 2-rank job still runs (a 128 MiB allreduce, larger than /dev/shm,
sums right) and rank 0 says once what it falls back to and how to give it room; with 1 MiB,
too little for the transport's own regions, every rank fails at init naming /dev/shm and the fix."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

JOB = """
import torch, torchring
torchring.init()
t = torch.full((1 << 25,), float(torchring.rank() + 1))
torchring.allreduce(t)
print("sum", int(t[0].item()), int(t[-1].item()), torchring.transport())
torchring.shutdown()
"""


def _run_with_shm(size: str, tmp_path: Path) -> subprocess.CompletedProcess:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to mount a private /dev/shm")
    (tmp_path / "job.py").write_text(JOB)
    script = (f"mount -t tmpfs -o size={size} tmpfs /dev/shm && exec {sys.executable} -m torchring.run -np 2 "
              f"{sys.executable} {tmp_path / 'job.py'}")
    env = dict(os.environ, TORCHRING_TIMEOUT="30", PYTHONUNBUFFERED="1")
    return subprocess.run(["unshare", "-m", "sh", "-c", script], env=env, capture_output=True, text=True, timeout=240)


def test_a_64_mib_shm_runs_and_says_once_what_it_falls_back_to(tmp_path: Path) -> None:
    proc = _run_with_shm("64m", tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "[0]: sum 3 3 shm" in out and "[1]: sum 3 3 shm" in out, out
    notes = [line for line in out.splitlines() if "/dev/shm has" in line]
    assert len(notes) == 1 and notes[0].startswith("[0]: torchring: rank 0: /dev/shm has "), out
    assert "of 64 MiB for 2 ranks" in notes[0] and "--shm-size" in notes[0], notes


def test_a_shm_too_small_for_the_transport_fails_every_rank_naming_it(tmp_path: Path) -> None:
    proc = _run_with_shm("1m", tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "in /dev/shm for the shared-memory region" in out and "--shm-size" in out, out
    assert "TORCHRING_TRANSPORT=tcp" in out, out
