"""Gradient accumulation: communicate once every `--accumulate` micro-batches.

    torchring-run -np 2 examples/accumulate.py --accumulate 4

Inside ``model.no_sync()`` backward only adds to the local gradients; the first backward
outside it averages the accumulated gradients across ranks. The check at the end shows the
result equals one big step on the same samples.
"""

import argparse

import torch
from torch import nn

import torchring


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--accumulate", type=int, default=4)
    args = parser.parse_args()
    torchring.init()
    rank, world = torchring.rank(), torchring.size()
    torch.manual_seed(0)
    model = torchring.wrap(nn.Linear(8, 1))
    reference = nn.Linear(8, 1)
    reference.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    micro = [torch.randn(world, 4, 8, generator=g) for _ in range(args.accumulate)]

    for step, batch in enumerate(micro):
        last = step == args.accumulate - 1
        with model.no_sync(enabled=not last):      # the one-liner: sync on the last micro-step
            (model(batch[rank]).sum() / args.accumulate).backward()

    # Single process, all ranks' micro-batches at once: the same average gradient.
    (reference(torch.cat([b.reshape(-1, 8) for b in micro])).sum() / (args.accumulate * world)).backward()
    torch.testing.assert_close(model.module.weight.grad, reference.weight.grad)
    if rank == 0:
        print(f"{args.accumulate} micro-steps on {world} ranks == one step of the whole batch: ok")
    torchring.shutdown()


if __name__ == "__main__":
    main()
