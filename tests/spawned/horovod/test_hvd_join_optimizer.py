"""hvd.join() with hvd.DistributedOptimizer: ranks with different numbers of batches.

In each epoch rank r trains on ``counts[r]`` integer-valued batches (float64), averaging its
loss with a negotiated hvd.allreduce between backward and step (the joined ranks' negotiation
threads must still answer it), then calls hvd.join(). The reference, computed in every rank,
replays the job in one process: at step t the ranks with a t-th batch are active, their
gradients are summed and divided by the world size (Average: a joined rank adds zeros and still
counts) or just summed (Sum), and one SGD step follows. Checks, per epoch: join() returns the
same rank on every rank, one of those with the most batches; before any broadcast, each rank
holds the replay's parameters after its own number of steps (a joined rank's shadows leave its
model alone) and the averaged losses it saw are the replay's; after
broadcast_parameters(root_rank=join()'s result) every rank holds the replay's final parameters.
Epochs follow each other on the same optimizer (the markers stay matched after a join). Cases: a
rank with no batch in the first epoch (it joins before the optimizer's first sync and takes part
in its agreement: set rank 0 there, whose ready order the others cannot adopt), worlds 2 and 3,
hvd.Sum, and a sparse embedding whose gradients leave the buckets at the first sync.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
from torch import nn

from _checks import Checker, assert_no_failures
from _dist import spawn

LR = 2.0 ** -6  # small enough that 10 steps on these integers stay tame


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 3)
        self.fc2 = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x))


class EmbedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 3, sparse=True)
        self.fc = nn.Linear(3, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(idx))


def integer_init(model: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-1, 2, p.shape, generator=g).double())
    return model


def net_loss(model: nn.Module, rank: int, epoch: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10000 * epoch + 100 * step + rank)
    x = torch.randint(-1, 2, (3, 4), generator=g).double()
    y = torch.randint(-2, 3, (3, 2), generator=g).double()
    return ((model(x) - y) ** 2).sum()


def embed_loss(model: nn.Module, rank: int, epoch: int, step: int) -> torch.Tensor:
    idx = torch.tensor([(3 * rank + step + epoch) % 10, (rank * rank + 2 * step + 1) % 10])
    y = torch.tensor([[rank % 3 - 1.0, 1.0], [2.0, step % 2 - 1.0]], dtype=torch.float64)
    return ((model(idx) - y) ** 2).sum()


Loss = Callable[[nn.Module, int, int, int], torch.Tensor]


def replay(ref: nn.Module, counts: list[int], epoch: int, loss_of: Loss, average: bool
           ) -> tuple[list[list[torch.Tensor]], list[float]]:
    """Runs one epoch on `ref` in this process; the parameters after each step (index 0: at the
    start) and each step's loss as hvd.allreduce(Average) returns it, with zeros from joined ranks."""
    world = len(counts)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    snapshots = [[p.detach().clone() for p in ref.parameters()]]
    losses = []
    for step in range(max(counts)):
        total = [torch.zeros_like(p) for p in ref.parameters()]
        loss_sum = 0.0
        for r in (r for r in range(world) if counts[r] > step):
            ref.zero_grad(set_to_none=True)
            loss = loss_of(ref, r, epoch, step)
            loss.backward()
            loss_sum += loss.item()
            for t, p in zip(total, ref.parameters()):
                if p.grad is not None:
                    t += p.grad.to_dense()
        for t, p in zip(total, ref.parameters()):
            p.grad = t / world if average else t
        opt.step()
        snapshots.append([p.detach().clone() for p in ref.parameters()])
        losses.append(loss_sum / world)
    return snapshots, losses


def same(chk: Checker, what: str, model: nn.Module, want: list[torch.Tensor]) -> None:
    for (name, p), q in zip(model.named_parameters(), want):
        chk.equal(f"{what}: {name}", p.detach(), q, exact=False)


def train(chk: Checker, hvd: Any, rank: int, what: str, make: Callable[[], nn.Module], loss_of: Loss,
          epochs: list[list[int]], op: int, models: int = 1) -> None:
    """The epochs of `models` models of one kind, each with its own optimizer, stepped in turn
    at every batch (see the module docstring)."""
    from torchring.horovod import _join_sync

    nets = [integer_init(make()).double() for _ in range(models)]
    refs = [copy.deepcopy(net) for net in nets]
    opts = [hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=LR), net.named_parameters(), op=op)
            for net in nets]
    for epoch, counts in enumerate(epochs):
        tag = f"{what} epoch {epoch} counts {counts}"
        replays = [replay(ref, counts, epoch, loss_of, op == hvd.Average) for ref in refs]
        for step in range(counts[rank]):
            for m, (net, opt, (_, losses)) in enumerate(zip(nets, opts, replays)):
                opt.zero_grad()
                loss = loss_of(net, rank, epoch, step)
                loss.backward()
                seen = hvd.allreduce(loss.detach(), name=f"loss.{m}").item()
                chk.true(f"{tag}: model {m}: averaged loss at step {step}", abs(seen - losses[step]) < 1e-9,
                         f"{seen} vs {losses[step]}")
                opt.step()
        last = hvd.join()
        everyone = hvd.allgather_object(last)
        chk.true(f"{tag}: join() returns one rank everywhere", everyone == [last] * len(counts),
                 repr(everyone))
        chk.true(f"{tag}: join() returns a rank with the most batches", counts[last] == max(counts),
                 f"got rank {last}")
        # A joined rank counts the syncs it shadowed: every rank's next marker has one number.
        numbers = hvd.allgather_object(_join_sync._markers.count)
        chk.true(f"{tag}: marker numbers after join()", numbers == [numbers[0]] * len(counts), repr(numbers))
        for m, (net, (snapshots, _)) in enumerate(zip(nets, replays)):
            same(chk, f"{tag}: model {m}: own steps only", net, snapshots[counts[rank]])
            hvd.broadcast_parameters(net.state_dict(), root_rank=last)
            same(chk, f"{tag}: model {m}: after the broadcast", net, snapshots[-1])


def _run(rank: int, world: int) -> list[str]:
    import torchring.horovod as hvd

    chk = Checker(rank)
    hvd.init()
    try:
        # Each epoch but the last has a rank that shadows an odd number of syncs.
        if world == 2:
            train(chk, hvd, rank, "Average", Net, net_loss, [[0, 1], [4, 5], [2, 1], [1, 1]], hvd.Average)
            hvd.barrier()
            train(chk, hvd, rank, "sparse", EmbedNet, embed_loss, [[0, 3], [2, 1]], hvd.Average)
        else:
            train(chk, hvd, rank, "Average", Net, net_loss, [[3, 5, 4], [2, 0, 1]], hvd.Average)
            hvd.barrier()
            # Two live optimizers over alike models: a joined rank must shadow the right one's
            # first sync (its agreement), or the next epoch's syncs no longer match.
            train(chk, hvd, rank, "Sum, two models", Net, net_loss, [[1, 0, 2], [1, 1, 1]], hvd.Sum, models=2)
    finally:
        hvd.shutdown()
    return chk.failures


@pytest.mark.parametrize("world", [2, 3])
def test_join_with_distributed_optimizer(world: int) -> None:
    assert_no_failures(spawn(world, _run, world, timeout=120))
