"""The main job: train a classifier data-parallel with torchring, checkpoint, resume.

Two ranks on this host (the README's main command):
    torchring-run -np 2 examples/train.py
The same, under torchrun, unchanged:
    torchrun --standalone --nproc_per_node=2 examples/train.py
Restart-safe: a rank killed mid-run resumes from the last checkpoint:
    torchring-run -np 2 --max-restarts 3 examples/train.py --resume
Quick smoke run:
    torchring-run -np 2 examples/train.py --epochs 2 --train-size 4096

The data is generated, nothing is downloaded: inputs are Gaussian vectors and the label is
what a fixed random linear "teacher" says, so a student MLP can learn it (the accuracy
climbs epoch after epoch). Training is deterministic for a given seed and world size: each
epoch reseeds from (seed, epoch), and checkpoints (rank 0 only) hold the model, the
optimizer and the epoch, so a resumed run ends with the same model as an uninterrupted one.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn
from tqdm import tqdm

import torchring
import torchring.data


class Teacher(torch.utils.data.Dataset):
    """`size` samples of (x, label): x ~ N(0, 1) in `dim` dims, label = argmax teacher(x)."""

    def __init__(self, size: int, dim: int = 32, classes: int = 10, seed: int = 0) -> None:
        teacher = torch.Generator().manual_seed(1234)  # one teacher for train and eval sets
        weights = torch.randn(dim, classes, generator=teacher)
        self.x = torch.randn(size, dim, generator=torch.Generator().manual_seed(seed))
        self.y = (self.x @ weights).argmax(1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def make_model(dim: int = 32, classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, classes))


def evaluate(model: nn.Module, loader: torch.utils.data.DataLoader) -> float:
    """Accuracy over the whole eval set: each sample is counted on exactly one rank."""
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            correct += int((model(x).argmax(1) == y).sum())
            total += len(y)
    model.train()
    sums = torchring.data.all_reduce_metrics({"correct": correct, "total": total})
    return sums["correct"] / sums["total"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="for one rank; scaled by the world size")
    parser.add_argument("--train-size", type=int, default=32768)
    parser.add_argument("--eval-size", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default="checkpoints/train.pt")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint if it exists")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers per rank "
                        "(the data is in memory already; use more for data that costs CPU)")
    parser.add_argument("--kill-rank-at-epoch", type=int, default=None,
                        help="testing: rank 1 kills itself at this epoch on the first attempt")
    args = parser.parse_args()

    torchring.init()
    rank, world = torchring.rank(), torchring.size()
    torch.manual_seed(args.seed)
    model = torchring.wrap(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * world, momentum=0.9)
    train = torchring.data.DataLoader(Teacher(args.train_size, seed=args.seed), args.batch_size,
                                      seed=args.seed, drop_last=True, num_workers=args.workers)
    held_out = torchring.data.DataLoader(Teacher(args.eval_size, seed=args.seed + 1), 256,
                                         shuffle=False, exact=True, num_workers=0)
    start = 0
    if args.resume and os.path.exists(args.checkpoint):
        state = torch.load(args.checkpoint, map_location="cpu")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["epoch"] + 1
        if rank == 0:
            print(f"resumed from {args.checkpoint} after epoch {state['epoch']}")

    for epoch in range(start, args.epochs):
        train.sampler.set_epoch(epoch)
        torch.manual_seed(args.seed * 1000 + epoch)
        if (args.kill_rank_at_epoch == epoch and rank == 1
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            os.kill(os.getpid(), 9)
        begin, seen, loss_sum = time.perf_counter(), 0, 0.0
        for x, y in tqdm(train, desc=f"epoch {epoch}", disable=rank != 0, leave=False,
                         mininterval=1.0):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            seen += len(y)
            loss_sum += loss.item() * len(y)
        rate = torchring.data.all_reduce_metrics({"seen": seen})["seen"] / (time.perf_counter() - begin)
        accuracy = evaluate(model, held_out)
        if rank == 0:
            print(f"epoch {epoch}: loss {loss_sum / seen:.3f}  accuracy {accuracy:.1%}  "
                  f"{rate:,.0f} samples/s on {world} ranks", flush=True)
            os.makedirs(os.path.dirname(args.checkpoint) or ".", exist_ok=True)
            tmp = args.checkpoint + ".tmp"
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch}, tmp)
            os.replace(tmp, args.checkpoint)   # a crash mid-save never leaves a torn checkpoint
        torchring.barrier()  # nobody starts the next epoch before the checkpoint is complete
    torchring.shutdown()


if __name__ == "__main__":
    main()
