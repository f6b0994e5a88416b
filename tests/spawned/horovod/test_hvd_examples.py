"""examples/horovod_mnist_style.py: a Horovod script whose only torchring line is its import runs
under torchring-run on 2 ranks and learns."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples/horovod_mnist_style.py"


def test_the_example_names_torchring_only_in_its_import() -> None:
    tree = ast.parse(EXAMPLE.read_text())
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names if alias.name.split(".")[0] == "torchring"]
    imported += [node.module for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torchring"]
    names = [node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and node.id == "torchring"]
    assert imported == ["torchring.horovod"] and not names, (imported, names)


def test_the_example_trains_on_two_ranks(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCHRING_TIMEOUT="30")
    cmd = [sys.executable, "-m", "torchring.run", "-np", "2", "python", str(EXAMPLE),
           "--epochs", "3", "--train-size", "1024", "--test-size", "256"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    epochs = re.findall(r"\[(\d)\]: epoch (\d): train loss ([\d.]+), test loss ([\d.]+), "
                        r"test accuracy ([\d.]+)%", out)
    assert [(rank, int(epoch)) for rank, epoch, *_ in epochs] == [("0", 1), ("0", 2), ("0", 3)], out
    train, test = [float(e[2]) for e in epochs], [float(e[3]) for e in epochs]
    assert train[-1] < train[0] and test[-1] < test[0], out
    assert float(epochs[-1][4]) > 50, out  # 10 classes: chance is 10 %
