"""Allreduce across 2-16 hosts: torchring (chosen and each forced algorithm) vs gloo vs Open MPI.

    python benchmarks/scaleout.py                          # 2,4,8,16 hosts, D = 200 us, 4 B..1 MiB
    python benchmarks/scaleout.py --latency-us 200 --rate 1gbit --sizes 4,8K,1M,16M --json so.json
    python benchmarks/scaleout.py --hosts 16 --latency-us 200 --sizes 4,64,1K,8K --trials 7
    python benchmarks/scaleout.py --quick                  # 4 and 16 hosts, 4 B and 8 KiB

Needs root (network namespaces, TUN devices), iproute2 and a C compiler (the latency router);
Open MPI through mpi4py for the `mpi` column (`pip install -e '.[bench]'`), else it is left out
and the run says why. Not run in CI.

Method. The hosts are tests/support/_hosts.py's simulated hosts with a one-way link latency of
--latency-us D (a userspace router between the hosts' TUN devices forwards every packet after D
us: every library's traffic pays it alike; tc has no netem here) and, with --rate, every host's
egress shaped by tc. One job per host count: --per-host ranks in each host (env:// rendezvous at
host 0); every rank joins gloo and torchring. Per size: an exact check of every library on
integer data, a warm-up that sets `iters` so a trial takes about --trial-s, then --trials trials
interleaved between the libraries (the order rotates per trial): torchring with its cost model's
choice ("tr auto", the algorithm named beside it) and with each algorithm forced (switched
between trials on every rank alike), and gloo. A trial's time is the max over ranks of the mean
per call; the table shows the median over trials. "tr cpu/cores" is the CPU every rank's process
spent per "tr auto" call (user and system time, summed over the ranks; the median trial) over this
machine's cores: where the test hosts share a few cores, no allreduce can take less, whatever
its latency path (the router's CPU comes on top). How long the router's one thread holds up each
packet it forwards (a + b·bytes, from its timed reads and writes during the torchring and gloo
job: ``switch_a``, ``switch_b``) goes into the JSON for scale_model.py --validate. Open MPI's
ranks run the same sizes in a second job under mpirun (its daemons reach the other hosts
through an rsh agent, tests/support/_rsh.py) with the same calibration and trials. "goal" is
2·ceil(log2 H)·D, the latency target for a 4 B-8 KiB allreduce; "best peer/tr" above 1:
torchring's choice is faster.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:0] = [_HERE, _ROOT, os.path.join(_ROOT, "tests", "support")]

import torch  # noqa: E402

from _harness import common_args, finish, machine_info, max_over_ranks, parse_args, sums_over_ranks  # noqa: E402
from _sizes import fmt_size, parse_size  # noqa: E402

ALGOS = ("auto", "ring", "doubling", "rabenseifner", "radix4", "multiplying")
PORT = 29500


def _timed(allreduce: Any, barrier: Any, t: torch.Tensor, iters: int) -> tuple[float, float]:
    """Seconds per call, and this process's CPU seconds (user + system, every thread) per call,
    after one untimed call (a warm-up: each library's trial follows the others')."""
    allreduce(t)
    barrier()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(iters):
        allreduce(t)
    return (time.perf_counter() - start) / iters, (time.process_time() - cpu) / iters


def _wrong(allreduce: Any, rank: int, world: int, count: int) -> int:
    """Elements of an integer-valued allreduce that differ from the analytic sum, this rank."""
    i = torch.arange(count, dtype=torch.int32) % 13
    t = (i + rank).to(torch.float32)
    allreduce(t)
    return int((t != (i * world + world * (world - 1) // 2).float()).sum())


def _rank_main(a: argparse.Namespace) -> None:
    """One rank of the torchring + gloo job: rank 0 appends a JSON line per size."""
    import torch.distributed as dist

    import torchring
    from torchring._core import build, context

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torchring.init()
    comm = context._state.comm
    rank, world = dist.get_rank(), dist.get_world_size()
    engine_algos = list(build.load().ALGOS)

    def use(algo: str) -> None:
        word, _, levels = algo.partition(":")
        comm.algo, comm.levels = engine_algos.index(word), int(levels or 0)

    libs = [f"tr {x}" for x in ALGOS] + ["gloo"]
    calls = {lib: (torchring.allreduce, torchring.barrier) for lib in libs[:-1]}
    calls["gloo"] = (dist.all_reduce, dist.barrier)
    out = open(a.rows, "a") if rank == 0 else None
    for nbytes in map(parse_size, a.sizes.split(",")):
        count = max(1, nbytes // 4)
        t = torch.zeros(count)
        row: dict[str, Any] = {"bytes": count * 4, "wrong": 0, "cost": torchring.link_cost()}
        iters, times, cpu = {}, {lib: [] for lib in libs}, {lib: [] for lib in libs}
        for lib in libs:
            if lib.startswith("tr "):
                use(lib[3:])
            row["wrong"] += int(max_over_ranks([_wrong(calls[lib][0], rank, world, count)])[0])
            _timed(*calls[lib], t, 1)
            (per_call,) = max_over_ranks([_timed(*calls[lib], t, 2)[0]])
            iters[lib] = max(1, min(5000, round(a.trial_s / per_call)))
        use("auto")
        row["chosen"] = torchring.algorithm(t)
        for k in range(a.trials):
            for lib in libs[k % len(libs):] + libs[:k % len(libs)]:
                if lib.startswith("tr "):
                    use(lib[3:])
                seconds, cpu_s = _timed(*calls[lib], t, iters[lib])
                times[lib].append(seconds)
                cpu[lib].append(cpu_s)
        use("auto")
        for lib in libs:
            row[lib] = statistics.median(max_over_ranks(times[lib]))
            row[lib + " cpu"] = statistics.median(sums_over_ranks(cpu[lib]))
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()
    torchring.shutdown()
    dist.destroy_process_group()


def _mpi_main(a: argparse.Namespace) -> None:
    """One Open MPI rank: the same sizes, calibration and trials with Allreduce(IN_PLACE)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    out = open(a.rows, "a") if rank == 0 else None

    def allreduce(t: torch.Tensor) -> None:
        comm.Allreduce(MPI.IN_PLACE, t.numpy(), op=MPI.SUM)

    def worst(x: float) -> float:
        return comm.allreduce(x, op=MPI.MAX)

    for nbytes in map(parse_size, a.sizes.split(",")):
        count = max(1, nbytes // 4)
        t = torch.zeros(count)
        wrong = int(comm.allreduce(_wrong(allreduce, rank, world, count), op=MPI.SUM))
        _timed(allreduce, comm.Barrier, t, 1)
        iters = max(1, min(5000, round(a.trial_s / worst(_timed(allreduce, comm.Barrier, t, 2)))))
        trials = [worst(_timed(allreduce, comm.Barrier, t, iters)) for _ in range(a.trials)]
        if out:
            out.write(json.dumps({"bytes": count * 4, "mpi": statistics.median(trials), "mpi_wrong": wrong}) + "\n")
            out.flush()


def _env(hs: list, a: argparse.Namespace) -> dict[str, str]:
    from _host_jobs import job_env

    return job_env(hs, a.per_host, PORT, GLOO_SOCKET_IFNAME="eth0", TORCHRING_TIMEOUT="120")


def _rank_args(a: argparse.Namespace, rows: str, flag: str) -> list[str]:
    return [os.path.abspath(__file__), flag, "--rows", rows, "--sizes", a.sizes, "--trials", str(a.trials),
            "--trial-s", str(a.trial_s)]


def _read_rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def run_job(hs: list, a: argparse.Namespace) -> list[dict]:
    """torchring + gloo: every rank started in its host directly; rank 0's rows."""
    from _host_jobs import log_tails, start_ranks, wait_all

    rows = os.path.join(hs[0].shared, f"rows-{len(hs)}.jsonl")
    procs, logs = start_ranks(hs, [sys.executable, *_rank_args(a, rows, "--rank-main")], _env(hs, a), a.per_host,
                              log="rank{rank}-" + str(len(hs)) + ".log")
    codes = wait_all(procs, a.timeout)
    if codes != [0] * len(procs):
        raise SystemExit(f"{len(hs)} hosts: the job failed (exit codes {codes})\n{log_tails(logs)}")
    return _read_rows(rows)


def run_mpi(hs: list, a: argparse.Namespace) -> list[dict]:
    """Open MPI: mpirun in host 0, its daemons in the others through the rsh agent."""
    from _peers import mpirun
    from _rsh import rsh_agent

    exe = mpirun()
    rows = os.path.join(hs[0].shared, f"mpi-{len(hs)}.jsonl")
    env = {**_env(hs, a), "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    env["PATH"] = os.pathsep.join([os.path.dirname(exe), env.get("PATH", "")])
    with rsh_agent(hs, env) as agent:
        spec = ",".join(f"{h.name}:{a.per_host}" for h in hs)
        argv = [exe, "--mca", "plm_rsh_agent", agent, "--host", spec, "-np", str(len(hs) * a.per_host),
                "--mca", "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include", "eth0",
                "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", sys.executable, *_rank_args(a, rows, "--mpi-main")]
        r = hs[0].run(argv, timeout=a.timeout, env=env, cwd=hs[0].shared, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{len(hs)} hosts: mpirun failed ({r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    return _read_rows(rows)


def print_table(rows: list[dict], libs: list[str]) -> None:
    """Per host count and size: times, the choice, best peer / torchring, torchring / goal and,
    on shaped links, torchring's bus bandwidth as a fraction of the link (2(H-1)/H of the bytes
    cross each host's link each way)."""
    shaped = any(r["rate"] for r in rows)
    names = ["hosts", "size", "goal(us)", "chosen"] + [f"{lib}(us)" for lib in libs]
    names += ["best peer/tr", "tr/goal", "tr cpu/cores(us)"]
    names += ["tr x link"] if shaped else []
    print("| " + " | ".join(names) + " |\n|" + "---|" * len(names))
    for row in rows:
        peers = [row[lib] for lib in ("gloo", "mpi") if lib in row]
        cells = [str(row["hosts"]), fmt_size(row["bytes"]), f"{row['goal'] * 1e6:.0f}", row["chosen"]]
        cells += [f"{row[lib] * 1e6:.0f}" if lib in row else "-" for lib in libs]
        cells += [f"{min(peers) / row['tr auto']:.2f}" if peers else "-",
                  f"{row['tr auto'] / row['goal']:.2f}" if row["goal"] else "-",
                  f"{row['tr auto cpu'] / os.cpu_count() * 1e6:.0f}" if "tr auto cpu" in row else "-"]
        if shaped:
            from _hosts import parse_rate

            busbw = row["bytes"] / row["tr auto"] * 2 * (row["hosts"] - 1) / row["hosts"]
            cells.append(f"{busbw / (parse_rate(row['rate']) / 8):.2f}")
        print("| " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hosts", default="2,4,8,16", help="host counts (default 2,4,8,16)")
    p.add_argument("--per-host", type=int, default=1, help="ranks per host (default 1)")
    p.add_argument("--latency-us", type=int, default=200, help="one-way link latency D in us (default 200)")
    p.add_argument("--rate", default="none", help="tc rate of every host's link, or 'none' (default none)")
    p.add_argument("--sizes", default="4,64,1K,8K,64K,1M", help="message sizes in bytes, K/M suffixes")
    p.add_argument("--trials", type=int, default=5, help="timed trials per point and library (default 5)")
    p.add_argument("--trial-s", type=float, default=0.3, help="target seconds per trial (default 0.3)")
    p.add_argument("--no-mpi", action="store_true", help="leave Open MPI out")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one job may take (default 1800)")
    common_args(p, quick="4 and 16 hosts, 4 B and 8 KiB, 3 trials of ~0.2 s")
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mpi-main", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rows", help=argparse.SUPPRESS)
    a = parse_args(p)  # TORCHRING_BENCH_PARSE_ONLY=1: stops here (gpu_suite.py --dry-run)
    if a.rank_main:
        return _rank_main(a)
    if a.mpi_main:
        return _mpi_main(a)
    if a.quick:
        a.hosts, a.sizes, a.trials, a.trial_s = "4,16", "4,8K", 3, 0.2
    from _hosts import can_make_hosts, hosts
    from _latency import forwarding_cost
    from _peers import available
    from torchring._core import build as _build

    why = can_make_hosts()
    if why:
        raise SystemExit(f"cannot make test hosts: {why}")
    mpi_why = "--no-mpi" if a.no_mpi else available("mpi")
    _build.load()
    info = machine_info()
    rate = None if a.rate.lower() == "none" else a.rate
    print(f"# allreduce across hosts ({info['date']}, {info['cpu']}, {info['cores']} cores, torch {info['torch']}, "
          f"loadavg {info['loadavg'][0]:.2f}): D = {a.latency_us} us one way, links {rate or 'unshaped'}, "
          f"{a.per_host} rank(s) per host; medians of {a.trials} interleaved trials"
          + (f"; Open MPI left out: {mpi_why}" if mpi_why else ""), flush=True)
    libs = [f"tr {x}" for x in ALGOS] + ["gloo"] + ([] if mpi_why else ["mpi"])
    rows: list[dict] = []
    import pytest

    for n in map(int, a.hosts.split(",")):
        try:
            with hosts(n, rate=rate, latency_us=a.latency_us) as hs:
                before = hs[0].router.stats()
                got = run_job(hs, a)
                switch_a, switch_b, _ = forwarding_cost(before, hs[0].router.stats())
                mpi = {} if mpi_why else {r["bytes"]: r for r in run_mpi(hs, a)}
        except pytest.skip.Exception as e:
            raise SystemExit(f"cannot make test hosts: {e}") from None
        for r in got:
            r.update(mpi.get(r["bytes"], {}), hosts=n, per_host=a.per_host, latency_us=a.latency_us,
                     rate=rate, goal=2 * math.ceil(math.log2(n)) * a.latency_us * 1e-6,
                     switch_a=switch_a, switch_b=switch_b)
            rows.append(r)
        print_table([r for r in rows if r["hosts"] == n], libs)
    print()
    print_table(rows, libs)
    finish(a, info, _long(rows, libs), sum(r["wrong"] + r.get("mpi_wrong", 0) for r in rows), table=rows)


def _long(rows: list[dict], libs: list[str]) -> list[dict]:
    """One row per (hosts, size, library): what benchmarks/scale_model.py --validate reads."""
    from _hosts import parse_rate

    out = []
    for r in rows:
        for lib in libs:
            if lib in r:
                library, algo = ("torchring", lib[3:]) if lib.startswith("tr ") else (lib, "")
                out.append({"library": library, "algo": algo, "chosen": r["chosen"] if algo == "auto" else algo,
                            "hosts": r["hosts"], "per_host": r["per_host"], "bytes": r["bytes"],
                            "seconds": r[lib], "cpu_s": r.get(lib + " cpu"), "latency_us": r["latency_us"],
                            "rate_bits": parse_rate(r["rate"]) if r["rate"] else None,
                            "switch_a": r["switch_a"], "switch_b": r["switch_b"], **r["cost"]})
    return out


if __name__ == "__main__":
    main()
