"""A Horovod training script, moved to torchring by changing its import line and nothing else.

    torchring-run -np 2 python examples/horovod_mnist_style.py           # was: horovodrun -np 2 ...
    torchring-run -np 2 python examples/horovod_mnist_style.py --epochs 5 --fp16-allreduce
    torchrun --standalone --nproc-per-node=2 examples/horovod_mnist_style.py

Everything below is written against Horovod's PyTorch API as its users know it: hvd.init(), a
torch DistributedSampler told hvd.size() and hvd.rank(), the learning rate scaled by the number
of ranks, hvd.broadcast_parameters and hvd.broadcast_optimizer_state from rank 0, the optimizer
wrapped in hvd.DistributedOptimizer with the model's named parameters, metrics averaged over
the ranks with hvd.allreduce, and printing on rank 0 only. The data has MNIST's shape (1x28x28
grey images, 10 classes) but is generated here, so nothing is downloaded: each class is a fixed
random pattern, and a sample is its class's pattern under noise.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import torchring.horovod as hvd  # the only line that differs: import horovod.torch as hvd


def mnist_shaped(samples: int, seed: int, noise: float = 1.0) -> TensorDataset:
    """`samples` 1x28x28 images in 10 classes: a class pattern (the same for every seed) plus noise."""
    patterns = torch.randn(10, 1, 28, 28, generator=torch.Generator().manual_seed(2024))
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (samples,), generator=gen)
    images = patterns[labels] + noise * torch.randn(samples, 1, 28, 28, generator=gen)
    return TensorDataset(images, labels)


class Net(nn.Module):
    """Two convolutions and two linear layers: the classic small MNIST network."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 10, kernel_size=5), nn.MaxPool2d(2), nn.ReLU(),
            nn.Conv2d(10, 20, kernel_size=5), nn.Dropout2d(0.25), nn.MaxPool2d(2), nn.ReLU())
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(320, 50), nn.ReLU(),
                                        nn.Dropout(0.25), nn.Linear(50, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def averaged(value: float, name: str) -> float:
    """`value` averaged over every rank (hvd.allreduce averages by default)."""
    return hvd.allreduce(torch.tensor(value), name=name).item()


def train_epoch(model: nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer,
                epoch: int, log_interval: int) -> float:
    """One pass over this rank's share of the data; the mean loss over every rank."""
    model.train()
    loader.sampler.set_epoch(epoch)  # a different shuffle every epoch, the same on every rank
    total, batches = 0.0, 0
    for i, (images, labels) in enumerate(loader):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()  # the gradients were averaged over the ranks during backward
        total, batches = total + loss.item(), batches + 1
        if log_interval and i % log_interval == 0 and hvd.rank() == 0:
            print(f"epoch {epoch} batch {i}/{len(loader)}: loss {loss.item():.4f}", flush=True)
    return averaged(total / max(batches, 1), "train_loss")


def evaluate(model: nn.Module, loader: DataLoader) -> tuple[float, float]:
    """(loss, accuracy) on the test set, each averaged over the ranks' shares."""
    model.eval()
    loss, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for images, labels in loader:
            logits = model(images)
            loss += F.cross_entropy(logits, labels, reduction="sum").item()
            correct += (logits.argmax(1) == labels).sum().item()
            count += len(labels)
    return averaged(loss / count, "test_loss"), averaged(correct / count, "test_accuracy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--train-size", type=int, default=2048)
    parser.add_argument("--test-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.05, help="for one rank; scaled by hvd.size()")
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--fp16-allreduce", action="store_true", help="send gradients as float16")
    parser.add_argument("--log-interval", type=int, default=0, help="print every N batches (0: never)")
    parser.add_argument("--save", default=None, help="rank 0 writes the final state_dict here")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # one thread per rank: the ranks share this host's cores

    train_set = mnist_shaped(args.train_size, seed=1)
    test_set = mnist_shaped(args.test_size, seed=2)
    # Each rank trains on its own 1/size of the data.
    train_sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank())
    test_sampler = DistributedSampler(test_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    test_loader = DataLoader(test_set, batch_size=256, sampler=test_sampler)

    model = Net()
    # The global batch grows with the ranks, so does the learning rate.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
    # Every rank starts from rank 0's weights and optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression, op=hvd.Average)

    if hvd.rank() == 0:
        print(f"training on {hvd.size()} ranks, {len(train_loader)} batches of {args.batch_size} "
              f"per rank per epoch", flush=True)
    for epoch in range(1, args.epochs + 1):
        train_loss = train_epoch(model, train_loader, optimizer, epoch, args.log_interval)
        test_loss, accuracy = evaluate(model, test_loader)
        if hvd.rank() == 0:
            print(f"epoch {epoch}: train loss {train_loss:.4f}, test loss {test_loss:.4f}, "
                  f"test accuracy {accuracy:.1%}", flush=True)
    if args.save and hvd.rank() == 0:
        torch.save(model.state_dict(), args.save)
    hvd.shutdown()


if __name__ == "__main__":
    main()
