"""Allreduce time and bandwidth: torchring against torch.distributed gloo, in the same run.

    python benchmarks/allreduce.py                      # worlds 2,4; fp32,bf16; 4K..256M (a few minutes)
    python benchmarks/allreduce.py --quick              # world 2; 4K,1M,16M; 3 trials
    python benchmarks/allreduce.py --worlds 2 --sizes 1M,64M --dtypes fp32 --json bench-1.json
    python benchmarks/allreduce.py --transport tcp      # force torchring's TCP ring

Method (nccl-tests' columns, the project's perf notes 5 and 6.1): the ranks of one world are spawned
once and join both a gloo process group and torchring over the same agent store. Per size and library: a correctness
check against the analytic sum (#wrong, summed over ranks), a warm-up that also calibrates `iters`
so one trial takes about --trial-s seconds, then --trials trials, each a barrier and `iters`
back-to-back in-place allreduces timed as the mean per call. A trial's time is the max over
ranks; the table shows the median over trials. algbw = bytes/time and busbw = algbw*2(n-1)/n in
GB/s; ratio = gloo time / torchring time (above 1: torchring is faster). Every rank runs torch.set_num_threads(1).
A single-thread `copy_` of 256 MiB (STREAM counting: read + write) is the memory reference.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing as mp
import os
import platform
import resource
import statistics
import sys
import time
import traceback
from typing import Any, Callable, Iterator

import torch

# Import torchring from this checkout even when it is not installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}
DEFAULT_SIZES = "4K,64K,1M,16M,64M,256M"


def parse_size(text: str) -> int:
    """'64K' -> 65536 bytes; a bare number is bytes."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(text[:-1]) * UNITS[text[-1]] if text[-1] in UNITS else int(text)


def fmt_size(nbytes: int) -> str:
    for unit in ("G", "M", "K"):
        if nbytes >= UNITS[unit] and nbytes % UNITS[unit] == 0:
            return f"{nbytes // UNITS[unit]} {unit}iB"
    return f"{nbytes} B"


def copy_bandwidth(nbytes: int = 256 * 2**20, reps: int = 5) -> float:
    """Single-thread torch copy_ bandwidth in GB/s, counting read + write (STREAM)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    torch.set_num_threads(threads)
    return 2 * nbytes / statistics.median(times) / 1e9


class Lib:
    """The calls the timing loop needs from one library."""

    def __init__(self, name: str, allreduce: Callable[[torch.Tensor], Any], barrier: Callable[[], Any],
                 alloc: Callable[[int, torch.dtype], torch.Tensor], sync: Callable[[], Any] = lambda: None) -> None:
        self.name, self.allreduce, self.barrier, self.alloc = name, allreduce, barrier, alloc
        self.sync = sync  # waits for queued device work (CUDA); a no-op on the CPU


def _max_over_ranks(values: list[float]) -> list[float]:
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _sum_over_ranks(value: int) -> int:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


def measure(lib: Lib, rank: int, world: int, count: int, dtype: torch.dtype, trials: int,
            trial_s: float) -> dict[str, Any]:
    """Check, calibrate and time one (library, size, dtype) point; the same dict on every rank."""
    t = lib.alloc(count, dtype)
    i = torch.arange(count, dtype=torch.int32, device=t.device) % 13
    t.copy_(i + rank)
    lib.allreduce(t)
    lib.sync()
    wrong = _sum_over_ranks(int((t != (i * world + world * (world - 1) // 2).to(dtype)).sum()))
    del i
    t.zero_()  # sums of zeros stay zero, so repeated in-place calls time the same work
    lib.allreduce(t)
    lib.barrier()
    start = time.perf_counter()
    for _ in range(2):
        lib.allreduce(t)
    lib.sync()
    (per_call,) = _max_over_ranks([(time.perf_counter() - start) / 2])
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
    times = _max_over_ranks(times)
    sec = statistics.median(times)
    algbw = count * t.element_size() / sec / 1e9
    return {"lib": lib.name, "time_us": sec * 1e6, "algbw": algbw, "busbw": algbw * 2 * (world - 1) / world,
            "wrong": wrong, "iters": iters, "trial_us": [x * 1e6 for x in times], "rank0_cores": cores}


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """What a launcher gives one spawned rank of a one-host job (rendezvous on the parent's store)."""
    return dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")


@contextlib.contextmanager
def reporting(rank: int, queue: Any) -> Iterator[None]:
    """A rank's body: rank 0 reports ("done", None) when it ends, a failure goes to the parent."""
    try:
        yield
        if rank == 0:
            queue.put(("done", None))
    except BaseException:
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    """One rank: join gloo and torchring, sweep dtypes x sizes, rank 0 reports each row."""
    os.environ.update(rank_env(rank, world, port))
    if args.transport != "auto":
        os.environ["TORCHRING_TRANSPORT"] = args.transport
    with reporting(rank, queue):
        import torch.distributed as dist

        torch.set_num_threads(1)
        device, sync = torch.device("cpu"), (lambda: None)
        backend = "gloo"
        if args.device == "cuda":
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
            sync = torch.cuda.synchronize
            backend = "nccl" if torch.cuda.device_count() >= world else "gloo"  # gloo stages CUDA tensors
        dist.init_process_group(backend)
        torch_alloc = lambda n, d: torch.empty(n, dtype=d, device=device)  # noqa: E731
        libs = {"gloo": Lib(backend, dist.all_reduce, dist.barrier, torch_alloc, sync)}
        if "torchring" in args.libs:
            import torchring

            torchring.init()
            ring_alloc = (lambda n, d: torchring.empty((n,), dtype=d)) if args.alloc == "shm" else torch_alloc
            if args.device == "cuda":
                ring_alloc = torch_alloc
            libs["torchring"] = Lib("torchring", torchring.allreduce, torchring.barrier, ring_alloc, sync)
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            for nbytes in map(parse_size, args.sizes.split(",")):
                count = nbytes // dtype.itemsize
                row = {"world": world, "size": nbytes, "count": count, "dtype": dname}
                for name in args.libs:
                    row[name] = measure(libs[name], rank, world, count, dtype, args.trials, args.trial_s)
                if rank == 0:
                    queue.put(("row", row))
        if "torchring" in args.libs:
            torchring.shutdown()
        dist.destroy_process_group()


def run_world(world: int, args: argparse.Namespace, on_row: Callable[[dict], None],
              target: Callable[..., None] | None = None) -> None:
    """Spawn one world, host its store like the torchrun agent, hand rank 0's rows to on_row.

    Each rank runs target(rank, world, store_port, args, queue) (default: this script's ranks),
    which puts ("row", dict), then ("done", None) from rank 0, or ("error", text) on any rank."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    target = target or _rank_main
    procs = [ctx.Process(target=target, args=(r, world, store.port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        while True:
            try:
                kind, payload = queue.get(timeout=1.0)
            except Exception:  # queue.Empty: see whether a rank died silently
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise SystemExit(f"world {world}: rank pid {dead[0].pid} exited with {dead[0].exitcode}")
                continue
            if kind == "row":
                on_row(payload)
            elif kind == "error":
                raise SystemExit(f"world {world} failed on {payload}")
            else:
                break
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


def print_header(libs: list[str]) -> None:
    names = ["size", "count", "dtype"]
    for lib in libs:
        short = "tr" if lib == "torchring" else lib
        names += [f"{short} time(us)", f"{short} algbw", f"{short} busbw", f"{short} #wrong"]
    names += ["ratio"] if len(libs) == 2 else []
    print("| " + " | ".join(names) + " |\n|" + "---|" * len(names), flush=True)


def print_row(row: dict, libs: list[str]) -> None:
    cells = [fmt_size(row["size"]), str(row["count"]), row["dtype"]]
    for name in libs:
        m = row[name]
        cells += [f"{m['time_us']:.1f}", f"{m['algbw']:.3f}", f"{m['busbw']:.3f}", str(m["wrong"])]
    if len(libs) == 2:
        cells.append(f"{row['gloo']['time_us'] / row['torchring']['time_us']:.2f}")
    print("| " + " | ".join(cells) + " |", flush=True)


def machine_info() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
            "cpu": cpu,
            "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "loadavg": os.getloadavg()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", default="2,4", help="comma-separated world sizes (default 2,4)")
    parser.add_argument("--sizes", default=DEFAULT_SIZES,
                        help=f"message sizes in bytes, K/M/G suffixes (default {DEFAULT_SIZES})")
    parser.add_argument("--dtypes", default="fp32,bf16", help="fp32 and/or bf16 (default both)")
    parser.add_argument("--trials", type=int, default=5, help="timed trials per point (default 5)")
    parser.add_argument("--trial-s", type=float, default=0.15, help="target seconds per trial (default 0.15)")
    parser.add_argument("--transport", default="auto", choices=["auto", "shm", "tcp"],
                        help="TORCHRING_TRANSPORT")
    parser.add_argument("--alloc", default="torch", choices=["torch", "shm"],
                        help="allocate torchring's tensors with torch.empty or torchring.empty (zero-copy)")
    parser.add_argument("--libs", default="torchring,gloo", help="torchring and/or gloo (default both)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: tensors on the GPU; the peer is torch's NCCL group when every rank "
                             "has a GPU, else gloo's CUDA path (the 'gloo' columns then show that peer)")
    parser.add_argument("--json", help="also write every measurement to this JSON file")
    parser.add_argument("--quick", action="store_true", help="world 2; 4K,1M,16M; 3 trials of ~0.1 s")
    args = parser.parse_args()
    if args.quick:
        args.worlds, args.sizes, args.trials, args.trial_s = "2", "4K,1M,16M", 3, 0.1
    args.libs = [lib for lib in ("torchring", "gloo") if lib in args.libs.split(",")]
    info = machine_info()
    info["copy_t1_GBps"] = copy_bandwidth()
    print(f"# allreduce: torchring vs gloo  ({info['date']}, {info['cpu']}, {info['cores']} cores, "
          f"torch {info['torch']}, loadavg {info['loadavg'][0]:.2f})")
    print(f"memory reference: copy_ 1 thread 256 MiB = {info['copy_t1_GBps']:.1f} GB/s; "
          f"torchring transport={args.transport} alloc={args.alloc}; "
          f"times are medians of {args.trials} trials\n")
    rows: list[dict] = []
    for world in map(int, args.worlds.split(",")):
        over = world > (os.cpu_count() or 1)
        print(f"## world {world}" + (f" (OVERSUBSCRIBED: {world} ranks on {os.cpu_count()} cores, "
                                     "not for bandwidth claims)" if over else "") + "\n")
        print_header(args.libs)

        def on_row(row: dict, over: bool = over) -> None:
            for lib in args.libs:
                row[lib]["busbw_over_copy_t1"] = row[lib]["busbw"] / info["copy_t1_GBps"]
            rows.append({**row, "oversubscribed": over})
            print_row(row, args.libs)

        run_world(world, args, on_row)
        print()
    finish(args, info, rows, sum(r[lib]["wrong"] for r in rows for lib in args.libs))


def finish(args: argparse.Namespace, info: dict, rows: list[dict], wrong: int) -> None:
    """Writes --json (machine, arguments, every row) and fails the run if any element was wrong."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "args": vars(args), "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    if wrong:
        raise SystemExit(f"{wrong} wrong elements in the correctness checks")


if __name__ == "__main__":
    main()
