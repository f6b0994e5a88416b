"""Cross-host allreduce: torchring between hosts vs torch.distributed gloo vs raw TCP (iperf3), one link.

    python benchmarks/crosshost.py                         # 2 hosts x 1 rank, 1 Gbit/s links, 1M..64M fp32
    python benchmarks/crosshost.py --rate 5gbit --sizes 16M,64M --trials 7 --json xh.json
    python benchmarks/crosshost.py --rate none             # unshaped veth: the CPU is the limit
    python benchmarks/crosshost.py --quick                 # 1M,16M; 3 trials

Needs root (network namespaces), iproute2, util-linux and iperf3 (Debian:
`DEBIAN_FRONTEND=noninteractive apt-get install -y iperf3`; no system iperf3 daemon is needed or
started: this script runs `iperf3 -s -1` inside a test host). Not run in CI.

Method. The hosts are tests/support/_hosts.py's simulated hosts (network, UTS, IPC, PID and mount
namespaces joined by a bridge; every host's egress shaped to --rate with tc; addresses in
198.18.0.0/15 with no route out, so no traffic leaves loopback and the test hosts). In the same
run, on the same links:
- the link: iperf3 from host 0 to host 1 (`iperf3 -s -1` on host 1, `iperf3 -c -J` on host 0),
  one stream, before and after the allreduce job: the link rate is the mean of the two receiver
  rates. Also, per --iperf: more streams (-P N) and `--bidir` (one stream each way at once: what
  a 2-rank ring does; on a shaped link it matches one way, on an unshaped veth the CPU splits);
- the job: --per-host ranks on each of --hosts hosts (env:// rendezvous at host 0, RANK/WORLD_SIZE
  per process); every rank joins a gloo process group and torchring (`torchring.init()`; across
  hosts that is the leaders' TCP links). Per size and library: an exact check on integer data (#wrong,
  summed over ranks), a warm-up that calibrates `iters` so one trial takes about --trial-s
  seconds, then --trials trials *interleaved* between the libraries (the first library alternates
  between trials), each a barrier and `iters` back-to-back in-place allreduces timed as the mean
  per call. A trial's time is the max over ranks; the table shows the median over trials.
algbw = bytes/time, busbw = algbw * 2(n-1)/n (GB/s, n = world size); "x link" = busbw / link
rate, in the same unit (at 1 rank per host each byte of busbw crosses one host's link once in each
direction, so 1.00 is the link's one-direction rate); "x bidir" = busbw / iperf3 --bidir's rate
per direction; gloo/tr = gloo time / torchring time (above 1: torchring is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:0] = [_HERE, _ROOT, os.path.join(_ROOT, "tests", "support")]

import torch  # noqa: E402

from _harness import DTYPES, common_args, finish, machine_info, max_over_ranks  # noqa: E402
from _sizes import fmt_size, parse_size  # noqa: E402

LIBS = ("torchring", "gloo")
PORT = 29500  # rank 0's store, inside host 0's own network namespace


# ---------------------------------------------------------------- one rank (runs in a test host)

def _check(allreduce: Any, rank: int, world: int, count: int, dtype: torch.dtype) -> int:
    """Elements of an integer-valued allreduce that differ from the analytic sum, over all ranks."""
    import torch.distributed as dist

    i = torch.arange(count, dtype=torch.int32) % 13
    t = (i + rank).to(dtype)
    allreduce(t)
    wrong = torch.tensor([int((t != (i * world + world * (world - 1) // 2).to(dtype)).sum())])
    dist.all_reduce(wrong)
    return int(wrong.item())


def _calibrate(allreduce: Any, barrier: Any, t: torch.Tensor, trial_s: float) -> int:
    """Warm up, then the number of calls that makes one trial about ``trial_s`` (same on all ranks)."""
    allreduce(t)
    barrier()
    start = time.perf_counter()
    for _ in range(2):
        allreduce(t)
    (per_call,) = max_over_ranks([(time.perf_counter() - start) / 2])
    return max(1, min(10000, round(trial_s / per_call)))


def _rank_main(a: argparse.Namespace) -> None:
    """One rank: join gloo and torchring, time every size interleaved, rank 0 appends rows."""
    import socket

    import torch.distributed as dist
    import torchring

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # env://: rank 0 hosts the store; torchring shares it
    torchring.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    calls = {"torchring": (torchring.allreduce, torchring.barrier), "gloo": (dist.all_reduce, dist.barrier)}
    libs = [lib for lib in LIBS if lib in a.libs.split(",")]
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    out = open(a.rows, "a") if rank == 0 else None

    def emit(obj: dict) -> None:
        if out:
            out.write(json.dumps(obj) + "\n")
            out.flush()

    emit({"kind": "job", "world": world, "hosts": hosts, "transport": torchring.transport()})
    for dname in a.dtypes.split(","):
        dtype = DTYPES[dname]
        for nbytes in map(parse_size, a.sizes.split(",")):
            count = nbytes // dtype.itemsize
            row: dict[str, Any] = {"kind": "row", "world": world, "size": nbytes, "count": count,
                                   "dtype": dname}
            t = torch.zeros(count, dtype=dtype)  # sums of zeros stay zero: every call does the same work
            iters, times = {}, {lib: [] for lib in libs}
            for lib in libs:
                row[lib] = {"wrong": _check(calls[lib][0], rank, world, count, dtype)}
                iters[lib] = _calibrate(*calls[lib], t, a.trial_s)
            for k in range(a.trials):
                for lib in (libs if k % 2 == 0 else libs[::-1]):
                    allreduce, barrier = calls[lib]
                    barrier()
                    start = time.perf_counter()
                    for _ in range(iters[lib]):
                        allreduce(t)
                    times[lib].append((time.perf_counter() - start) / iters[lib])
            for lib in libs:
                trial = max_over_ranks(times[lib])
                sec = statistics.median(trial)
                algbw = nbytes / sec / 1e9
                row[lib].update(time_us=sec * 1e6, algbw=algbw, busbw=algbw * 2 * (world - 1) / world,
                                iters=iters[lib], trial_us=[x * 1e6 for x in trial])
            emit(row)
    emit({"kind": "done"})
    torchring.shutdown()
    dist.destroy_process_group()


# ---------------------------------------------------------------- the driver (runs on the machine)

def iperf3(server: Any, client: Any, streams: int, seconds: float, bidir: bool = False) -> float:
    """Receiver-side bits/s of one iperf3 run from ``client`` to ``server`` (Host objects); with
    ``bidir``, both directions at once and the mean of the two directions' rates."""
    srv, errors, deadline = None, [], time.monotonic() + 20
    try:
        while True:
            if srv is None or srv.poll() is not None:  # -s -1: a server serves one test, then exits
                srv = server.popen(["iperf3", "-s", "-1", "-B", server.addr], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
                time.sleep(0.3)
            r = client.run(["iperf3", "-c", server.addr, "-B", client.addr, "-t", str(seconds),
                            "-P", str(streams), "-J"] + ["--bidir"] * bidir, timeout=seconds + 30,
                           capture_output=True, text=True)
            try:
                end = json.loads(r.stdout)["end"]
                keys = ["sum_received"] + ["sum_received_bidir_reverse"] * bidir
                return statistics.mean(float(end[k]["bits_per_second"]) for k in keys)
            except (ValueError, KeyError, TypeError):
                try:
                    errors.append(str(json.loads(r.stdout).get("error", r.stdout[-300:])))
                except ValueError:
                    errors.append(f"rc {r.returncode}: {r.stdout[-300:]}{r.stderr[-300:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"iperf3 -c {server.addr} -P {streams} gave no result in "
                                   f"{len(errors)} tries: {errors[-3:]}")
            print(f"iperf3 -c {server.addr} -P {streams}: {errors[-1]}; trying again", flush=True)
            time.sleep(0.2)
    finally:
        if srv is not None:
            try:
                srv.wait(timeout=10)
            except subprocess.TimeoutExpired:
                srv.kill()
                srv.wait()


def _link(hs: list, modes: list[str], seconds: float, when: str, link: dict) -> None:
    """iperf3 host 0 -> host 1 once per mode ("1", "2": streams; "bidir": both ways, 1 stream)."""
    for mode in modes:
        bidir = mode == "bidir"
        bps = iperf3(hs[1], hs[0], 1 if bidir else int(mode), seconds, bidir)
        link.setdefault(mode, []).append(bps)
        what = "1 stream each way at once, per direction" if bidir else f"-P {mode}"
        print(f"iperf3 {hs[0].name} -> {hs[1].name}, {what}, {when}: {bps / 1e9:.3f} Gbit/s", flush=True)


def run_job(hs: list, a: argparse.Namespace, rows_path: str) -> list[dict]:
    """Start every rank in its host, relay rows as they come, return rank 0's records."""
    from _host_jobs import job_env, start_ranks

    env = job_env(hs, a.per_host, PORT, GLOO_SOCKET_IFNAME="eth0")
    argv = [sys.executable, os.path.abspath(__file__), "--rank-main", "--rows", rows_path,
            "--sizes", a.sizes, "--dtypes", a.dtypes, "--trials", str(a.trials),
            "--trial-s", str(a.trial_s), "--libs", a.libs]
    procs, logs = start_ranks(hs, argv, env, a.per_host, log="rank{rank}.log")
    records, pos, deadline = [], 0, time.monotonic() + a.timeout
    try:
        while True:
            if os.path.exists(rows_path):
                with open(rows_path) as f:
                    f.seek(pos)
                    for line in iter(f.readline, ""):
                        if not line.endswith("\n"):
                            break
                        pos += len(line)
                        records.append(json.loads(line))
                        _progress(records[-1])
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"the job did not finish in {a.timeout:g} s (--timeout)\n" + _tails(logs))
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    if [p.returncode for p in procs] != [0] * len(procs) or not records or records[-1]["kind"] != "done":
        raise SystemExit(f"the job failed (exit codes {[p.returncode for p in procs]})\n" + _tails(logs))
    return records


def _tails(logs: list[str]) -> str:
    out = []
    for path in logs:
        with open(path, errors="replace") as f:
            out.append(f"--- {os.path.basename(path)}:\n{f.read()[-3000:]}")
    return "\n".join(out)


def _progress(rec: dict) -> None:
    if rec["kind"] == "job":
        print(f"job: world {rec['world']} on {rec['hosts']}, torchring transport {rec['transport']}",
              flush=True)
    elif rec["kind"] == "row":
        parts = [f"{lib} {rec[lib]['time_us'] / 1e3:.2f} ms" for lib in LIBS if lib in rec]
        print(f"  {fmt_size(rec['size'])} {rec['dtype']}: " + ", ".join(parts), flush=True)


def print_table(rows: list[dict], libs: list[str], link_GBps: float, bidir_GBps: float | None) -> None:
    """The table: per library time, algbw, busbw, #wrong, x link (and x bidir); then gloo/tr."""
    names = ["size", "count", "dtype"]
    for lib in libs:
        s = "tr" if lib == "torchring" else lib
        names += [f"{s} time(us)", f"{s} algbw", f"{s} busbw", f"{s} #wrong", f"{s} x link"]
        names += [f"{s} x bidir"] if bidir_GBps else []
    names += ["gloo/tr"] if len(libs) == 2 else []
    print("| " + " | ".join(names) + " |\n|" + "---|" * len(names))
    for row in rows:
        cells = [fmt_size(row["size"]), str(row["count"]), row["dtype"]]
        for lib in libs:
            m = row[lib]
            cells += [f"{m['time_us']:.0f}", f"{m['algbw']:.3f}", f"{m['busbw']:.3f}", str(m["wrong"]),
                      f"{m['busbw'] / link_GBps:.2f}"]
            cells += [f"{m['busbw'] / bidir_GBps:.2f}"] if bidir_GBps else []
        if len(libs) == 2:
            cells.append(f"{row['gloo']['time_us'] / row['torchring']['time_us']:.2f}")
        print("| " + " | ".join(cells) + " |", flush=True)


def _versions() -> dict[str, str]:
    import torchring

    def out(argv: list[str]) -> str:
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=10, cwd=_ROOT).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return "?"

    return {"torchring": torchring.__version__, "commit": out(["git", "rev-parse", "--short", "HEAD"]),
            "dirty": bool(out(["git", "status", "--porcelain", "--", "torchring"])),
            "iperf3": out(["iperf3", "--version"]).split("\n")[0], "kernel": platform.release()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", default="1gbit", help="tc rate of every host's link, or 'none' (default 1gbit)")
    p.add_argument("--hosts", type=int, default=2, help="simulated hosts (default 2)")
    p.add_argument("--per-host", type=int, default=1, help="ranks per host (default 1: a pure TCP ring)")
    p.add_argument("--sizes", default="1M,16M,64M", help="message sizes in bytes, K/M/G suffixes")
    p.add_argument("--dtypes", default="fp32", help="fp32 and/or bf16 (default fp32)")
    p.add_argument("--trials", type=int, default=5, help="timed trials per point and library (default 5)")
    p.add_argument("--trial-s", type=float, default=0.3, help="target seconds per trial (default 0.3)")
    p.add_argument("--libs", default="torchring,gloo", help="torchring and/or gloo (default both)")
    p.add_argument("--iperf", default="1,bidir",
                   help="iperf3 runs: stream counts (-P) and/or 'bidir' (both directions at once); "
                        "the link rate is always -P 1's (default 1,bidir)")
    p.add_argument("--iperf-s", type=float, default=2.0, help="seconds per iperf3 run (default 2)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds the job may take (default 600)")
    common_args(p, quick="sizes 1M,16M; 3 trials of ~0.2 s")
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rows", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank_main:
        return _rank_main(a)
    if a.quick:
        a.sizes, a.trials, a.trial_s = "1M,16M", 3, 0.2
    libs = [lib for lib in LIBS if lib in a.libs.split(",")]
    modes = [m.strip() for m in a.iperf.split(",") if m.strip()]
    if any(m != "bidir" and not m.isdigit() for m in modes):
        raise SystemExit(f"--iperf {a.iperf}: expected stream counts and/or 'bidir', e.g. 1,2,bidir")
    modes = ["1"] + [m for m in modes if m != "1"]
    if a.hosts < 2:
        raise SystemExit(f"--hosts {a.hosts}: a cross-host benchmark needs at least 2 hosts")
    rate = None if a.rate.lower() == "none" else a.rate
    from _hosts import can_make_hosts, hosts  # tests/support/_hosts.py: the same hosts the tests use
    from torchring._core import build as _build

    why = can_make_hosts()
    if why:
        raise SystemExit(f"cannot make test hosts: {why}")
    _build.load()  # build the engine once here, not concurrently in every rank
    info = {**machine_info(), **_versions(), "engine": os.path.basename(str(_build.build_dir()))}
    print(f"# cross-host allreduce: torchring vs gloo vs iperf3  ({info['date']}, {info['cpu']}, "
          f"{info['cores']} cores, torch {info['torch']}, commit {info['commit']}"
          f"{' (torchring/ modified)' if info['dirty'] else ''}, engine {info['engine']}, {info['iperf3']}, "
          f"loadavg {info['loadavg'][0]:.2f})")
    print(f"{a.hosts} hosts x {a.per_host} rank(s), links {rate or 'unshaped veth'}; "
          f"times are medians of {a.trials} interleaved trials", flush=True)
    if a.per_host > 1:
        print("note: with several ranks per host, busbw is the flat ring's formula; torchring's "
              "hybrid path moves fewer bytes across hosts, so its 'x link' can exceed 1")
    if a.hosts * a.per_host > (os.cpu_count() or 1):
        print(f"OVERSUBSCRIBED: {a.hosts * a.per_host} ranks on {os.cpu_count()} cores, "
              "not for bandwidth claims")
    print(flush=True)
    link: dict[str, list[float]] = {}
    import pytest

    try:
        with hosts(a.hosts, rate=rate) as hs:
            _link(hs, modes, a.iperf_s, "before", link)
            records = run_job(hs, a, os.path.join(hs[0].shared, "rows.jsonl"))
            _link(hs, modes, a.iperf_s, "after", link)
    except pytest.skip.Exception as e:  # the fixture's way of saying "not here"
        raise SystemExit(f"cannot make test hosts: {e}") from None
    info["loadavg_after"] = os.getloadavg()
    rows = [r for r in records if r["kind"] == "row"]
    job = next(r for r in records if r["kind"] == "job")
    link_bps = statistics.mean(link["1"])
    print(f"\nlink: iperf3 1 stream {link_bps / 1e9:.3f} Gbit/s = {link_bps / 8e9:.3f} GB/s (mean of "
          f"{', '.join(f'{x / 1e9:.3f}' for x in link['1'])})"
          + "".join(f"; {'bidir, per direction,' if k == 'bidir' else f'-P {k}'} "
                    f"{', '.join(f'{x / 1e9:.3f}' for x in v)} Gbit/s" for k, v in link.items() if k != "1")
          + f"; torchring transport {job['transport']}; loadavg after {info['loadavg_after'][0]:.2f}\n")
    bidir_bps = statistics.mean(link["bidir"]) if "bidir" in link else None
    print_table(rows, libs, link_bps / 8e9, bidir_bps and bidir_bps / 8e9)
    for row in rows:
        for lib in libs:
            row[lib]["x_link"] = row[lib]["busbw"] / (link_bps / 8e9)
            if bidir_bps:
                row[lib]["x_bidir"] = row[lib]["busbw"] / (bidir_bps / 8e9)
    finish(a, info, rows, sum(r[lib]["wrong"] for r in rows for lib in libs), job=job, link_bps=link)


if __name__ == "__main__":
    main()
