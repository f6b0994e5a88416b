"""Jobs that torchring-run's status and straggler report look at (tests/spawned/trace/test_status.py):

    python _status_job.py MODE OUT_DIR

MODE hang: three steps of allreduce + broadcast, then rank 1 blocks on a lock forever while the
others wait in the next allreduce (the job runs until the test stops it).
MODE loader: a wrapped model trains one epoch from torchring.data's loader; rank 2's dataset
takes three times as long per sample. Each rank writes its pid to OUT_DIR/pid<rank>; lines the
status must name carry a "# line:" marker.
"""

from __future__ import annotations

import os
import sys
import threading

import torch

import torchring
from _straggler_job import train_from_a_loader


def main(mode: str, out_dir: str) -> None:
    """Runs MODE (see the module's docstring)."""
    torchring.init()
    rank = torchring.rank()
    with open(os.path.join(out_dir, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if mode == "hang":
        t = torch.ones(256)
        for step in range(5):
            if step == 3 and rank == 1:
                lock = threading.Lock()
                lock.acquire()
                lock.acquire()  # line: lock
            torchring.allreduce(t)  # line: allreduce
            torchring.broadcast(t, 0)
    else:
        train_from_a_loader(rank)
    torchring.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
