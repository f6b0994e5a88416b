"""torchft's cross-replica allreduce on torchring's process group against torchft's gloo group.

    python benchmarks/torchft_allreduce.py                      # 2 replicas, 64 MiB, 3 repeats
    python benchmarks/torchft_allreduce.py --replicas 3 --mib 16 --json tft.json

Each replica group is one process (torchft's replica_id 0..N-1) with a torchft Manager, as a
torchft job has: a Lighthouse started here computes the quorum, the Manager configures the
process group (ProcessGroupTorchring or torchft's ProcessGroupGloo) under a fresh store
prefix, and every step is ``start_quorum()``, ``manager.allreduce(grad).wait()`` (torchft's
averaging allreduce: a SUM on the process group, then the division), ``should_commit()``.
Only the allreduce's wait is timed; the quorum and the commit are the same for both groups.
A second level times the process group's own allreduce (a SUM, configured once on a store
served here), without the Manager and its division, each step after a barrier so that the
replicas start it together (at the Manager level a replica's time includes waiting for a
slower one to arrive, as in training). Each step's tensor is integer-valued
(replica r holds r + step + 1), so the sum and the average are exact and checked on every
replica. Each replica process runs with OMP_NUM_THREADS=1 (unless set), as torchrun gives its
ranks. Both process groups run in the same run, alternately, and the table gives the
median step time of each and the ratio gloo / torchring per level.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue as queue_module
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import machine_info, parse_args, print_header  # noqa: E402

GROUPS = ("torchring", "gloo")


def replica(kind: str, level: str, replica_id: int, replicas: int, where: str, mib: int, steps: int,
            queue: Any) -> None:
    """One replica group: `steps` timed allreduces on `kind`'s process group, through a Manager
    (`where`: the Lighthouse) or, at level "pg", on the group alone (`where`: host:port/prefix)."""
    import torch
    from torch._C._distributed_c10d import AllreduceOptions, BarrierOptions
    from torchft import Manager
    from torchft.process_group import ProcessGroupGloo

    from torchring.elastic.torchft import ProcessGroupTorchring

    manager = None
    times: list[float] = []
    wrong = 0
    if level == "pg":
        try:
            pg = ProcessGroupTorchring() if kind == "torchring" else ProcessGroupGloo()
            pg.configure(where, str(replica_id), replica_id, replicas)
            grad = torch.empty(mib * 2**20 // 4, dtype=torch.float32)
            for step in range(steps + 1):  # step 0 warms up: not timed
                grad.fill_(replica_id + step + 1)
                pg.barrier(BarrierOptions()).wait()  # both start together: no fill skew in the time
                start = time.perf_counter()
                pg.allreduce([grad], AllreduceOptions()).wait()  # SUM
                elapsed = time.perf_counter() - start
                wrong += int((grad != sum(r + step + 1 for r in range(replicas))).sum())
                if step:
                    times.append(elapsed)
            pg.shutdown()
            queue.put((replica_id, times, wrong, ""))
        except BaseException as e:  # reported to the parent, which fails the run
            queue.put((replica_id, [], wrong, f"{type(e).__name__}: {e}"))
        return
    try:
        # The replica group's own store (torchft's MASTER_ADDR/PORT): the Manager's client of it
        # hands each quorum's process group a fresh prefix.
        store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        pg = ProcessGroupTorchring() if kind == "torchring" else ProcessGroupGloo()
        manager = Manager(pg=pg, min_replica_size=replicas, load_state_dict=lambda _: None,
                          state_dict=lambda: {}, replica_id=str(replica_id), store_addr="127.0.0.1",
                          store_port=store.port, rank=0, world_size=1, lighthouse_addr=where,
                          port=0, timeout=timedelta(seconds=60), use_async_quorum=False)
        grad = torch.empty(mib * 2**20 // 4, dtype=torch.float32)
        for step in range(steps + 1):  # step 0 forms the group and warms up: not timed
            manager.start_quorum()
            grad.fill_(replica_id + step + 1)
            start = time.perf_counter()
            manager.allreduce(grad).wait()
            elapsed = time.perf_counter() - start
            expected = sum(r + step + 1 for r in range(replicas)) / replicas
            wrong += int((grad != expected).sum())
            if not manager.should_commit():
                raise RuntimeError(f"replica {replica_id}: step {step} did not commit on {kind}")
            if step:
                times.append(elapsed)
        queue.put((replica_id, times, wrong, ""))
    except BaseException as e:  # reported to the parent, which fails the run
        queue.put((replica_id, [], wrong, f"{type(e).__name__}: {e}"))
    finally:
        if manager is not None:
            manager.shutdown(wait=False)


def run_once(kind: str, level: str, args: argparse.Namespace) -> tuple[float, int]:
    """(median over steps of the slowest replica's allreduce time, wrong elements) for one group
    kind at one level ("manager": torchft's Manager.allreduce; "pg": the process group alone)."""
    import uuid

    import torch.distributed as dist
    from torchft._torchft import LighthouseServer  # only when the benchmark runs

    if level == "manager":
        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=args.replicas)
        where = lighthouse.address()
    else:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        where = f"127.0.0.1:{store.port}/{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=replica, args=(kind, level, r, args.replicas, where, args.mib,
                                               args.steps, queue)) for r in range(args.replicas)]
    for p in procs:
        p.start()
    results = []
    deadline = time.monotonic() + 600
    while len(results) < len(procs):
        try:
            results.append(queue.get(timeout=1.0))
        except queue_module.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise SystemExit(f"{kind}: a replica exited with {dead} before reporting, or 600 s passed")
    for p in procs:
        p.join(timeout=60)
    if level == "manager":
        lighthouse.shutdown()
    errors = [f"replica {r}: {err}" for r, _, _, err in results if err]
    if errors:
        raise SystemExit(f"{kind}: " + "; ".join(errors))
    per_step = [max(times[i] for _, times, _, _ in results) for i in range(args.steps)]
    return statistics.median(per_step), sum(w for _, _, w, _ in results)


def main() -> None:
    """Runs both process groups --repeats times, alternately, and prints medians and the ratio."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Lighthouse and Managers: no per-step lines
    # One compute thread per replica process, as torchrun and torchring-run give each rank when
    # several share a host: idle OpenMP threads spinning after fill_ would take the cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2, help="replica groups (one process each)")
    parser.add_argument("--mib", type=int, default=64, help="allreduce size in MiB (float32)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each group, alternating")
    parser.add_argument("--json", help="write the machine, arguments and results here")
    args = parse_args(parser)
    info = machine_info()
    from importlib.metadata import version

    print_header(f"torchft allreduce: {args.replicas} replicas, {args.mib} MiB float32", info,
                 f"torchft {version('torchft')}")
    levels = ("manager", "pg")
    medians: dict[str, dict[str, list[float]]] = {lv: {k: [] for k in GROUPS} for lv in levels}
    wrong = 0
    for _ in range(args.repeats):
        for level in levels:
            for kind in GROUPS:
                seconds, bad = run_once(kind, level, args)
                medians[level][kind].append(seconds)
                wrong += bad
    ratios = {}
    print(f"{'level':<34} {'group':<10} {'median ms':>10} {'GB/s':>8}  runs (ms)")
    for level, title in (("manager", "Manager.allreduce (AVG)"), ("pg", "process group allreduce (SUM)")):
        ring, gloo = (statistics.median(medians[level][k]) for k in GROUPS)
        for kind, value in (("torchring", ring), ("gloo", gloo)):
            runs = " ".join(f"{v * 1e3:.1f}" for v in medians[level][kind])
            print(f"{title:<34} {kind:<10} {value * 1e3:>10.1f} {args.mib * 2**20 / value / 1e9:>8.2f}  {runs}")
        ratios[level] = gloo / ring
        print(f"{title:<34} gloo / torchring = {gloo / ring:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "args": vars(args), "medians_s": medians, "ratios": ratios}, f, indent=1)
    if wrong:
        raise SystemExit(f"{wrong} wrong elements")


if __name__ == "__main__":
    main()
