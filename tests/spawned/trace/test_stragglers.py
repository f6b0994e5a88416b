"""Stragglers under torchring-run: a rank persistently late is named once, with its host, by the
ranks it made wait; torchring.stats() and torchring.stragglers() put it first; a rank whose
backward takes 200 ms longer in one step of ten is the rank the others waited for most in every
round (DDP-style averaging evens out backward times, so the engine's waits at the collective
are what shows it); a rank whose torch DataLoader is 3x slower is ranked first, late in data
loading, under wrap (stragglers()) and under DDP on the torchring backend (the launcher's end
report)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
JOB = ROOT / "tests" / "support" / "_straggler_job.py"


def _run(mode: str, tmp_path: Path, results: bool = True) -> tuple[str, list[dict]]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCHRING_TIMEOUT="60", TORCHRING_STRAGGLER_MS="100")
    proc = subprocess.run([sys.executable, "-m", "torchring.run", "-np", "3", sys.executable, str(JOB), mode,
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out, [json.loads((tmp_path / f"result{r}.json").read_text()) for r in range(3)] if results else []


def test_a_persistently_late_rank_is_named_once_with_its_host(tmp_path: Path) -> None:
    out, results = _run("sleep", tmp_path)
    host = socket.gethostname()
    for waiter in (0, 1):
        said = [line for line in out.splitlines() if line.startswith(f"[{waiter}]:") and "persistently late" in line]
        assert len(said) == 1, out
        assert f"rank {waiter}: rank 2 (host {host}, this host) made this rank wait 100.0 ms or more in 10 of " \
               "the last 20 collectives" in said[0], said
        waited = results[waiter]["stats"]["waited_s"]
        assert waited["2"] > 30 * 0.15 * 0.8 and all(s < 1.0 for p, s in waited.items() if p != "2"), waited
    assert not any(line.startswith("[2]:") and "persistently late" in line for line in out.splitlines()), out
    report = results[0]["report"]
    assert report[1].startswith(f"  rank 2 (host {host}): "), report


def test_a_rank_slower_in_one_backward_of_ten_is_caught_in_every_round(tmp_path: Path) -> None:
    _, results = _run("backward", tmp_path)
    culprits = results[0]["culprits"]
    assert len(culprits) == 20 and culprits.count(1) >= 19, culprits


def test_a_rank_whose_torch_dataloader_is_3x_slower_is_first_late_in_data_loading(tmp_path: Path) -> None:
    _, results = _run("torch-loader", tmp_path)
    report = results[0]["report"]
    assert report[1].startswith(f"  rank 2 (host {socket.gethostname()}): "), report
    assert "late in data loading" in report[1], report


def test_under_ddp_on_the_backend_the_end_report_names_the_slow_loader(tmp_path: Path) -> None:
    out, _ = _run("ddp-loader", tmp_path, results=False)
    lines = out.splitlines()
    at = next((i for i, line in enumerate(lines) if "who made the others wait" in line), None)
    assert at is not None, out
    assert lines[at + 1].startswith("torchring-run:   rank 2 (") and "late in data loading" in lines[at + 1], out
