"""A Horovod elastic training script on torchring: a killed rank costs only the steps since the
last commit.

    torchring-run -np 2 --max-restarts 3 python examples/horovod_elastic.py
    torchring-run -np 2 --max-restarts 1 python examples/horovod_elastic.py --kill-at-step 10

Written as for ``horovod.torch`` (only the import differs): the model, the optimizer, the sampler
and the counters live in an ``hvd.elastic.TorchState``, the training function is wrapped in
``hvd.elastic.run``, and the state is committed every few steps. When a rank dies, the launcher
restarts every rank (``--max-restarts``); the wrapped function then starts again from the newest
commit, and the ElasticSampler serves only the samples of the epoch not yet trained on, so the
job ends with the same model as a run that never failed. The data is generated (nothing is
downloaded) and every operation is deterministic.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
from torch import nn

import torchring.horovod as hvd


def make_data(size: int, dim: int = 8, classes: int = 4) -> torch.utils.data.TensorDataset:
    """Gaussian inputs labelled by a fixed random linear teacher."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(size, dim, generator=gen)
    y = (x @ torch.randn(dim, classes, generator=gen)).argmax(1)
    return torch.utils.data.TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--lr", type=float, default=0.05, help="for one rank; scaled by the world size")
    parser.add_argument("--commit-every", type=int, default=4, help="steps between commits")
    parser.add_argument("--save", default=None, help="rank 0 writes the final model's state_dict here")
    parser.add_argument("--kill-at-step", type=int, default=None,
                        help="testing: rank 1 kills itself before this step on the first attempt")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(0)
    dataset = make_data(args.samples)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=7)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    def scale_lr() -> None:  # after a restart the world may have another size
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, step=0)
    state.register_reset_callbacks([scale_lr])
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        if state.step and hvd.rank() == 0:
            print(f"resumed from the commit after step {state.step} (epoch {state.epoch}) "
                  f"on {hvd.size()} ranks", flush=True)
        while state.epoch < args.epochs:
            for x, y in loader:
                if state.step == args.kill_at_step and hvd.rank() == 1 and first_attempt:
                    os.kill(os.getpid(), signal.SIGKILL)
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                sampler.record_batch(0, args.batch_size)
                state.step += 1
                if state.step % args.commit_every == 0:
                    state.commit()
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()
            if hvd.rank() == 0:
                print(f"epoch {state.epoch - 1} done at step {state.step}: loss {loss.item():.4f}",
                      flush=True)

    train(state)
    if args.save and hvd.rank() == 0:
        torch.save(model.state_dict(), args.save)
    hvd.shutdown()


if __name__ == "__main__":
    main()
