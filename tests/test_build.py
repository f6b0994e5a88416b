"""``python -m torchring.build`` reports what was built: the transports and whether NCCL is in."""

from __future__ import annotations

import re
import subprocess
import sys

import torch


def test_build_report() -> None:
    cmd = [sys.executable, "-m", "torchring.build"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{out}"
    lower = out.lower()
    for transport in ("shm", "tcp"):
        assert transport in lower, f"the report does not name the {transport} transport:\n{out}"
    nccl = [line for line in lower.splitlines() if "nccl" in line]
    assert nccl, f"the report does not say whether NCCL was built:\n{out}"
    said_no = r"\b(no|false|off|disabled|not|without|unavailable)\b"
    from torchring import _build
    if torch.version.cuda is None:
        assert any(re.search(said_no, line) for line in nccl), \
            f"NCCL reported as built against a CPU build of torch:\n{out}"
    elif _build.nccl_paths() is not None:
        # A CUDA build of torch compiles the NCCL path even without a GPU (CI does this).
        assert any(re.search(r"nccl\s*:\s*yes", line) for line in nccl), \
            f"CUDA torch with NCCL headers, but the report says NCCL was not built:\n{out}"
