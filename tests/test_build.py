"""``python -m torchring.build`` reports what was built: the transports and whether NCCL is in."""

from __future__ import annotations

import re
import subprocess
import sys

import torch


def test_build_report() -> None:
    proc = subprocess.run([sys.executable, "-m", "torchring.build"], capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{out}"
    lower = out.lower()
    for transport in ("shm", "tcp"):
        assert transport in lower, f"the report does not name the {transport} transport:\n{out}"
    nccl = [line for line in lower.splitlines() if "nccl" in line]
    assert nccl, f"the report does not say whether NCCL was built:\n{out}"
    if not torch.cuda.is_available():
        assert any(re.search(r"\b(no|false|off|disabled|not|without|unavailable)\b", line) for line in nccl), \
            f"NCCL reported as built on a machine without CUDA:\n{out}"
