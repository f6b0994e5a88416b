"""The flight recorder's signal handling: SIGTERM makes a rank dump and then end as SIGTERM would
have, within its grace even when its main thread never returns to Python; a forked child (a
DataLoader worker shares the parent's pipe) takes the default action and leaves its parent be."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from torchring.trace import dump

_FORKS = r"""
import os, signal, sys, time, torch, torchring
torchring.init()
child = os.fork()
if child == 0:
    time.sleep(60)
    os._exit(0)
time.sleep(0.5)
os.kill(child, int(sys.argv[1]))
_, status = os.waitpid(child, 0)
time.sleep(1.5)  # a byte the child wrote to the shared pipe would have ended this process by now
torchring.allreduce(torch.ones(2))
print("child", os.WTERMSIG(status) if os.WIFSIGNALED(status) else -1, flush=True)
torchring.shutdown()
"""

_STUCK = r"""
import os, sys, torch, torchring
torchring.init()
open(os.path.join(sys.argv[1], "ready"), "w").close()
sum(range(10 ** 12))  # one C loop holding the GIL: no other thread runs Python until it ends
"""


def _env(tmp_path: Path) -> dict[str, str]:
    return dict(os.environ, TORCHRING_TRACE_DIR=str(tmp_path / "dumps"))


def test_a_forked_child_takes_the_default_action_and_its_parent_goes_on(tmp_path: Path) -> None:
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        proc = subprocess.run([sys.executable, "-c", _FORKS, str(int(sig))], env=_env(tmp_path),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and f"child {int(sig)}" in proc.stdout, proc.stdout + proc.stderr
    assert not (tmp_path / "dumps").exists(), "neither signal was the parent's"


def test_sigterm_ends_a_rank_within_its_grace_even_when_python_cannot_run(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _STUCK, str(tmp_path)], env=_env(tmp_path))
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.3)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=20)
        took = time.monotonic() - start
    finally:
        proc.kill()
    assert code == -signal.SIGTERM and took < 6, (code, took)
    assert not dump.path_of(tmp_path / "dumps", 0).exists(), "the dump needs Python, which never ran"
