"""Alltoall, send/recv and group creation: torchring against torch.distributed gloo, in the same run.

    python benchmarks/exchange.py                   # everything below (several minutes)
    python benchmarks/exchange.py --quick           # smoke run (~30 s): alltoall 4K,1M,16M; p2p 4,64K,4M;
                                                    # 100 groups once; 3 trials of ~0.05 s
    python benchmarks/exchange.py --only alltoall --worlds 2 --sizes 1M,64M --json bench-x.json
    python benchmarks/exchange.py --only p2p --p2p-transports tcp --p2p-sizes 4,1M
    python benchmarks/exchange.py --only groups --groups 200

Sections (each torchring and gloo side by side, over the same spawned ranks):
  alltoall  worlds --worlds (2,4), S = --sizes (4K..64M) bytes of float32 per rank in total, equal
            blocks of S/n to every rank: torchring.alltoall(t) (Horovod's form: returns a new
            output and the received splits), torchring.all_to_all_single(out, t) (torch's form,
            preallocated output) and dist.all_to_all_single(out, t) on gloo. algbw = S/time,
            busbw = algbw*(n-1)/n (nccl-tests' alltoall), torchring transport --transport.
  p2p       world 2, ping-pong between ranks 0 and 1 (rank 0: send then recv; rank 1: recv then
            send) of --p2p-sizes (4 B..64M) int32 tensors, torchring.send/recv against
            dist.send/recv, once per torchring transport in --p2p-transports: shm (one host's
            shared-memory rings) and tcp (TORCHRING_TRANSPORT=tcp: every rank its own fake host,
            direct TCP connections over 127.0.0.1). gloo always uses its TCP transport, bound to
            the address the host name resolves to (printed; on one host the kernel's loopback
            path). One round trip moves the message twice: latency = round trip / 2,
            bandwidth = size / latency.
  groups    world --group-world (4): --groups (100) groups created back to back, cycling through
            every pair of ranks, the two halves and the whole world; torchring.new_group(ranks)
            against dist.new_group(ranks, backend="gloo") (whose default ends in a store-based
            barrier of the world). One allreduce per group checks each afterwards (not timed),
            then every group is destroyed (timed separately).

Method (as benchmarks/allreduce.py, over the same harness, benchmarks/_harness.py): every
world's ranks are spawned once and join both a gloo process group and torchring over the same
agent store; every rank runs torch.set_num_threads(1). Per point and library: a correctness
check with integer data (#wrong: elements that differ from the analytic value, summed over
ranks), a warm-up that also calibrates `iters` so one trial takes about --trial-s seconds, then
--trials trials, each a barrier and `iters` back-to-back calls timed as the mean per call. A
trial's time is the max over ranks; the tables show the median over trials. ratio = gloo time /
torchring time (above 1: torchring is faster). Groups: each trial is one timed batch of
creations (max over ranks), the median of --group-trials trials.
"""

from __future__ import annotations

import argparse
import itertools
import os
import socket
import statistics
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import (common_args, copy_bandwidth, finish, machine_info, max_over_ranks,  # noqa: E402
                      oversubscribed, print_header, rank_env, reporting, run_world, sum_over_ranks)
from _sizes import fmt_size, parse_size  # noqa: E402

DEFAULT_SIZES = "4K,64K,1M,16M,64M"
DEFAULT_P2P_SIZES = "4,64,1K,16K,256K,1M,4M,16M,64M"
SECTIONS = ("alltoall", "p2p", "groups")


def time_calls(call: Callable[[], Any], barrier: Callable[[], Any], trials: int,
               trial_s: float) -> tuple[list[float], int]:
    """Warm up, calibrate iters, then `trials` timed trials: (per-call seconds per trial, max
    over ranks; iters). Every rank must call it with the same trials and trial_s."""
    call()
    barrier()
    start = time.perf_counter()
    for _ in range(2):
        call()
    (per_call,) = max_over_ranks([(time.perf_counter() - start) / 2])
    iters = max(1, min(10000, round(trial_s / per_call)))
    times = []
    for _ in range(trials):
        barrier()
        start = time.perf_counter()
        for _ in range(iters):
            call()
        times.append((time.perf_counter() - start) / iters)
    return max_over_ranks(times), iters


def _stats(times: list[float], iters: int, wrong: int, nbytes: int) -> dict[str, Any]:
    sec = statistics.median(times)
    return {"time_us": sec * 1e6, "GBps": nbytes / sec / 1e9, "wrong": wrong, "iters": iters,
            "trial_us": [x * 1e6 for x in times]}


# ---------------------------------------------------------------------------------------------
# alltoall

def alltoall_point(rank: int, world: int, nbytes: int, args: argparse.Namespace) -> dict[str, Any]:
    """torchring's two forms and gloo's all_to_all_single at one size; the same dict on every rank."""
    import torch.distributed as dist
    import torchring

    block = nbytes // 4 // world
    count = block * world
    pos = torch.arange(count, dtype=torch.int64) % 251
    inp = (pos + 256 * rank).to(torch.float32)  # sender in the high part, position in the low
    mine = torch.arange(rank * block, (rank + 1) * block, dtype=torch.int64) % 251
    expected = torch.cat([mine + 256 * s for s in range(world)]).to(torch.float32)
    del pos, mine
    out = torch.empty(count, dtype=torch.float32)
    calls: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
        "torchring": (lambda: torchring.alltoall(inp), torchring.barrier),
        "tr_single": (lambda: torchring.all_to_all_single(out, inp), torchring.barrier),
        "gloo": (lambda: dist.all_to_all_single(out, inp), dist.barrier),
    }
    row: dict[str, Any] = {"world": world, "size": count * 4, "count": count}
    for name, (call, barrier) in calls.items():
        out.fill_(-1)
        got = call()
        if name == "torchring":
            got, splits = got
            bad_splits = int((splits != block).sum()) if splits.numel() == world else world
        else:
            got, bad_splits = out, 0
        wrong = sum_over_ranks(int((got != expected).sum()) + bad_splits if got.shape == expected.shape
                               else count)
        times, iters = time_calls(call, barrier, args.trials, args.trial_s)
        m = _stats(times, iters, wrong, count * 4)
        m["algbw"] = m.pop("GBps")
        m["busbw"] = m["algbw"] * (world - 1) / world
        row[name] = m
    return row


# ---------------------------------------------------------------------------------------------
# send/recv

def p2p_point(rank: int, nbytes: int, args: argparse.Namespace) -> dict[str, Any]:
    """Ping-pong between ranks 0 and 1 with torchring and gloo; the same dict on every rank."""
    import torch.distributed as dist
    import torchring

    count = max(1, nbytes // 4)
    pattern = torch.arange(count, dtype=torch.int32) % 251
    buf = torch.empty(count, dtype=torch.int32)
    libs = {"torchring": (torchring.send, torchring.recv, torchring.barrier),
            "gloo": (dist.send, dist.recv, dist.barrier)}
    row: dict[str, Any] = {"size": count * 4, "count": count}
    for name, (send, recv, barrier) in libs.items():
        # Correctness: 0 -> 1 carries pattern + 1, 1 -> 0 carries pattern + 2, into zeroed buffers.
        wrong = 0
        if rank == 0:
            send(pattern + 1, 1)
            buf.zero_()
            recv(buf, 1)
            wrong = int((buf != pattern + 2).sum())
        elif rank == 1:
            buf.zero_()
            recv(buf, 0)
            wrong = int((buf != pattern + 1).sum())
            send(pattern + 2, 0)
        wrong = sum_over_ranks(wrong)

        def round_trip() -> None:
            if rank == 0:
                send(buf, 1)
                recv(buf, 1)
            elif rank == 1:
                recv(buf, 0)
                send(buf, 0)

        times, iters = time_calls(round_trip, barrier, args.trials, args.trial_s)
        m = _stats([t / 2 for t in times], iters, wrong, count * 4)
        m["latency_us"] = m.pop("time_us")
        row[name] = m
    return row


# ---------------------------------------------------------------------------------------------
# group creation

def group_shapes(world: int) -> list[list[int]]:
    """Every pair of ranks, the two halves, the whole world (the cycle that groups walk through)."""
    shapes = [list(p) for p in itertools.combinations(range(world), 2)]
    if world >= 4:
        shapes += [list(range(world // 2)), list(range(world // 2, world))]
    return shapes + [list(range(world))]


def groups_point(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """Create, check and destroy args.groups groups with each library, args.group_trials times."""
    import torch.distributed as dist
    import torchring

    shapes = list(itertools.islice(itertools.cycle(group_shapes(world)), args.groups))

    def check(ranks: list[int], reduce: Callable[[torch.Tensor], Any]) -> int:
        t = torch.tensor([rank + 1, 7 * rank], dtype=torch.int64)
        reduce(t)
        return int((t != torch.tensor([sum(r + 1 for r in ranks), 7 * sum(ranks)])).sum())

    def tr_trial() -> tuple[float, float, int]:
        torchring.barrier()
        start = time.perf_counter()
        groups = [torchring.new_group(s) for s in shapes]
        created = time.perf_counter() - start
        wrong = sum(check(s, g.allreduce) for s, g in zip(shapes, groups) if g.is_member)
        torchring.barrier()
        start = time.perf_counter()
        for g in groups:
            g.destroy()
        return created, time.perf_counter() - start, wrong

    def gloo_trial() -> tuple[float, float, int]:
        dist.barrier()
        start = time.perf_counter()
        groups = [dist.new_group(s, backend="gloo") for s in shapes]
        created = time.perf_counter() - start
        mine = [(s, g) for s, g in zip(shapes, groups) if rank in s]
        wrong = sum(check(s, lambda t, g=g: dist.all_reduce(t, group=g)) for s, g in mine)
        dist.barrier()
        start = time.perf_counter()
        for _, g in mine:
            dist.destroy_process_group(g)
        return created, time.perf_counter() - start, wrong

    row: dict[str, Any] = {"world": world, "groups": args.groups}
    for name, trial in (("torchring", tr_trial), ("gloo", gloo_trial)):
        created, destroyed, wrong = [], [], 0
        for _ in range(args.group_trials):
            c, d, w = trial()
            created.append(c)
            destroyed.append(d)
            wrong += w
        created, destroyed = max_over_ranks(created), max_over_ranks(destroyed)
        row[name] = {"create_s": statistics.median(created), "destroy_s": statistics.median(destroyed),
                     "wrong": sum_over_ranks(wrong), "create_trials_s": created,
                     "destroy_trials_s": destroyed}
    return row


# ---------------------------------------------------------------------------------------------
# ranks and the driver

def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    """One rank: join gloo and torchring with args.transport, run args.sections, rank 0 reports."""
    os.environ.update(rank_env(rank, world, port), TORCHRING_TRANSPORT=args.transport)
    with reporting(rank, queue):
        import torch.distributed as dist
        import torchring

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        torchring.init()
        head = {"transport": args.transport, "tr_transport": torchring.transport()}
        for section in args.sections:
            if section == "alltoall":
                points = [alltoall_point(rank, world, n, args) for n in map(parse_size, args.sizes.split(","))]
            elif section == "p2p":
                points = [p2p_point(rank, n, args) for n in map(parse_size, args.p2p_sizes.split(","))]
            else:
                points = [groups_point(rank, world, args)]
            for row in points:
                if rank == 0:
                    queue.put(("row", {"section": section, "world": world, **head, **row}))
        torchring.shutdown()
        dist.destroy_process_group()


LIBS = {"alltoall": ("torchring", "tr_single", "gloo"), "p2p": ("torchring", "gloo"), "groups": ("torchring", "gloo")}
SHORT = {"torchring": "tr", "tr_single": "tr single", "gloo": "gloo"}


def table_header(row: dict, over: str, gloo_addr: str) -> str:
    section, world, tr = row["section"], row["world"], row["tr_transport"]
    if section == "alltoall":
        title = f"## alltoall, world {world}, torchring transport {tr}{over}"
        names = ["size", "count"] + [f"{SHORT[lib]} {c}" for lib in LIBS[section]
                                     for c in ("time(us)", "algbw", "busbw", "#wrong")]
        names += ["ratio", "ratio single"]
    elif section == "p2p":
        title = (f"## send/recv ping-pong, ranks 0 <-> 1, torchring transport {tr} "
                 f"(gloo: TCP on {gloo_addr})")
        names = ["size"] + [f"{SHORT[lib]} {c}" for lib in LIBS[section]
                            for c in ("latency(us)", "GB/s", "#wrong")] + ["ratio"]
    else:
        title = f"## group creation, world {world}, torchring transport {tr}{over}"
        names = ["groups"] + [f"{SHORT[lib]} {c}" for lib in LIBS[section]
                              for c in ("create(s)", "per group(ms)", "destroy(s)", "#wrong")] + ["ratio"]
    return f"{title}\n\n| " + " | ".join(names) + " |\n|" + "---|" * len(names)


def table_row(row: dict) -> str:
    section = row["section"]
    if section == "alltoall":
        cells = [fmt_size(row["size"]), str(row["count"])]
        for lib in LIBS[section]:
            m = row[lib]
            cells += [f"{m['time_us']:.1f}", f"{m['algbw']:.3f}", f"{m['busbw']:.3f}", str(m["wrong"])]
        cells += [f"{row['gloo']['time_us'] / row[lib]['time_us']:.2f}" for lib in ("torchring", "tr_single")]
    elif section == "p2p":
        cells = [fmt_size(row["size"])]
        for lib in LIBS[section]:
            m = row[lib]
            cells += [f"{m['latency_us']:.1f}", f"{m['GBps']:.3f}", str(m["wrong"])]
        cells.append(f"{row['gloo']['latency_us'] / row['torchring']['latency_us']:.2f}")
    else:
        cells = [str(row["groups"])]
        for lib in LIBS[section]:
            m = row[lib]
            cells += [f"{m['create_s']:.3f}", f"{m['create_s'] / row['groups'] * 1e3:.2f}",
                      f"{m['destroy_s']:.3f}", str(m["wrong"])]
        cells.append(f"{row['gloo']['create_s'] / row['torchring']['create_s']:.2f}")
    return "| " + " | ".join(cells) + " |"


def plan(args: argparse.Namespace) -> list[tuple[int, str, list[str]]]:
    """(world, transport, sections) per spawned world, sections sharing a world where they can."""
    jobs: dict[tuple[int, str], list[str]] = {}
    if "alltoall" in args.sections:
        for world in map(int, args.worlds.split(",")):
            jobs.setdefault((world, args.transport), []).append("alltoall")
    if "p2p" in args.sections:
        for transport in args.p2p_transports.split(","):
            jobs.setdefault((2, transport), []).append("p2p")
    if "groups" in args.sections:
        jobs.setdefault((args.group_world, args.transport), []).append("groups")
    return [(w, t, s) for (w, t), s in jobs.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=",".join(SECTIONS), help="sections: alltoall,p2p,groups (default all)")
    parser.add_argument("--worlds", default="2,4", help="alltoall world sizes (default 2,4)")
    parser.add_argument("--sizes", default=DEFAULT_SIZES,
                        help=f"alltoall bytes per rank in total, K/M/G suffixes (default {DEFAULT_SIZES})")
    parser.add_argument("--p2p-sizes", default=DEFAULT_P2P_SIZES,
                        help=f"send/recv message bytes (default {DEFAULT_P2P_SIZES})")
    parser.add_argument("--p2p-transports", default="shm,tcp", help="torchring transports for p2p (default shm,tcp)")
    parser.add_argument("--transport", default="shm", choices=["shm", "tcp"],
                        help="torchring transport for alltoall and groups (default shm, which auto picks on one host)")
    parser.add_argument("--groups", type=int, default=100, help="groups created per trial (default 100)")
    parser.add_argument("--group-world", type=int, default=4, help="world size for group creation (default 4)")
    parser.add_argument("--group-trials", type=int, default=3, help="group-creation trials (default 3)")
    parser.add_argument("--trials", type=int, default=5, help="timed trials per point (default 5)")
    parser.add_argument("--trial-s", type=float, default=0.15, help="target seconds per trial (default 0.15)")
    common_args(parser, quick="alltoall worlds 2,4 at 4K,1M,16M; p2p 4,64K,4M; 100 groups once; 3 trials of ~0.05 s")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.p2p_sizes, args.group_trials = "4K,1M,16M", "4,64K,4M", 1
        args.trials, args.trial_s = 3, 0.05
    args.sections = [s for s in SECTIONS if s in args.only.split(",")]
    bad = [t for t in args.p2p_transports.split(",") if t not in ("shm", "tcp")]
    if bad:
        parser.error(f"--p2p-transports: {bad[0]!r} is not shm or tcp")
    info = machine_info()
    info["copy_t1_GBps"] = copy_bandwidth()
    info["gloo_addr"] = socket.gethostbyname(socket.gethostname())
    print_header("exchange: torchring vs gloo", info)
    print(f"memory reference: copy_ 1 thread 256 MiB = {info['copy_t1_GBps']:.1f} GB/s; times are medians "
          f"of {args.trials} trials (groups: {args.group_trials}); ratio = gloo time / torchring time\n")
    rows: list[dict] = []
    for world, transport, sections in plan(args):
        over = oversubscribed(world)
        shown: list[Any] = [None]

        def on_row(row: dict, over: str = over, shown: list[Any] = shown) -> None:
            if shown[0] != row["section"]:
                if shown[0] is not None:
                    print()
                print(table_header(row, over, info["gloo_addr"]), flush=True)
                shown[0] = row["section"]
            rows.append({**row, "oversubscribed": bool(over)})
            print(table_row(row), flush=True)

        job = argparse.Namespace(**{**vars(args), "transport": transport, "sections": sections})
        run_world(world, job, on_row, target=_rank_main)
        print()
    finish(args, info, rows, sum(r[lib]["wrong"] for r in rows for lib in LIBS[r["section"]]))


if __name__ == "__main__":
    main()
