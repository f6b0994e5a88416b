"""What the always-on flight recorder costs: the same jobs with it off (TORCHRING_TRACE=0), on
without the Python lines (TORCHRING_TRACE_FRAMES=0) and on as by default, round by round.

    python benchmarks/trace_overhead.py                      # world 2, 7 rounds
    python benchmarks/trace_overhead.py --rounds 9 --json trace-overhead.json
    python benchmarks/trace_overhead.py --before /tmp/old    # also a checkout without the recorder
    python benchmarks/trace_overhead.py --aa --world 1       # the interleaved measure's own floor

Each round starts the three jobs under torchring-run (in reverse order in odd rounds, so drift
hits them alike). Each job times, on every rank:
  allreduce 4 KiB   torchring.allreduce of 1024 float32 in a loop: the median over 7 trials of
                    20000 calls, µs per call (max over ranks)
  wrap step         a torchring.wrap'ped 4-layer MLP (width 512, batch 32 per rank, SGD): the
                    median of 30 steps after 5 warm-up steps, ms (max over ranks)
  allreduce 4 KiB, interleaved
                    the same allreduce on two more communicators over the same ranks, one
                    recording and one not, in 301 alternating trials of 400 calls: the median
                    of the trials' on/off ratios (a slow spell of the machine hits both alike);
                    once through the engine's call alone, once through torchring.allreduce as a
                    user calls it (its fast path handed the communicator under test)
With --aa neither interleaved communicator records (an A/A check: what the measure reads when
nothing differs; at world 1 no rank waits for another, so the recorder's own cost stands alone).
With --before DIR (a checkout of a commit before the recorder and the wait timing, its engine
built with TORCHRING_CACHE_DIR=DIR/.cache) a fourth job runs that checkout: what everything the
recorder added costs, the always-on wait timing of the stragglers report included.
The table shows each measure's median over the rounds and the median of the per-round ratios
to off (1.00: no cost). A machine that drifts shows it in the per-round spread, printed too.
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
from typing import TYPE_CHECKING

import _harness

if TYPE_CHECKING:  # torch is imported in the ranks only
    import torch

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
    paired = _interleaved(t)
    mine = torch.tensor([statistics.median(trials), statistics.median(steps), *paired], dtype=torch.float64)
    torchring.allreduce(mine, op=torchring.ReduceOp.MAX)
    if torchring.rank() == 0:
        print("RESULT " + json.dumps({"allreduce_us": mine[0].item(), "step_ms": mine[1].item(),
                                      "paired_off_us": mine[2].item(), "paired_on_us": mine[3].item(),
                                      "paired_ratio": mine[4].item(), "public_off_us": mine[5].item(),
                                      "public_on_us": mine[6].item(), "public_ratio": mine[7].item()}))
    torchring.shutdown()


def _interleaved(t: torch.Tensor, pairs: int = 301, calls: int = 400) -> list[float]:
    """[off µs, on µs, median of the pairs' on/off ratios] twice: the 4 KiB allreduce on two
    more communicators over the same ranks, one recording (TORCHRING_TRACE's default) and one
    not, timed in alternating trials of `calls` calls, so that the machine's slow and fast spells
    (they last seconds) fall on both alike; first through the engine's call, then through
    torchring.allreduce (its fast path handed each communicator's call in turn)."""
    import torchring
    from torchring._core import context as _context

    on = 0 if os.environ.get("TORCHRING_BENCH_AA") == "1" else _context.settings().trace or 512  # --aa: both off
    comms, calls_of = {}, {}
    for name, trace in (("off", 0), ("on", on)):
        engine, comms[name] = _harness.world_communicator(f"bench-{name}", trace)
        calls_of[name] = engine.allreduce_now_function(comms[name])
    state, world_call = _context._state, _context._state.allreduce_now
    allreduce = torchring.allreduce
    result: list[float] = []
    try:
        for public in (False, True):
            times: dict[str, list[float]] = {"off": [], "on": []}
            for i in range(pairs):
                for name in (("off", "on") if i % 2 == 0 else ("on", "off")):
                    run = state.allreduce_now = calls_of[name]
                    for _ in range(200):
                        run(t, 0)
                    start = time.perf_counter()
                    if public:
                        for _ in range(calls):
                            allreduce(t)
                    else:
                        for _ in range(calls):
                            run(t, 0)
                    times[name].append((time.perf_counter() - start) / calls * 1e6)
            ratios = [on / off for on, off in zip(times["on"], times["off"])]
            result += [statistics.median(times["off"]), statistics.median(times["on"]), statistics.median(ratios)]
    finally:
        state.allreduce_now = world_call
        for c in comms.values():
            c.shutdown()
    return result


CONFIGS = {"off": {"TORCHRING_TRACE": "0"}, "no lines": {"TORCHRING_TRACE_FRAMES": "0"}, "on": {}}


def job(world: int, config: str, before: str | None = None) -> dict[str, float]:
    """One job of `world` ranks in configuration `config` (CONFIGS, or "before": the checkout `before`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRING_TRACE")}
    root = Path(before) if config == "before" else _ROOT
    env.update(CONFIGS.get(config, {}), PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if config == "before":
        env["TORCHRING_CACHE_DIR"] = str(root / ".cache")
    proc = subprocess.run([sys.executable, "-m", "torchring.run", "-np", str(world), sys.executable, __file__,
                           "--inner"], env=env, capture_output=True, text=True, timeout=600, cwd=root)
    for line in proc.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    raise RuntimeError(f"the job '{config}' failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def main() -> None:
    """Runs the rounds and prints the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", help="also write the rounds here")
    parser.add_argument("--before", help="a checkout without the recorder, timed as a fourth job")
    parser.add_argument("--aa", action="store_true", help="neither interleaved communicator records (A/A)")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = _harness.parse_args(parser)
    if args.inner:
        return inner()
    if args.aa:
        os.environ["TORCHRING_BENCH_AA"] = "1"  # the jobs inherit it
    info = _harness.machine_info()
    _harness.print_header("flight recorder on vs off", info, f"world {args.world}, {args.rounds} rounds")
    configs = (["before"] if args.before else []) + list(CONFIGS)
    base = configs[0]
    rounds = []
    for r in range(args.rounds):
        order = configs if r % 2 == 0 else list(reversed(configs))
        got = {config: job(args.world, config, args.before) for config in order}
        rounds.append(got)
        print(f"round {r}: " + ", ".join(f"{c} {got[c]['allreduce_us']:.3f} us / {got[c]['step_ms']:.3f} ms"
                                         for c in configs) +
              "; interleaved " + ", ".join(f"{c} {got[c]['paired_ratio']:.3f} / {got[c]['public_ratio']:.3f}"
                                            for c in configs if "paired_ratio" in got[c]),
              flush=True)
    print("| measure | " + " | ".join(configs) + " | " +
          " | ".join(f"{c} / {base} [min..max]" for c in configs[1:]) + " |")
    print("|---" * (2 * len(configs)) + "|")
    for key, name, unit in (("allreduce_us", "allreduce 4 KiB", "us"), ("step_ms", "wrap step", "ms")):
        cells = [f"{statistics.median(x[c][key] for x in rounds):.3f} {unit}" for c in configs]
        for c in configs[1:]:
            ratios = [x[c][key] / x[base][key] for x in rounds]
            cells.append(f"{statistics.median(ratios):.3f} [{min(ratios):.3f}..{max(ratios):.3f}]")
        print(f"| {name} | " + " | ".join(cells) + " |")
    # The interleaved recording communicator takes its job's settings: in the "no lines" jobs
    # it records no Python lines (in the others it does), so each configuration gets its rows.
    for c in configs:
        jobs = [x[c] for x in rounds if "paired_ratio" in x[c]]
        for key, name in (("paired", "the engine's call"), ("public", "torchring.allreduce")):
            if not jobs:
                continue
            ratios = [j[f"{key}_ratio"] for j in jobs]
            print(f"| allreduce 4 KiB through {name}, interleaved in the '{c}' jobs (recording / not, {len(jobs)} jobs) | "
                  f"{statistics.median(j[f'{key}_off_us'] for j in jobs):.3f} us | "
                  f"{statistics.median(j[f'{key}_on_us'] for j in jobs):.3f} us | "
                  f"{statistics.median(ratios):.3f} [{min(ratios):.3f}..{max(ratios):.3f}] |")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "world": args.world, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
