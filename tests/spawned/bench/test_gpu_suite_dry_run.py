"""benchmarks/gpu_suite.py --dry-run on this CPU machine: every step's real command line and
imports (TORCHRING_BENCH_PARSE_ONLY), the GPU tests collected, and the CPU steps' small forms
run, so a typo cannot waste the GPU machine's one chance."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _gpu_steps import STEPS  # noqa: E402


def test_dry_run_passes_every_step(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), str(tmp_path / "out"),
                           "--dry-run", "--wheels", str(tmp_path / "no-wheels")],
                          cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=900)
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert done.returncode == 0, f"{summary}\n{done.stdout[-4000:]}"
    for step in STEPS:
        assert f"| {step.name} (parse) | 0 |" in summary, summary
        if step.dry is not None:
            assert f"| {step.name} (dry) | 0 |" in summary, summary
