"""Training-step time: torchring.wrap against DistributedDataParallel (gloo), in the same run.

    python benchmarks/train_step.py                    # world 2, 25M-parameter MLP, batch 64/rank
    python benchmarks/train_step.py --world 3 --steps 10 --rounds 3 --json bench-train.json

Configurations, each the same model and per-rank batch, SGD, torch.set_num_threads(1) per rank:
  single        rank 0 alone (the other ranks sleep in a barrier): one process, no communication
  compute       every rank trains its own copy at once, no communication (what the job costs
                without gradient averaging: the floor for any data-parallel library)
  compute+pool  compute, with backward's large allocations served from torchring's gradient
                pool as in a wrapped backward (no communication): separates what the pool
                saves (page faults of fresh gradients) from what communication costs
  ddp           torch.nn.parallel.DistributedDataParallel over gloo, default buckets
  torchring     torchring.wrap(model), default buckets
Each round times every configuration for --steps steps after --warmup steps (in reverse order
on odd rounds, so drift hits all of them alike); a step's time is the max over ranks. The table
shows the median of the per-round medians, and the ratios are medians of per-round ratios:
on a shared machine whose speed drifts, configurations timed back to back in one round compare
more fairly than medians taken apart. "faults" are rank 0's minor page faults per step.
"hidden" is the share of a bare allreduce of the whole gradient (in shared memory, as the
buckets are; median of 3 per round) that the wrapped step did not add on top of the
compute+pool step: 1 - (torchring - compute+pool) / allreduce.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import time
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _harness import parse_args  # noqa: E402
from _models import mlp, timed_steps  # noqa: E402


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    torch.set_num_threads(1)
    import torch.distributed as dist

    import torchring
    from torch.nn.parallel import DistributedDataParallel

    store = dist.TCPStore("127.0.0.1", port, world, False)
    device, backend = torch.device("cpu"), "gloo"
    if args.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl" if torch.cuda.device_count() >= world else "gloo"
    dist.init_process_group(backend, store=dist.PrefixStore(backend, store), rank=rank, world_size=world)
    torchring.init()

    def step_max(times: list[float]) -> float:
        t = torch.tensor([statistics.median(times)], dtype=torch.float64)
        torchring.allreduce(t, torchring.ReduceOp.MAX)
        return t.item()

    names = ("single", "compute", "compute+pool", "ddp", "torchring")
    results: dict[str, list[float]] = {k: [] for k in names}
    faults: dict[str, list[float]] = {k: [] for k in names}
    model = mlp(args.width).to(device)
    ddp = DistributedDataParallel(mlp(args.width).to(device),
                                  device_ids=[device.index] if device.type == "cuda" else None)
    wrapped = torchring.wrap(mlp(args.width).to(device))
    numel = sum(p.numel() for p in model.parameters())
    # Where wrap's buckets live: the shared-memory arena on CPU (the zero-copy allreduce).
    flat = torchring.empty(numel) if device.type == "cpu" else torch.empty(numel, device=device)
    flat.fill_(1)
    bare = []

    def single() -> tuple[float, float]:
        times, fault = (timed_steps(model, args.batch, args.width, args.steps, args.warmup,
                                    lambda: None) if rank == 0 else ([0.0], 0.0))
        torchring.barrier()
        return torchring.broadcast_object(statistics.median(times), 0), fault

    def together(m: nn.Module, pooled: bool = False) -> Callable[[], tuple[float, float]]:
        def run() -> tuple[float, float]:
            times, fault = timed_steps(m, args.batch, args.width, args.steps, args.warmup,
                                       torchring.barrier, pooled)
            return step_max(times), fault
        return run

    configs = [("single", single), ("compute", together(model)),
               ("compute+pool", together(model, pooled=True)), ("ddp", together(ddp)),
               ("torchring", together(wrapped))]
    for round_ in range(args.rounds):
        # Odd rounds run the configurations in reverse, so slow drift of a shared machine
        # does not favour whichever runs first.
        for name, run in configs if round_ % 2 == 0 else configs[::-1]:
            step, fault = run()
            results[name].append(step)
            faults[name].append(fault)
        times = []
        for _ in range(3):
            torchring.barrier()
            start = time.perf_counter()
            torchring.allreduce(flat, torchring.ReduceOp.AVG)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        bare.append(step_max(times))
    stats = wrapped.bucket_stats()
    if rank == 0:
        out.put({"results": results, "faults": faults, "bare_allreduce": bare, "buckets": stats,
                 "params": sum(p.numel() for p in model.parameters())})
    torchring.shutdown()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64, help="per-rank batch")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: the peer is DDP over NCCL (gloo when ranks share a GPU)")
    parser.add_argument("--json", help="write the results here")
    args = parse_args(parser)

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, args.world + 1, True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    os.environ["TORCHRING_JOB_ID"] = f"train-step-{os.getpid()}"
    procs = [ctx.Process(target=rank_main, args=(r, args.world, port, args, out)) for r in range(args.world)]
    for p in procs:
        p.start()
    report = out.get(timeout=3600)
    for p in procs:
        p.join()
    del store
    med = {k: statistics.median(v) for k, v in report["results"].items()}

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(report["results"][a], report["results"][b]))
    bare = statistics.median(report["bare_allreduce"])
    hidden = 1 - (ratio("torchring", "compute+pool") - 1) * med["compute+pool"] / bare
    cores = len(os.sched_getaffinity(0))
    print(f"# train step: MLP width {args.width} ({report['params'] / 1e6:.2f}M params), batch "
          f"{args.batch}/rank, world {args.world}{' (oversubscribed)' if args.world > cores else ''}, "
          f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {cores} cores, "
          f"{datetime.date.today()}")
    print("| config | step (ms) | rounds (ms) | vs compute (per-round ratio) | faults/step |")
    print("|---|---|---|---|---|")
    for k, v in report["results"].items():
        rounds = ", ".join(f"{x * 1e3:.1f}" for x in v)
        print(f"| {k} | {med[k] * 1e3:.1f} | {rounds} | {ratio(k, 'compute'):.3f}x | "
              f"{statistics.median(report['faults'][k]):.0f} |")
    print(f"\ntorchring / ddp = {ratio('torchring', 'ddp'):.3f}, torchring / single = "
          f"{ratio('torchring', 'single'):.3f}, torchring / compute = "
          f"{ratio('torchring', 'compute'):.3f}, torchring / compute+pool = "
          f"{ratio('torchring', 'compute+pool'):.3f}, ddp / compute = {ratio('ddp', 'compute'):.3f} "
          f"(medians of per-round ratios), bare allreduce of the gradient = {bare * 1e3:.1f} ms, "
          f"hidden = {hidden:.0%}")
    print("buckets of the last step:", [(b["bucket"], round(b["bytes"] / 2**20, 1),
                                         round(b["launch_before_backward_end_ms"], 1),
                                         round(b["wait_ms"], 1)) for b in report["buckets"]],
          "(index, MiB, launched ms before backward end, wait ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "median_s": med, "bare_allreduce_s": bare,
                       "ratios": {"torchring/ddp": ratio("torchring", "ddp"),
                                  "torchring/single": ratio("torchring", "single"),
                                  "torchring/compute": ratio("torchring", "compute"),
                                  "torchring/compute+pool": ratio("torchring", "compute+pool"),
                                  "ddp/compute": ratio("ddp", "compute")}, **report}, f, indent=1)


if __name__ == "__main__":
    main()
