"""What a lost rank costs, and what a new one costs: in-process recovery and growth
(torchring.elastic) against the restart path (torch's agent), the same hvd.elastic job in the
same run.

    python benchmarks/recovery.py                       # 4 ranks, 10 s start-up, rank 2 killed at step 40
    python benchmarks/recovery.py --startup-s 2 --world 3 --json rec.json
    python benchmarks/recovery.py --grow                # 3 ranks, a 4th added at step 40

The job (this file with --rank-main) is hvd.elastic training of an MLP: hvd.elastic.TorchState,
a commit every --commit-every steps, each gradient summed with hvd.allreduce. Every process
first sleeps --startup-s seconds: the start-up of a real job (interpreter, imports, model
build, data-loader workers, checkpoint load), paid again by every process a restart starts.
Rank --victim SIGKILLs itself at step --kill-at of its first run.

- in process: the ranks are started here (no launcher agent); the survivors restore the last
  commit, re-form a world of N-1 and go on.
- restart: torchring-run (torch's elastic agent) stops every rank and starts N again, which
  resume from the commit on disk.

Each rank logs the wall time of every completed step. Recovery time = from the kill to the
moment every rank of the new world has completed a step; steps redone = the steps between the
last commit and the kill, trained twice. The table shows the median of --repeats runs of each.

--grow: --world - 1 ranks train; at step --kill-at rank 0 writes grow.json, and one more process
starts (paying the start-up like any other).
- in process: torchring-run --min-np/--max-np with a discovery script that offers the extra
  slot once grow.json exists; the newcomer joins at the members' next commit.
- restart: what torch's agent does when a node joins (torchrun --nnodes=MIN:MAX restarts every
  worker): the job ends at that step after its commit, and torchring-run -np --world starts
  every rank again. (Two torchrun agents on one host, 3 + 1 or 2 + 2 ranks with the c10d
  rendezvous, did not get past the second round here, torch 2.13: the agents wait for each
  other's role_info keys until their 60 s timeout. So the restart is made by hand, without
  the rendezvous rounds: a lower bound on the agent's cost.)
Measured: from the new process's start to its first step, and the stall: the longest time
after the growth step in which no rank completed a step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import machine_info, parse_args, print_header  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rank_main(args: argparse.Namespace) -> None:
    """One rank of the job: start-up, hvd.elastic training, a line per completed step."""
    started = time.time()
    time.sleep(args.startup_s)
    import torch

    import torchring.horovod as hvd

    torch.manual_seed(0)  # the model is part of the start-up, built before the process joins
    model = torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.ReLU(),
                                torch.nn.Linear(args.width, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    hvd.init()
    first_run = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    state = hvd.elastic.TorchState(model, optimizer, step=0)
    log = open(os.path.join(args.out, f"steps-{os.getpid()}.jsonl"), "a")
    log.write(json.dumps({"start": started, "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")}) + "\n")

    @hvd.elastic.run
    def train(state: Any) -> None:
        g = torch.Generator().manual_seed(1000 + hvd.rank())
        full_from = state.step  # growth: once the world is whole, 20 steps more (the newcomer's too)

        def more() -> bool:
            if not args.grow:
                return state.step < args.steps
            return hvd.size() < args.world or state.step < max(args.steps, full_from + 20)

        while more():
            if first_run and hvd.rank() == args.victim and state.step == args.kill_at and hvd.size() == args.world:
                with open(os.path.join(args.out, "killed.json"), "w") as f:
                    json.dump({"t": time.time(), "step": state.step}, f)
                os.kill(os.getpid(), signal.SIGKILL)
            grow_file = os.path.join(args.out, "grow.json")
            if args.grow and hvd.rank() == 0 and state.step == args.kill_at and not os.path.exists(grow_file):
                with open(grow_file, "w") as f:
                    json.dump({"t": time.time(), "step": state.step}, f)
            if args.stop_at_grow and state.step == args.kill_at:
                return  # the restart path: every rank ends here, and the job starts again one larger
            x = torch.randn(args.batch, args.width, generator=g)
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            for p in model.parameters():
                p.grad.copy_(hvd.allreduce(p.grad, op=hvd.Sum))
            optimizer.step()
            state.step += 1
            log.write(json.dumps({"t": time.time(), "step": state.step, "size": hvd.size()}) + "\n")
            log.flush()
            if state.step % args.commit_every == 0:
                state.commit()

    train(state)
    hvd.shutdown()


def _rank_argv(args: argparse.Namespace, out: str) -> list[str]:
    return [os.path.abspath(__file__), "--rank-main", "--out", out, "--startup-s", str(args.startup_s),
            "--world", str(args.world), "--victim", str(args.victim), "--kill-at", str(args.kill_at),
            "--steps", str(args.steps), "--commit-every", str(args.commit_every), "--width", str(args.width),
            "--batch", str(args.batch)] + (["--grow"] if args.grow else [])


def run_in_process(args: argparse.Namespace, out: str) -> None:
    """The ranks started here, the store hosted here (as a launcher agent would host it)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=300),
                          wait_for_workers=False)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_", "TORCHELASTIC_"))}
    procs, job = [], f"recovery-{os.getpid()}-{time.time():.0f}"
    for rank in range(args.world):
        env = dict(base, RANK=str(rank), WORLD_SIZE=str(args.world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(args.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                   TORCHELASTIC_USE_AGENT_STORE="True", TORCHRING_JOB_ID=job, TORCHRING_TIMEOUT="30",
                   PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, *_rank_argv(args, out)], env=env))
    codes = [p.wait(timeout=600) for p in procs]
    if sorted(codes) != sorted([0] * (args.world - 1) + [-signal.SIGKILL]):
        raise SystemExit(f"in-process run: exit codes {codes}")


def run_restart(args: argparse.Namespace, out: str) -> None:
    """torchring-run with --max-restarts 1: torch's agent restarts every rank."""
    env = dict(os.environ, PYTHONPATH=ROOT, TORCHRING_ELASTIC_DIR=os.path.join(out, "commits"))
    cmd = [sys.executable, "-m", "torchring.run", "-np", str(args.world), "--max-restarts", "1",
           *_rank_argv(args, out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"restart run: exit {done.returncode}\n{done.stdout[-3000:]}{done.stderr[-3000:]}")


def grow_in_process(args: argparse.Namespace, out: str) -> None:
    """torchring-run's elastic mode: the discovery script offers one more slot once grow.json exists."""
    env = dict(os.environ, PYTHONPATH=ROOT, TORCHRING_TIMEOUT="30", OMP_NUM_THREADS="1")
    grow = os.path.join(out, "grow.json")
    script = (f"if [ -f {grow} ]; then echo localhost:{args.world}; else echo localhost:{args.world - 1}; fi")
    cmd = [sys.executable, "-m", "torchring.run", "--min-np", str(args.world - 1), "--max-np", str(args.world),
           "--host-discovery-script", script, "--discovery-interval", "0.2", *_rank_argv(args, out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"in-process growth: exit {done.returncode}\n{done.stdout[-3000:]}{done.stderr[-3000:]}")


def grow_restart(args: argparse.Namespace, out: str) -> None:
    """The restart path for a new rank, as torch's agent takes it (--nnodes=MIN:MAX restarts every
    worker when a node joins): the job of --world - 1 ranks commits and ends at the growth step,
    and torchring-run -np --world starts every rank again."""
    env = dict(os.environ, PYTHONPATH=ROOT, TORCHRING_ELASTIC_DIR=os.path.join(out, "commits"),
               TORCHRING_TIMEOUT="30", OMP_NUM_THREADS="1")
    for world, extra in ((args.world - 1, ["--stop-at-grow"]), (args.world, [])):
        cmd = [sys.executable, "-m", "torchring.run", "-np", str(world), *_rank_argv(args, out), *extra]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise SystemExit(f"restart growth, world {world}: exit {done.returncode}\n"
                             f"{done.stdout[-3000:]}{done.stderr[-3000:]}")


def measure_growth(out: str, world: int) -> dict[str, float]:
    """From the new process's start to its first step, and the longest time after grow.json in
    which no rank completed a step (the stall the growth cost the job)."""
    with open(os.path.join(out, "grow.json")) as f:
        grown = json.load(f)["t"]
    starts, steps = [], []
    for name in os.listdir(out):
        if name.startswith("steps-"):
            with open(os.path.join(out, name)) as f:
                lines = [json.loads(line) for line in f]
            starts += [(e["start"], name) for e in lines if "start" in e]
            steps += [(e["t"], e["size"], name) for e in lines if "step" in e]
    new_start, new_log = max(starts)  # the process started last: the newcomer (or the second node's rank)
    new_first = min(t for t, _, name in steps if name == new_log and t > new_start)
    times = sorted({t for t, _, _ in steps if t > grown - 1.0})
    stall = max(b - a for a, b in zip(times, times[1:])) if len(times) > 1 else float("nan")
    if not any(size == world for _, size, _ in steps):
        raise SystemExit(f"no step ran in a world of {world}")
    return {"newcomer_s": new_first - new_start, "stall_s": stall}


def measure(out: str, world_after: int) -> dict[str, float]:
    """Recovery time and steps redone, from the kill record and the ranks' step logs."""
    with open(os.path.join(out, "killed.json")) as f:
        killed = json.load(f)
    logs = []
    for name in os.listdir(out):
        if name.startswith("steps-"):
            with open(os.path.join(out, name)) as f:
                logs.append([e for e in map(json.loads, f) if "step" in e])  # not the start records
    before = max(e["step"] for log in logs for e in log if e["t"] < killed["t"])
    after = [[e["t"] for e in log if e["t"] > killed["t"]] for log in logs]
    firsts = [min(times) for times in after if times]
    if len(firsts) < world_after:
        raise SystemExit(f"{len(firsts)} ranks stepped after the kill, expected {world_after}")
    resumed = min(e["step"] for log in logs for e in log if e["t"] > killed["t"]) - 1
    return {"recovery_s": max(firsts) - killed["t"], "steps_redone": before - resumed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--startup-s", type=float, default=10.0, help="start-up each process pays (default 10)")
    parser.add_argument("--victim", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=40)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--commit-every", type=int, default=5)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--grow", action="store_true", help="add a rank at --kill-at instead of killing one")
    parser.add_argument("--stop-at-grow", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parse_args(parser)
    if args.rank_main:
        return rank_main(args)
    info = machine_info()
    if args.grow:
        return main_grow(args, info)
    print_header(f"recovery: in process vs restart, {args.world} ranks, start-up {args.startup_s:.0f} s", info)
    results: dict[str, list[dict[str, float]]] = {"in process": [], "restart": []}
    for _ in range(args.repeats):
        for name, run, after in (("in process", run_in_process, args.world - 1), ("restart", run_restart, args.world)):
            with tempfile.TemporaryDirectory(prefix="torchring-recovery-") as out:
                run(args, out)
                results[name].append(measure(out, after))
    print("\n| path | world after | recovery s (median) | runs | steps redone |\n|---|---|---|---|---|")
    med = {}
    for name, runs in results.items():
        med[name] = statistics.median(r["recovery_s"] for r in runs)
        after = args.world - 1 if name == "in process" else args.world
        times = ", ".join(f"{r['recovery_s']:.2f}" for r in runs)
        redone = ", ".join(str(int(r["steps_redone"])) for r in runs)
        print(f"| {name} | {after} | {med[name]:.2f} | {times} | {redone} |")
    print(f"\nrestart / in process = {med['restart'] / med['in process']:.1f}x (goal >= 10x at a 10 s start-up)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "args": vars(args), "results": results}, f, indent=1)


def main_grow(args: argparse.Namespace, info: dict[str, Any]) -> None:
    """--grow: a rank added in process against torch's restart, --repeats runs each."""
    args.victim = -1
    print_header(f"growth: in process vs restart, {args.world - 1} -> {args.world} ranks, start-up "
                 f"{args.startup_s:.0f} s", info)
    results: dict[str, list[dict[str, float]]] = {"in process": [], "restart": []}
    for _ in range(args.repeats):
        for name, run in (("in process", grow_in_process), ("restart", grow_restart)):
            with tempfile.TemporaryDirectory(prefix="torchring-growth-") as out:
                run(args, out)
                results[name].append(measure_growth(out, args.world))
    print("\n| path | new process: start to first step, s (median) | runs | the job's longest stall, s (median) "
          "| runs |\n|---|---|---|---|---|")
    stall = {}
    for name, runs in results.items():
        new = statistics.median(r["newcomer_s"] for r in runs)
        stall[name] = statistics.median(r["stall_s"] for r in runs)
        news = ", ".join(f"{r['newcomer_s']:.2f}" for r in runs)
        stalls = ", ".join(f"{r['stall_s']:.2f}" for r in runs)
        print(f"| {name} | {new:.2f} | {news} | {stall[name]:.2f} | {stalls} |")
    print(f"\nthe job's stall: restart / in process = {stall['restart'] / stall['in process']:.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
