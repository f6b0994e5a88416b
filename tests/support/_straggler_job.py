"""Stragglers for tests/spawned/trace/test_stragglers.py:

    python _straggler_job.py MODE OUT_DIR

MODE sleep: rank 2 sleeps 0.15 s before each of 30 allreduces (persistently late); each rank
writes stats() and, rank 0, stragglers() to OUT_DIR/result<rank>.json.
MODE backward: a wrapped MLP trains 20 rounds of 10 steps; in one step of each round rank 1's
backward takes 200 ms longer (a hook sleeps). After each round every rank's waits since the
last round are gathered, and rank 0 writes the rank the others waited for most, per round.
MODE link: 40 allreduces of 256 KiB (the test slows one host's link); rank 0 writes stragglers().
MODE loader: a wrapped model trains an epoch from torchring.data's loader, rank 2's dataset three
times slower per sample; rank 0 writes stragglers().
MODE torch-loader: the same from torch's own DataLoader.
MODE ddp-loader: the same with DDP on init_process_group("torchring") and torch's DataLoader
(torchring.init() is never called: the launcher's end report names the straggler).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch import nn

import torchring


class SlowSamples(torch.utils.data.Dataset):
    """Integer samples, each taking `seconds` to load."""

    def __init__(self, n: int, seconds: float) -> None:
        self.n, self.seconds = n, seconds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.seconds)
        return torch.full((16,), float(i % 7)), torch.tensor(float(i % 3))


def train_from_a_loader(rank: int, kind: str = "torchring") -> None:
    """An epoch of a model from a data loader, rank 2's 3x slower: `kind` torchring (a wrapped
    model, torchring.data's loader), torch (a wrapped model, torch's DataLoader) or ddp (DDP on
    the torchring backend, torch's DataLoader)."""
    import torchring.data
    torch.manual_seed(0)
    data = SlowSamples(3 * 8 * 30, 0.015 if rank == 2 else 0.005)
    if kind == "torchring":
        model = torchring.wrap(nn.Linear(16, 1))
        loader = torchring.data.DataLoader(data, batch_size=8, num_workers=0)
    else:
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=3, rank=rank, shuffle=False)
        loader = torch.utils.data.DataLoader(data, batch_size=8, sampler=sampler)
        model = (torchring.wrap(nn.Linear(16, 1)) if kind == "torch" else
                 torch.nn.parallel.DistributedDataParallel(nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(x).squeeze(1), y).backward()
        opt.step()


def main(mode: str, out_dir: str) -> None:
    """Runs MODE (see the module's docstring)."""
    if mode == "ddp-loader":
        import torch.distributed as dist
        dist.init_process_group("torchring")
        train_from_a_loader(dist.get_rank(), "ddp")
        dist.destroy_process_group()
        return
    torchring.init()
    rank = torchring.rank()
    result: dict = {}
    if mode == "link":
        t = torch.ones(65536)
        for _ in range(40):
            torchring.allreduce(t)
        result = {"report": torchring.stragglers()}
    elif mode in ("loader", "torch-loader"):
        train_from_a_loader(rank, "torchring" if mode == "loader" else "torch")
        result = {"report": torchring.stragglers()}
    elif mode == "sleep":
        t = torch.ones(1024)
        for _ in range(30):
            if rank == 2:
                time.sleep(0.15)
            torchring.allreduce(t)
        result = {"stats": torchring.stats(), "report": torchring.stragglers()}
    else:
        torch.manual_seed(0)
        model = torchring.wrap(nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(16, 256)
        delay = {"on": False}

        def slow_backward(grad: torch.Tensor) -> torch.Tensor:
            if delay["on"]:
                time.sleep(0.2)
            return grad

        model.module[0].weight.register_hook(slow_backward)
        before = torchring.stats()["waited_s"]
        culprits = []
        for round_ in range(20):
            for step in range(10):
                delay["on"] = rank == 1 and step == (round_ * 3) % 10
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
            now = torchring.stats()["waited_s"]
            mine = {peer: now.get(peer, 0.0) - before.get(peer, 0.0) for peer in now}
            before = now
            made: dict[int, float] = {}
            for waits in torchring.allgather_object(mine):
                for peer, seconds in waits.items():
                    made[peer] = made.get(peer, 0.0) + seconds
            culprits.append(max(made, key=made.get) if made else -1)
        result = {"culprits": culprits}
    with open(os.path.join(out_dir, f"result{rank}.json"), "w") as f:
        json.dump(result, f)
    torchring.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
