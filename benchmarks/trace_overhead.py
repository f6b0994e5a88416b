"""What the always-on flight recorder costs: the same jobs with it on (TORCHRING_TRACE=2000, the
default) and off (TORCHRING_TRACE=0), alternated round by round.

    python benchmarks/trace_overhead.py                      # world 2, 7 rounds
    python benchmarks/trace_overhead.py --rounds 9 --json trace-overhead.json

Each round starts two jobs under torchring-run (off, then on; on, then off in odd rounds, so
drift hits both alike). Each job times, on every rank:
  allreduce 4 KiB   torchring.allreduce of 1024 float32 in a loop: the median over 7 trials of
                    20000 calls, µs per call (max over ranks)
  wrap step         a torchring.wrap'ped 4-layer MLP (width 512, batch 32 per rank, SGD): the
                    median of 30 steps after 5 warm-up steps, ms (max over ranks)
The table shows each measure's median over the rounds and the median of the per-round ratios
on/off (1.00: no cost). A machine that drifts shows it in the per-round spread, printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import _harness

_ROOT = Path(__file__).resolve().parents[1]


def inner() -> None:
    """One job's rank: times the two measures and has rank 0 print them as JSON."""
    import torch  # here: the outer process only starts jobs
    from torch import nn

    import torchring

    torchring.init()
    t = torch.ones(1024)
    for _ in range(2000):
        torchring.allreduce(t)
    trials = []
    for _ in range(7):
        torchring.barrier()
        start = time.perf_counter()
        for _ in range(20000):
            torchring.allreduce(t)
        trials.append((time.perf_counter() - start) / 20000 * 1e6)
    torch.manual_seed(0)
    model = torchring.wrap(nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(512, 512), nn.ReLU())]))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 512)
    steps = []
    for i in range(35):
        start = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if i >= 5:
            steps.append((time.perf_counter() - start) * 1e3)
    mine = torch.tensor([statistics.median(trials), statistics.median(steps)], dtype=torch.float64)
    torchring.allreduce(mine, op=torchring.ReduceOp.MAX)
    if torchring.rank() == 0:
        print("RESULT " + json.dumps({"allreduce_us": mine[0].item(), "step_ms": mine[1].item()}))
    torchring.shutdown()


def job(world: int, trace: str) -> dict[str, float]:
    """One job of `world` ranks with TORCHRING_TRACE=`trace`: its two measures."""
    env = dict(os.environ, TORCHRING_TRACE=trace, PYTHONPATH=str(_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "torchring.run", "-np", str(world), sys.executable, __file__,
                           "--inner"], env=env, capture_output=True, text=True, timeout=600, cwd=_ROOT)
    for line in proc.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    raise RuntimeError(f"the job with TORCHRING_TRACE={trace} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def main() -> None:
    """Runs the rounds and prints the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", help="also write the rounds here")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = _harness.parse_args(parser)
    if args.inner:
        return inner()
    info = _harness.machine_info()
    _harness.print_header("flight recorder on vs off", info, f"world {args.world}, {args.rounds} rounds")
    rounds = []
    for r in range(args.rounds):
        order = ("0", "2000") if r % 2 == 0 else ("2000", "0")
        got = {trace: job(args.world, trace) for trace in order}
        rounds.append({"off": got["0"], "on": got["2000"]})
        print(f"round {r}: allreduce 4 KiB {got['0']['allreduce_us']:.3f} / {got['2000']['allreduce_us']:.3f} us, "
              f"wrap step {got['0']['step_ms']:.3f} / {got['2000']['step_ms']:.3f} ms (off / on)", flush=True)
    print("| measure | off | on | on / off (median of rounds) | per-round on / off |")
    print("|---|---|---|---|---|")
    for key, name, unit in (("allreduce_us", "allreduce 4 KiB", "us"), ("step_ms", "wrap step", "ms")):
        off = statistics.median(x["off"][key] for x in rounds)
        on = statistics.median(x["on"][key] for x in rounds)
        ratios = [x["on"][key] / x["off"][key] for x in rounds]
        print(f"| {name} | {off:.3f} {unit} | {on:.3f} {unit} | {statistics.median(ratios):.3f} | "
              f"{min(ratios):.3f}..{max(ratios):.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "world": args.world, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
