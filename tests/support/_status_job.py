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
import time

import torch
from torch import nn

import torchring
import torchring.data


class SlowSamples(torch.utils.data.Dataset):
    """Integer samples, each taking `seconds` to load."""

    def __init__(self, n: int, seconds: float) -> None:
        self.n, self.seconds = n, seconds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.seconds)
        return torch.full((16,), float(i % 7)), torch.tensor(float(i % 3))


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
        torch.manual_seed(0)
        model = torchring.wrap(nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        data = SlowSamples(3 * 8 * 30, 0.015 if rank == 2 else 0.005)
        loader = torchring.data.DataLoader(data, batch_size=8, num_workers=0)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.mse_loss(model(x).squeeze(1), y).backward()
            opt.step()
    torchring.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
