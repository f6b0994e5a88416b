"""The lines to add to a single-process training script, numbered (as in the README).

    torchring-run -np 2 examples/minimal.py
    torchrun --standalone --nproc_per_node=2 examples/minimal.py
"""

import torch
from torch import nn

import torchring                                   # (1) import
import torchring.data


def main() -> None:
    torchring.init()                               # (2) join the job (torchrun/SLURM/MPI env)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))
    model = torchring.wrap(model)                  # (3) wrap: gradients are averaged in backward
    data = torch.utils.data.TensorDataset(torch.randn(4096, 20), torch.randint(0, 2, (4096,)))
    loader = torchring.data.DataLoader(data, batch_size=32)       # (4) each rank its share
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * torchring.size())  # (5) scale the lr
    for epoch in range(3):
        for x, y in loader:                        # the sampler moves to the next epoch itself
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        if torchring.rank() == 0:                  # (6) save (and print) on rank 0 only
            torch.save(model.state_dict(), "minimal.pt")
            print(f"epoch {epoch} done on {torchring.size()} ranks")
    torchring.shutdown()


if __name__ == "__main__":
    main()
