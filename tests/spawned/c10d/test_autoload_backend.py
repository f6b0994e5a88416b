"""init_process_group("torchring") in a script that never imports torchring (as Ray Train's
TorchConfig(backend="torchring") makes the group in each worker): the name registered at
`import torch` (torchring_autoload) builds the group, and an integer allreduce over torchrun's
two ranks sums exactly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import sys, torch, torch.distributed as dist
assert "torchring" not in sys.modules
dist.init_process_group("torchring")
t = torch.arange(6, dtype=torch.int64) * (dist.get_rank() + 1)
dist.all_reduce(t)
out = f"{dist.get_rank()} {t.tolist()} {dist.get_backend()} {'torchring' in sys.modules}"
open(sys.argv[1] + f"/result{dist.get_rank()}", "w").write(out)
dist.destroy_process_group()
"""


def test_a_script_that_never_imports_torchring_gets_its_backend(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(tmp_path / "job.py"), str(tmp_path)], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    expected = [3 * i for i in range(6)]  # ranks 1 and 2 times arange: 3 * arange
    for rank in (0, 1):  # the backend imported torchring when it made the group
        assert (tmp_path / f"result{rank}").read_text() == f"{rank} {expected} torchring True", out
