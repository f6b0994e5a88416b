"""The smallest collectives, where a call's software path is its whole cost: torchring against
torch.distributed gloo, in the same run.

    python benchmarks/small_ops.py                       # worlds 2 and 3, 5 trials
    python benchmarks/small_ops.py --worlds 2 --trials 7 --json small.json
    python benchmarks/small_ops.py --quick               # smoke run (~20 s)

Each call on one float32 element (int32 for the checks), world by world over the same spawned
ranks (benchmarks/_harness.py), torchring's public call against gloo's through
torch.distributed:
  barrier          torchring.barrier()                    dist.barrier()
  allreduce        torchring.allreduce(t)                 dist.all_reduce(t)
  allreduce async  torchring.allreduce_async(t).wait()    dist.all_reduce(t, async_op=True).wait()
  broadcast        torchring.broadcast(t, 0)              dist.broadcast(t, 0)
  allgather        torchring.allgather(t)                 dist.all_gather(outs, t)
Before timing, every call but the barrier is checked once on integers against the analytic
result (#wrong: elements that differ, summed over ranks); the timed calls run on zeros, so
repeated in-place sums stay exact. Timing is exchange.py's time_calls: calibrate, then --trials
trials of back-to-back calls after a barrier, the max over ranks per trial, the median shown.
ratio = gloo time / torchring time (above 1: torchring is faster).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import (common_args, finish, machine_info, oversubscribed, parse_args,  # noqa: E402
                      print_header, rank_env, reporting, run_world, sum_over_ranks)
from exchange import _stats, time_calls  # noqa: E402

OPS = ("barrier", "allreduce", "allreduce async", "broadcast", "allgather")
LIBS = ("torchring", "gloo")


def _calls(lib: str, world: int, t: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """Each op's call on `t` through `lib`."""
    import torch.distributed as dist
    import torchring

    if lib == "torchring":
        return {"barrier": torchring.barrier, "allreduce": lambda: torchring.allreduce(t),
                "allreduce async": lambda: torchring.allreduce_async(t).wait(),
                "broadcast": lambda: torchring.broadcast(t, 0), "allgather": lambda: torchring.allgather(t)}
    outs = [torch.empty_like(t) for _ in range(world)]
    return {"barrier": dist.barrier, "allreduce": lambda: dist.all_reduce(t),
            "allreduce async": lambda: dist.all_reduce(t, async_op=True).wait(),
            "broadcast": lambda: dist.broadcast(t, 0),
            "allgather": lambda: (dist.all_gather(outs, t), torch.cat(outs))[1]}


def _wrong(lib: str, op: str, rank: int, world: int) -> int:
    """Elements of one checked call on integers that differ from the analytic result (this rank)."""
    if op == "barrier":
        return 0
    t = torch.tensor([rank + 1], dtype=torch.int32)
    got = _calls(lib, world, t)[op]()
    if lib == "gloo" and op != "allgather":  # torch.distributed's calls work in place
        got = t
    if op == "allgather":
        want = torch.arange(1, world + 1, dtype=torch.int32)
    elif op == "broadcast":
        want = torch.tensor([1], dtype=torch.int32)
    else:
        want = torch.tensor([world * (world + 1) // 2], dtype=torch.int32)
    got = got.reshape(-1)
    return int((got != want).sum()) if got.shape == want.shape else int(want.numel())


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    """One rank: join gloo and torchring, check and time every op, rank 0 reports a row per op."""
    os.environ.update(rank_env(rank, world, port))
    with reporting(rank, queue):
        import torch.distributed as dist
        import torchring

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        torchring.init()
        barriers = {"torchring": torchring.barrier, "gloo": dist.barrier}
        for op in OPS:
            row: dict[str, Any] = {"world": world, "op": op}
            for lib in LIBS:
                wrong = sum_over_ranks(_wrong(lib, op, rank, world))
                call = _calls(lib, world, torch.zeros(1))[op]
                times, iters = time_calls(call, barriers[lib], args.trials, args.trial_s)
                row[lib] = _stats(times, iters, wrong, 4)
            if rank == 0:
                queue.put(("row", row))
        torchring.shutdown()
        dist.destroy_process_group()


def main() -> None:
    """Runs every world and prints one table per world."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", default="2,3", help="world sizes (default 2,3)")
    parser.add_argument("--trials", type=int, default=5, help="timed trials per point (default 5)")
    parser.add_argument("--trial-s", type=float, default=0.15, help="target seconds per trial (default 0.15)")
    common_args(parser, quick="world 2, 3 trials of ~0.05 s")
    args = parse_args(parser)
    if args.quick:
        args.worlds, args.trials, args.trial_s = "2", 3, 0.05
    info = machine_info()
    print_header("small operations: torchring vs gloo", info)
    print(f"times are medians of {args.trials} trials, µs per call; ratio = gloo time / torchring time\n")
    rows: list[dict] = []
    for world in map(int, args.worlds.split(",")):
        over = oversubscribed(world)
        print(f"## world {world}{over}\n\n| op | torchring µs | gloo µs | ratio | #wrong |\n|---|---|---|---|---|")

        def on_row(row: dict, over: str = over) -> None:
            rows.append({**row, "oversubscribed": bool(over)})
            tr, gloo = row["torchring"], row["gloo"]
            print(f"| {row['op']} | {tr['time_us']:.2f} | {gloo['time_us']:.1f} | "
                  f"{gloo['time_us'] / tr['time_us']:.1f} | {tr['wrong'] + gloo['wrong']} |", flush=True)

        run_world(world, args, on_row, target=_rank_main)
        print()
    finish(args, info, rows, sum(r[lib]["wrong"] for r in rows for lib in LIBS))


if __name__ == "__main__":
    main()
