"""Images/s of a small CNN under hvd.DistributedOptimizer, torchring.wrap and DDP (gloo), in the same run.

    python benchmarks/horovod_synthetic.py                       # world 2, ResNet-ish 32x32, batch 32/rank
                                                                  # (about 5 minutes on 2 cores)
    python benchmarks/horovod_synthetic.py --json hvd-synth.json  # also every round, machine and commit
    python benchmarks/horovod_synthetic.py --rounds 1 --steps 3 --warmup 1   # smoke run

The measurement of Horovod's synthetic benchmark (a fixed random batch per rank, forward,
cross-entropy, backward, SGD step; images per second), on a CPU-sized model: a ResNet-style
network (a 3x3 stem, three stages of two residual blocks of --width, 2x and 4x channels, batch
norm, average pooling, 10 classes) on --image x --image RGB images, --batch per rank.
Configurations, each its own copy of the same model (same seed), in the same spawned ranks:
  compute  every rank steps its own copy, no communication: the floor for any data-parallel library
  hvd      torch.optim.SGD wrapped in hvd.DistributedOptimizer(named_parameters=...), after
           hvd.broadcast_parameters and hvd.broadcast_optimizer_state: a Horovod script's step
  wrap     torchring.wrap(model) and torch.optim.SGD
  ddp      torch.nn.parallel.DistributedDataParallel over gloo
Each library at its defaults: wrap and DDP broadcast the batch-norm buffers from rank 0 at every
forward, Horovod's optimizer does not (--no-broadcast-buffers turns it off for wrap and DDP too).
Every rank runs torch.set_num_threads(1). Each round runs every configuration: --warmup steps,
a barrier, then --steps steps back to back, timed; a round's time is the max over ranks and its
images/s = world * batch * steps / time. Odd rounds run the configurations in reverse order, so
drift of a shared machine hits all alike. The table shows the median over rounds; the ratios are
medians of per-round ratios (configurations timed back to back in one round compare more fairly
than medians taken apart). Check (#wrong): after each round the synchronized configurations'
parameters must be bitwise the same on every rank (their sum in float64, compared across ranks).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _harness import (common_args, finish, machine_info, oversubscribed, print_header,  # noqa: E402
                      rank_env, reporting, run_world)
from _sync_checks import ratio  # noqa: E402

CONFIGS = ("compute", "hvd", "wrap", "ddp")
SYNCED = ("hvd", "wrap", "ddp")


class Block(nn.Module):
    """Two 3x3 convolutions with batch norm, plus the input (projected when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.skip(x))


def resnet_ish(width: int, classes: int = 10) -> nn.Module:
    """Stem, stages of width/2x/4x channels (two blocks each, stride 2 between), pool, linear."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    cin = width
    for stage, cout in enumerate((width, 2 * width, 4 * width)):
        layers += [Block(cin, cout, 1 if stage == 0 else 2), Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def timed(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
          steps: int, warmup: int, barrier: Callable[[], Any]) -> float:
    """Seconds this rank took for `steps` training steps after `warmup` ones and a barrier."""
    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    for _ in range(warmup):
        step()
    barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return time.perf_counter() - start


def _ddp_buffers(broadcast: bool) -> dict[str, bool]:
    """DDP's keyword for the per-forward buffer broadcast: forward_sync_buffers on newer torch
    (where broadcast_buffers is deprecated), broadcast_buffers before; none for the default."""
    if broadcast:
        return {}
    import inspect

    from torch.nn.parallel import DistributedDataParallel
    newer = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers" if newer else "broadcast_buffers": False}


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    """One rank: join gloo and torchring (through hvd.init), build the four configurations, run
    --rounds rounds; rank 0 reports each round."""
    os.environ.update(rank_env(rank, world, port))
    with reporting(rank, queue):
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        import torchring
        import torchring.horovod as hvd

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        hvd.init()
        gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own batch
        x = torch.randn(args.batch, 3, args.image, args.image, generator=gen)
        y = torch.randint(0, 10, (args.batch,), generator=gen)

        def sgd(model: nn.Module) -> torch.optim.Optimizer:
            return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        plain = resnet_ish(args.width)
        hvd_model = resnet_ish(args.width)
        hvd_opt = sgd(hvd_model)
        hvd.broadcast_parameters(hvd_model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(hvd_opt, root_rank=0)
        hvd_opt = hvd.DistributedOptimizer(hvd_opt, named_parameters=hvd_model.named_parameters())
        wrapped = torchring.wrap(resnet_ish(args.width), broadcast_buffers=args.broadcast_buffers)
        ddp = DistributedDataParallel(resnet_ish(args.width), **_ddp_buffers(args.broadcast_buffers))
        runs = {"compute": (plain, sgd(plain)), "hvd": (hvd_model, hvd_opt),
                "wrap": (wrapped, sgd(wrapped)), "ddp": (ddp, sgd(ddp))}
        params = sum(p.numel() for p in plain.parameters())

        def same_everywhere(model: nn.Module) -> bool:
            total = torch.tensor([sum(p.detach().double().sum().item() for p in model.parameters())],
                                 dtype=torch.float64)
            low, high = total.clone(), total.clone()
            dist.all_reduce(low, op=dist.ReduceOp.MIN)
            dist.all_reduce(high, op=dist.ReduceOp.MAX)
            return bool(low.item() == high.item())

        order = [c for c in CONFIGS if c in args.configs]
        for round_ in range(args.rounds):
            seconds: dict[str, float] = {}
            for name in order if round_ % 2 == 0 else order[::-1]:
                model, opt = runs[name]
                took = torch.tensor([timed(model, opt, x, y, args.steps, args.warmup, dist.barrier)],
                                    dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                seconds[name] = took.item()
            wrong = sum(not same_everywhere(runs[name][0]) for name in order if name in SYNCED)
            if rank == 0:
                images = world * args.batch * args.steps
                queue.put(("row", {"round": round_, "params": params, "wrong": wrong,
                                   "seconds": seconds,
                                   "images_s": {k: images / v for k, v in seconds.items()}}))
        hvd.shutdown()
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--batch", type=int, default=32, help="images per rank and step (default 32)")
    parser.add_argument("--image", type=int, default=32, help="image side in pixels (default 32)")
    parser.add_argument("--width", type=int, default=32, help="channels of the first stage (default 32)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per configuration and round (default 8)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them (default 2)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds (default 7)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {','.join(CONFIGS)}")
    parser.add_argument("--no-broadcast-buffers", dest="broadcast_buffers", action="store_false",
                        help="wrap and DDP do not broadcast buffers at each forward (as hvd)")
    common_args(parser)
    args = parser.parse_args()
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown or not args.configs:
        parser.error(f"--configs: {','.join(unknown) or '(none)'}: choose from {','.join(CONFIGS)}")
    if min(args.world, args.batch, args.image, args.width, args.steps, args.rounds) < 1 or args.warmup < 0:
        parser.error("--world, --batch, --image, --width, --steps and --rounds must be >= 1, --warmup >= 0")
    info = machine_info()
    print_header("horovod synthetic: images/s, hvd.DistributedOptimizer vs torchring.wrap vs DDP-gloo", info)
    over = oversubscribed(args.world)
    print(f"world {args.world}{over}, batch {args.batch}/rank, {args.image}x{args.image} images, "
          f"width {args.width}, {args.steps} steps after {args.warmup} warm-up per round, "
          f"broadcast_buffers={args.broadcast_buffers} for wrap and ddp\n")
    names = [c for c in CONFIGS if c in args.configs]
    print("| round | " + " | ".join(f"{n} img/s" for n in names) + " | #wrong |")
    print("|---|" + "---|" * (len(names) + 1), flush=True)
    rows: list[dict] = []

    def on_row(row: dict) -> None:
        rows.append(row)
        cells = [f"{row['images_s'][n]:.1f}" for n in names]
        print(f"| {row['round']} | " + " | ".join(cells) + f" | {row['wrong']} |", flush=True)

    os.environ["TORCHRING_JOB_ID"] = f"hvd-synthetic-{os.getpid()}"
    run_world(args.world, args, on_row, target=_rank_main)
    if not rows:
        raise SystemExit("no round was reported")
    print(f"\nmodel: {rows[0]['params'] / 1e6:.2f}M parameters; medians over {len(rows)} rounds\n")
    print("| config | images/s | per rank | vs compute |")
    print("|---|---|---|---|")
    summary: dict[str, Any] = {"images_s": {}, "ratios": {}}
    for n in names:
        med = statistics.median(r["images_s"][n] for r in rows)
        summary["images_s"][n] = med
        vs = ratio(rows, n, "compute", "images_s")
        print(f"| {n} | {med:.1f} | {med / args.world:.1f} | {'' if vs is None else f'{vs:.3f}x'} |")
    wanted = [("hvd", "wrap"), ("hvd", "ddp"), ("wrap", "ddp"), ("hvd", "compute"), ("wrap", "compute")]
    ratios = {f"{a}/{b}": ratio(rows, a, b, "images_s") for a, b in wanted}
    summary["ratios"] = {k: v for k, v in ratios.items() if v is not None}
    print("\n" + ", ".join(f"{k} = {v:.3f}" for k, v in summary["ratios"].items()) +
          " (images/s, medians of per-round ratios)")
    if "hvd/wrap" in summary["ratios"]:
        verdict = "meets" if summary["ratios"]["hvd/wrap"] >= 0.95 else "MISSES"
        print(f"hvd.DistributedOptimizer {verdict} the goal of >= 0.95x torchring.wrap's images/s")
    info["summary"] = summary
    finish(args, info, rows, sum(r["wrong"] for r in rows))


if __name__ == "__main__":
    main()
