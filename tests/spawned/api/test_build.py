"""``python -m torchring.build`` reports what was built: whether NCCL (and CUDA) are in, as the engine says."""

from __future__ import annotations

import re
import subprocess
import sys

import torch

from torchring._core import build as _build


def test_build_report() -> None:
    cmd = [sys.executable, "-m", "torchring.build"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{out}"
    engine = _build.load()  # the build the report just made or found, loaded here too
    info = engine.build_info()
    for key in ("nccl", "cuda"):
        said = re.findall(rf"^\s*{key}\s*:\s*(yes|no)\b", out, re.MULTILINE)
        assert said == ["yes" if info[key] else "no"], \
            f"build_info() says {key}={info[key]}, the report's {key} line says {said}:\n{out}"
    if torch.version.cuda is None:
        assert not info["nccl"], f"NCCL reported as built against a CPU build of torch:\n{out}"
    elif _build.nccl_paths() is not None:
        # A CUDA build of torch compiles the NCCL path even without a GPU (CI does this).
        assert info["nccl"], f"CUDA torch with NCCL headers, but NCCL was not built:\n{out}"
