"""Input-pipeline throughput: torchring.data.DataLoader against a plain torch DataLoader with
its defaults, in the same run, on a dataset whose items cost CPU time (decode + augment).

    python benchmarks/dataloader.py                # 2048 items, batch 32, 3 rounds
    python benchmarks/dataloader.py --items 4096 --cost 2 --json bench-data.json
    python benchmarks/dataloader.py --train --device cuda --json bench-data-train.json
    python benchmarks/dataloader.py --train --device cpu --items 256 --rounds 1 --width 8  # dry run

Each item synthesizes a 3x96x96 uint8 "image" from its index (the decode), then crops,
flips, converts and blurs it (the augment); --cost repeats the blur to make items dearer.
Rounds alternate the two loaders; each round times one full epoch after a warm-up epoch
(so persistent workers are already up); the table shows the median samples/s.

--train feeds a training loop instead (defaults: 8192 items, batch 32, cost 4): a small conv net
(three 3x3 Conv2d+ReLU+MaxPool blocks of width, 2x, 4x channels, a Linear head over 10 classes;
SGD, cross-entropy, label = index % 10) on --device, each batch moved with
.to(device, non_blocking=True). Three feeds, the same dataset, batch and model:
  ceiling         one pre-materialized batch already on the device, every step (compute only)
  torch defaults  torch.utils.data.DataLoader(dataset, batch_size, shuffle=True): no workers,
                  pin_memory False
  torchring.data  torchring.data.DataLoader(dataset, batch_size) with all its defaults
busy = (sum over steps of forward+backward+step's time) / (the timed epoch's wall time); on
cuda a step's time is a torch.cuda.Event pair recorded on the current stream around it (read
after the epoch's final synchronize), on cpu the wall clock around it. --width auto (the
default) sizes the model for a data-bound setup the loader can feed: after a load-only epoch
of torchring.data (which starts its persistent workers) it takes the narrowest width (a multiple
of 8 up to 512: doubling from 8, then bisecting) whose compute-only rate is at most
--auto-fraction of that load-only rate, so the device, not the loader, should set the pace if
the loader keeps up while the model trains (a wider model only makes the device the bottleneck).
Warm-up: one training epoch with torchring.data; torch's loader has no workers to start, so
it warms up on 4 batches only (a full epoch would be the run's slowest part). Each round
times the ceiling, torch defaults, torchring.data, one epoch each; medians over rounds.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import sys
import time
from typing import Any, Iterable

import torch
from torch import nn
from torch.utils.data import Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _harness import finish, machine_info, parse_args, print_header, usable_cores  # noqa: E402


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


def throughput_mode(args: argparse.Namespace) -> None:
    """Loaders alone: median samples/s of torch's defaults and torchring.data's over the rounds."""
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


# ---------------------------------------------------------------- --train: a loader feeding a model

def conv_net(width: int) -> nn.Module:
    """Three Conv2d(3x3)+ReLU+MaxPool(2) blocks (width, 2x, 4x channels) and a Linear head, 10 classes."""
    torch.manual_seed(0)
    w = width
    return nn.Sequential(
        nn.Conv2d(3, w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),            # 64x64 -> 32x32
        nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),        # -> 16x16
        nn.Conv2d(2 * w, 4 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),    # -> 8x8
        nn.Flatten(), nn.Linear(4 * w * 8 * 8, 10))


def sync(device: torch.device) -> None:
    """Waits for the device's queued work (nothing to wait for on cpu)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ComputeClock:
    """Time spent in training steps: CUDA event pairs on the current stream, or the cpu's wall clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.pairs: list[tuple[Any, Any]] = []
        self.wall, self.started = 0.0, 0.0

    def start(self) -> None:
        """Marks a step's start (an event recorded on the current stream, or perf_counter)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.pairs.append((event, None))
        else:
            self.started = time.perf_counter()

    def stop(self) -> None:
        """Marks the step's end."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.pairs[-1] = (self.pairs[-1][0], event)
        else:
            self.wall += time.perf_counter() - self.started

    def seconds(self) -> float:
        """The steps' total time; call after the device is synchronized."""
        if self.cuda:
            return sum(a.elapsed_time(b) for a, b in self.pairs) / 1e3
        return self.wall


def train_epoch(model: nn.Module, opt: torch.optim.Optimizer, batches: Iterable[Any],
                device: torch.device, limit: int | None = None) -> tuple[int, float, float]:
    """Trains on `batches` (at most `limit`): samples, wall seconds (to the final sync), compute seconds."""
    clock = ComputeClock(device)
    sync(device)
    start, n = time.perf_counter(), 0
    for x, y in itertools.islice(batches, limit):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        clock.start()
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        clock.stop()
        n += x.shape[0]
    sync(device)
    return n, time.perf_counter() - start, clock.seconds()


def load_rate(loader: torch.utils.data.DataLoader, device: torch.device) -> float:
    """Samples/s of one epoch of `loader` alone (batches moved to the device), past one batch per worker."""
    skip, n, start = max(1, loader.num_workers), 0, time.perf_counter()
    for k, (x, y) in enumerate(loader):
        x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if k + 1 == skip:
            start, n = time.perf_counter(), 0  # the ramp (workers starting, first batches) left out
        else:
            n += x.shape[0]
    sync(device)
    return n / (time.perf_counter() - start)


def resident_batch(dataset: Dataset, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The dataset's first `batch` items, collated and already on the device."""
    x, y = torch.utils.data.default_collate([dataset[i] for i in range(batch)])
    return x.to(device), y.to(device)


def compute_rate(width: int, xy: tuple[torch.Tensor, torch.Tensor], device: torch.device,
                 seconds: float = 0.15) -> float:
    """A quick probe: compute-only samples/s of conv_net(width) on a resident batch (about `seconds`)."""
    model = conv_net(width).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    train_epoch(model, opt, itertools.repeat(xy), device, limit=3)  # kernels chosen, memory cached
    steps, n, wall = 2, 0, 0.0
    while wall < seconds:
        chunk, took, _ = train_epoch(model, opt, itertools.repeat(xy), device, limit=steps)
        n, wall, steps = n + chunk, wall + took, min(2 * steps, 64)
    return n / wall


def pick_width(target: float, xy: tuple[torch.Tensor, torch.Tensor],
               device: torch.device) -> tuple[int, dict[int, float]]:
    """The narrowest width (a multiple of 8, at most 512) whose compute-only rate is at most `target`."""
    probes: dict[int, float] = {}

    def slow_enough(width: int) -> bool:
        """Probes `width`: is its compute-only rate at most the target?"""
        probes[width] = compute_rate(width, xy, device)
        return probes[width] <= target
    lo, hi = 0, 8
    while hi < 512 and not slow_enough(hi):  # doubling: 8, 16, ..., 512
        lo, hi = hi, 2 * hi
    # bisection on multiples of 8 (rate falls about as 1/width^2); none when even 512 is too fast
    while lo and hi - lo > 8 and hi in probes:
        mid = (lo + hi) // 16 * 8
        lo, hi = (lo, mid) if slow_enough(mid) else (mid, hi)
    return hi, probes


def train_mode(args: argparse.Namespace) -> None:
    """Ceiling, torch defaults and torchring.data feeding the same conv net; samples/s and busy fraction."""
    import torchring
    import torchring.data as trd

    began = time.perf_counter()
    device = torch.device(args.device)
    torchring.init()  # world size 1 here; under torchrun each rank gets its share
    dataset = DecodeAugment(args.items, args.cost)
    plain = torch.utils.data.DataLoader(dataset, batch_size=args.batch, shuffle=True)
    ours = trd.DataLoader(dataset, batch_size=args.batch)
    xy = resident_batch(dataset, args.batch, device)
    loaded = load_rate(ours, device)  # torchring.data's workers start here
    probes: dict[int, float] = {}
    if args.width == "auto":
        width, probes = pick_width(args.auto_fraction * loaded, xy, device)
    else:
        width = int(args.width)
    model = conv_net(width).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    train_epoch(model, opt, ours, device)  # warm-up epoch (workers up, kernels chosen)
    train_epoch(model, opt, plain, device, limit=4)  # no workers to start: a few batches
    steps = len(plain)
    feeds = {"ceiling": lambda: itertools.repeat(xy, steps), "torch defaults": lambda: plain,
             "torchring.data": lambda: ours}
    rates: dict[str, list[float]] = {k: [] for k in feeds}
    busy: dict[str, list[float]] = {k: [] for k in feeds}
    for _ in range(args.rounds):
        for name, batches in feeds.items():
            n, wall, compute = train_epoch(model, opt, batches(), device)
            rates[name].append(n / wall)
            busy[name].append(compute / wall)
    defaults = {"ours": {k: getattr(ours, k) for k in ("num_workers", "persistent_workers", "prefetch_factor",
                                                        "pin_memory")},
                "torch": {k: getattr(plain, k) for k in ("num_workers", "pin_memory")}}
    report(args, device, dict(width=width, params=sum(p.numel() for p in model.parameters()),
                              load_only_rate=loaded, auto_probes=probes, steps_per_epoch=steps,
                              loader_defaults=defaults, rates=rates, busy=busy), began)
    torchring.shutdown()


def report(args: argparse.Namespace, device: torch.device, run: dict[str, Any], began: float) -> None:
    """Prints --train's header, settings and markdown table; writes --json."""
    info = machine_info()
    info["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    info["usable_cores"] = usable_cores()
    clock = "GPU busy (CUDA events)" if device.type == "cuda" else "busy (CPU wall clock around compute)"
    rates, busy, loaded, probes = run["rates"], run["busy"], run["load_only_rate"], run["auto_probes"]
    rate = {k: statistics.median(v) for k, v in rates.items()}
    frac = {k: statistics.median(v) for k, v in busy.items()}
    print_header("dataloader --train", info, f"device {info['device']}")
    print(f"{args.items} items (3x64x64 after the crop), batch {args.batch}, cost {args.cost}, conv net width "
          f"{run['width']}{' (auto)' if probes else ''} ({run['params'] / 1e6:.2f}M params), {args.rounds} "
          f"rounds of {run['steps_per_epoch']} steps")
    print("defaults: torchring.data " + ", ".join(f"{k}={v}" for k, v in run["loader_defaults"]["ours"].items())
          + "; torch " + ", ".join(f"{k}={v}" for k, v in run["loader_defaults"]["torch"].items()))
    print(f"torchring.data load-only rate (no model, first epoch past the ramp): {loaded:.0f} samples/s")
    if probes:
        print(f"auto width: narrowest with compute-only rate <= {args.auto_fraction} x {loaded:.0f} = "
              f"{args.auto_fraction * loaded:.0f} samples/s; probes "
              + ", ".join(f"w{w} {r:.0f}" for w, r in probes.items()))
    print(f"\n| feed | samples/s (median) | {clock} (median) | samples/s by round | busy by round |")
    print("|---|---|---|---|---|")
    labels = {"ceiling": f"ceiling: one batch resident on {device.type}",
              "torch defaults": "torch defaults", "torchring.data": "torchring.data defaults"}
    for k in rates:
        print(f"| {labels[k]} | {rate[k]:.0f} | {frac[k]:.3f} | {', '.join(f'{x:.0f}' for x in rates[k])} | "
              f"{', '.join(f'{x:.3f}' for x in busy[k])} |")
    ours, plain, ceiling = rate["torchring.data"], rate["torch defaults"], rate["ceiling"]
    print(f"\nshare of the ceiling's samples/s: torch defaults {plain / ceiling:.2f}, torchring.data "
          f"{ours / ceiling:.2f}; torchring.data / torch defaults = {ours / plain:.2f}x")
    met = "met" if frac["torchring.data"] >= 0.9 else "NOT met"
    print(f"goal {clock} >= 0.9 with torchring.data's defaults: {met} ({frac['torchring.data']:.3f}; "
          f"torch defaults {frac['torch defaults']:.3f})"
          + ("; a GPU goal: on cpu the loader's workers and the model share the cores" if device.type == "cpu" else ""))
    took = time.perf_counter() - began
    print(f"took {took:.1f} s")
    rows = [{"feed": k, "samples_per_s": rates[k], "busy": busy[k], "median_samples_per_s": rate[k],
             "median_busy": frac[k]} for k in rates]
    extra = {k: v for k, v in run.items() if k not in ("rates", "busy")}
    finish(args, info, rows, 0, busy_clock=clock, seconds=took, **extra)


def main() -> None:
    """Parses the arguments and runs the loaders alone, or (--train) feeding a model."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, help="dataset size (default 2048; 8192 with --train)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--cost", type=int, help="blurs per item (default 1; 4 with --train)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--train", action="store_true", help="feed a conv net on --device (see above)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--width", default="auto", help="--train: the conv net's first width, or auto")
    parser.add_argument("--auto-fraction", type=float, default=0.8,
                        help="--width auto: the model's compute-only rate / torchring.data's load-only rate")
    parser.add_argument("--json")
    args = parse_args(parser)  # TORCHRING_BENCH_PARSE_ONLY=1: stops here
    if args.items is None:
        args.items = 8192 if args.train else 2048
    if args.cost is None:
        args.cost = 4 if args.train else 1
    train_mode(args) if args.train else throughput_mode(args)


if __name__ == "__main__":
    main()
