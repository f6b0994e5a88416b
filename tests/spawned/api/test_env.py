"""Shared memory is left behind by nobody, even when a rank is killed. (The launcher
variables' parsing is tested without processes in tests/unit/core/test_launch_env.py.)"""

from __future__ import annotations

import glob
import os
import signal

from _dist import spawn


def _killed_after_init(rank: int) -> None:
    import torch
    import torchring
    torchring.init()
    torchring.allreduce(torch.ones(10))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    torchring.allreduce(torch.ones(10))


def test_nothing_is_left_in_dev_shm_after_a_crash() -> None:
    before = set(glob.glob("/dev/shm/torchring-*"))
    outcomes = spawn(3, _killed_after_init, expect_fail=True, env={"TORCHRING_TIMEOUT": "5"})
    assert outcomes[1].exitcode == -signal.SIGKILL
    assert all("rank 1" in (o.error or "") for o in (outcomes[0], outcomes[2]))
    assert set(glob.glob("/dev/shm/torchring-*")) - before == set()
