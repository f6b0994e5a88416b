"""Input-pipeline throughput: torchring.data.DataLoader against a plain torch DataLoader with
its defaults, in the same run, on a dataset whose items cost CPU time (decode + augment).

    python benchmarks/dataloader.py                # 2048 items, batch 32, 3 rounds
    python benchmarks/dataloader.py --items 4096 --cost 2 --json bench-data.json

Each item synthesizes a 3x96x96 uint8 "image" from its index (the decode), then crops,
flips, converts and blurs it (the augment); --cost repeats the blur to make items dearer.
Rounds alternate the two loaders; each round times one full epoch after a warm-up epoch
(so persistent workers are already up); the table shows the median samples/s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
from torch.utils.data import Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class DecodeAugment(Dataset):
    """Items that cost CPU time like decoding and augmenting an image."""

    def __init__(self, items: int, cost: int) -> None:
        self.items, self.cost = items, cost
        self.kernel = torch.ones(3, 1, 5, 5) / 25

    def __len__(self) -> int:
        return self.items

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        image = torch.randint(0, 256, (3, 96, 96), dtype=torch.uint8, generator=g)
        top, left = torch.randint(0, 32, (2,)).tolist()
        x = image[:, top:top + 64, left:left + 64].float().div_(255)
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        for _ in range(self.cost):
            x = torch.nn.functional.conv2d(x.unsqueeze(0), self.kernel, padding=2, groups=3)[0]
        return (x - 0.5) / 0.25, i % 10


def epoch_rate(loader: torch.utils.data.DataLoader) -> float:
    """Samples per second over one epoch."""
    start, n = time.perf_counter(), 0
    for x, _ in loader:
        n += x.shape[0]
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--cost", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()

    import torchring
    import torchring.data as trd

    torchring.init()  # world size 1 here; under torchrun each rank gets its share
    dataset = DecodeAugment(args.items, args.cost)
    plain = torch.utils.data.DataLoader(dataset, batch_size=args.batch, shuffle=True)
    ours = trd.DataLoader(dataset, batch_size=args.batch)
    rates: dict[str, list[float]] = {"torch defaults": [], "torchring.data": []}
    for loader in (plain, ours):
        epoch_rate(loader)  # warm-up: workers start, caches fill
    for _ in range(args.rounds):
        rates["torch defaults"].append(epoch_rate(plain))
        rates["torchring.data"].append(epoch_rate(ours))
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"# dataloader: {args.items} items, batch {args.batch}, cost {args.cost}, torch "
          f"{torch.__version__}, {len(os.sched_getaffinity(0))} cores, {datetime.date.today()}")
    print(f"torchring.data defaults: num_workers={ours.num_workers}, persistent_workers="
          f"{ours.persistent_workers}, prefetch_factor={ours.prefetch_factor}, pin_memory={ours.pin_memory}")
    print("| loader | samples/s (median) | rounds |")
    print("|---|---|---|")
    for k, v in rates.items():
        print(f"| {k} | {med[k]:.0f} | {', '.join(f'{x:.0f}' for x in v)} |")
    print(f"\nratio torchring.data / torch defaults = {med['torchring.data'] / med['torch defaults']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rates": rates, "median": med}, f, indent=1)
    torchring.shutdown()


if __name__ == "__main__":
    main()
