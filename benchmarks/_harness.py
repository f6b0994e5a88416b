"""What the benchmark scripts share: a one-host world of spawned ranks, timings reduced over the
ranks, and the run's record (machine, commit, header line, JSON).

A script's ranks run ``target(rank, world, store_port, args, queue)``, started by run_world, which
hosts the agent store as torchrun's agent would. Inside ``reporting(rank, queue)`` a rank puts
("row", dict) for the parent, rank 0 ("done", None) when it ends, any rank ("error", text) on a
failure; the parent hands each row to the script's on_row as it comes.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import time
import traceback
from typing import Any, Callable, Iterator

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- the machine and the run's record

def copy_bandwidth(nbytes: int = 256 * 2**20, reps: int = 5, threads: int = 1) -> float:
    """torch copy_ bandwidth with `threads` threads (one unless given) in GB/s, counting
    read + write (STREAM); the median of `reps` copies."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    torch.set_num_threads(before)
    return 2 * nbytes / statistics.median(times) / 1e9


def commit() -> str:
    """The checkout's commit (with '+dirty' when files differ from it), or 'unknown';
    TORCHRING_BENCH_COMMIT names it where the copy being run has no git history."""
    if os.environ.get("TORCHRING_BENCH_COMMIT"):
        return os.environ["TORCHRING_BENCH_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + ("+dirty" if dirty else "")) if head else "unknown"


def machine_info() -> dict[str, Any]:
    """Date, host, CPU model, cores, torch and Python versions, load average and the commit."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
            "cpu": cpu,
            "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "loadavg": os.getloadavg(), "commit": commit()}


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity), what oversubscription is counted against."""
    return len(os.sched_getaffinity(0))


def oversubscribed(world: int, claims: str = "speed") -> str:
    """' (OVERSUBSCRIBED: ...)' when `world` ranks outnumber the usable cores, else ''."""
    cores = usable_cores()
    return f" (OVERSUBSCRIBED: {world} ranks on {cores} cores, not for {claims} claims)" if world > cores else ""


def common_args(parser: argparse.ArgumentParser, quick: str | None = None) -> None:
    """Adds --json and, where the script has a smoke run (`quick`: what it sets), --quick."""
    parser.add_argument("--json", help="also write the machine, the arguments and every row to this JSON file")
    if quick is not None:
        parser.add_argument("--quick", action="store_true", help=quick)


def parse_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """parser.parse_args(); with TORCHRING_BENCH_PARSE_ONLY=1 the script stops here, once its
    imports and arguments are known to be good (benchmarks/gpu_suite.py --dry-run)."""
    args = parser.parse_args()
    if os.environ.get("TORCHRING_BENCH_PARSE_ONLY") == "1":
        raise SystemExit(0)
    return args


def print_header(title: str, info: dict[str, Any], *extra: str) -> None:
    """The run's first line: '# title  (date, cpu, N cores, torch V, commit C, extra..., loadavg L)'."""
    parts = [info["date"], info["cpu"], f"{usable_cores()} cores", f"torch {info['torch']}",
             f"commit {info['commit']}", *extra, f"loadavg {info['loadavg'][0]:.2f}"]
    print(f"# {title}  ({', '.join(parts)})")


def finish(args: argparse.Namespace, info: dict, rows: list[dict], wrong: int, **extra: Any) -> None:
    """Writes --json (machine, arguments, `extra`, every row) and fails the run if any element was wrong."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "args": vars(args), **extra, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    if wrong:
        raise SystemExit(f"{wrong} wrong elements in the correctness checks")


# ---------------------------------------------------------------- inside a rank

def _over_ranks(values: list[float], op: str) -> list[float]:
    """Elementwise `op` ("MAX" or "SUM") of `values` over the default group's ranks."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return t.tolist()


def world_communicator(name: str, trace: int) -> tuple[Any, Any]:
    """(engine, communicator): one more communicator over the initialized world's ranks, under
    its own store prefix `name`, with `trace` flight recorder entries (0: none); the caller shuts
    it down."""
    import dataclasses

    import torchring
    from torchring._core import build as _build, context as _context, rendezvous as _rendezvous

    engine, settings = _build.load(), _context.settings()
    store, prefix, host = _context.wiring()
    comm = _rendezvous.connect(engine, store, f"{prefix}{name}/", torchring.rank(), torchring.size(),
                               dataclasses.replace(settings, trace=trace), host,
                               _context.launch_info().master_addr).comm
    return engine, comm


def max_over_ranks(values: list[float]) -> list[float]:
    """Elementwise max of `values` over the default group's ranks (the same list on every rank)."""
    return _over_ranks(values, "MAX")


def sums_over_ranks(values: list[float]) -> list[float]:
    """Elementwise sum of `values` over the default group's ranks (the same list on every rank)."""
    return _over_ranks(values, "SUM")


def sum_over_ranks(value: int) -> int:
    """`value` summed over the default group's ranks (the same on every rank)."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


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


# ---------------------------------------------------------------- the parent

def run_world(world: int, args: argparse.Namespace, on_row: Callable[[dict], None],
              target: Callable[..., None]) -> None:
    """Spawn one world, host its store like the torchrun agent, hand rank 0's rows to on_row.

    Each rank runs target(rank, world, store_port, args, queue), which puts ("row", dict), then
    ("done", None) from rank 0, or ("error", text) on any rank."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
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
