"""Jobs across simulated hosts (tests/support/_hosts.py): layouts 1+1, 2+1+1 and 2+2, each launched the
way a user would, with torchrun's c10d rendezvous on host 0 and one agent per host.

Every rank checks every collective exactly against a single-process reference on integer data
(allreduce SUM/MAX/AVG over float and int dtypes, incl. bf16/fp16 whose host sums go through
the leader in float32, at sizes up to ~1M elements; broadcast from every root; allgather with
a different dim 0 per rank; reduce_scatter with uneven rows; alltoall with uneven splits;
send/recv around the ring, which crosses hosts) and ``torchring.wrap`` parity (the cases of
test_wrap_parity.py). Each rank reports its hostname and transport, so the test knows the job
really spanned the hosts: ranks per host as laid out, shared memory within a host of two,
TCP between hosts.

This file is also the job: torchrun runs it as a script on each host (``__main__`` below);
each rank writes ``rank<r>.json`` into the directory the hosts share.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))
_SUPPORT = os.path.join(_ROOT, "tests", "support")
_WRAP_TESTS = os.path.join(_ROOT, "tests", "spawned", "wrap")  # the ranks run test_wrap_parity's cases
_JOB_TIMEOUT = 150.0  # one layout's launch + job on a loaded 2-core machine takes ~15-30 s

LAYOUTS = {"1+1": [1, 1], "2+1+1": [2, 1, 1], "2+2": [2, 2]}


def torchrun_argv(nnodes: int, nproc: int, endpoint: str, script: str, *args: str,
                  rdzv_conf: str | None = None) -> list[str]:
    """torchrun on one host of a multi-node job: c10d rendezvous at ``endpoint``, no restarts."""
    conf = [f"--rdzv-conf={rdzv_conf}"] if rdzv_conf else []
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
            "--rdzv-id=multihost", "--max-restarts=0", "--monitor-interval=0.5", *conf, script,
            *args]


def job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a host's launcher: this one minus launcher variables, torchring found."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "GROUP_", "ROLE_", "TORCHELASTIC_",
            "SLURM_", "OMPI_", "PMI_", "PMIX_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PYTHONPATH"] = os.pathsep.join([_SUPPORT, _WRAP_TESTS, _ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


def launch(hs: list, layout: list[int], script: str, args: list[str], env: dict[str, str],
           port: int = 29400, rdzv_conf: str | None = None) -> list[subprocess.Popen]:
    """Start torchrun on every host (``layout[i]`` ranks on host i); output to shared logs."""
    procs = []
    endpoint = f"{hs[0].addr}:{port}"
    for h, nproc in zip(hs, layout):
        log = open(os.path.join(h.shared, f"agent-{h.name}.log"), "w")
        procs.append(h.popen(torchrun_argv(len(layout), nproc, endpoint, script, *args,
                                           rdzv_conf=rdzv_conf), env=env,
                             cwd=h.shared, stdout=log, stderr=subprocess.STDOUT))
        log.close()
    return procs


def agent_logs(shared: str) -> str:
    """Every agent's output, for a failure message (the last 3000 characters of each)."""
    out = []
    for name in sorted(os.listdir(shared)):
        if name.startswith("agent-"):
            with open(os.path.join(shared, name), errors="replace") as f:
                out.append(f"--- {name}:\n{f.read()[-3000:]}")
    return "\n".join(out)


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """Exit codes of ``procs`` (None for one still running at the deadline, which is killed)."""
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    return codes


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout(name: str) -> None:
    """Every collective exact and wrap parity on ranks spread over simulated hosts."""
    from _hosts import hosts

    layout = LAYOUTS[name]
    with hosts(len(layout), rate="1gbit") as hs:
        procs = launch(hs, layout, os.path.abspath(__file__), ["--out", hs[0].shared], job_env())
        codes = wait_all(procs, _JOB_TIMEOUT)
        logs = agent_logs(hs[0].shared)
        assert codes == [0] * len(layout), f"launcher exit codes {codes}\n{logs}"
        world = sum(layout)
        reports = []
        for r in range(world):
            path = os.path.join(hs[0].shared, f"rank{r}.json")
            assert os.path.exists(path), f"rank {r} wrote no report\n{logs}"
            with open(path) as f:
                reports.append(json.load(f))
    # The job spanned the hosts as laid out: ranks per hostname, local ranks, transports.
    per_host = {h.name: n for h, n in zip(hs, layout)}
    seen: dict[str, list[int]] = {}
    for rep in reports:
        seen.setdefault(rep["host"], []).append(rep["rank"])
    assert {h: len(rs) for h, rs in seen.items()} == per_host, f"ranks per host: {seen}"
    failures = []
    for rep in reports:
        n_here = per_host[rep["host"]]
        want = "shm+tcp" if n_here > 1 else "tcp"
        if rep["transport"] != want:
            failures.append(f"rank {rep['rank']} on {rep['host']}: transport {rep['transport']!r}, "
                            f"expected {want!r}")
        if rep["local_size"] != n_here or rep["local_rank"] != sorted(seen[rep["host"]]).index(
                rep["rank"]):
            failures.append(f"rank {rep['rank']} on {rep['host']}: local rank/size "
                            f"{rep['local_rank']}/{rep['local_size']}, ranks here {seen[rep['host']]}")
        failures += rep["failures"]
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])


# ----------------------------------------------------------------------------- the job itself
def _collectives(chk, rank: int, world: int) -> None:
    """Every collective against a single-process reference (integer data, exact)."""
    import torch
    import torchring
    from _checks import FLOAT_DTYPES, expected_allreduce, rank_input

    dtypes = FLOAT_DTYPES + [torch.int8, torch.uint8, torch.int32, torch.int64]
    for dtype in dtypes:
        ops = ["SUM", "MAX"] + (["AVG"] if dtype.is_floating_point else [])
        for op in ops:
            # 1 element, an odd size, and (16/32-bit) ~1M elements: several chunks per ring step.
            sizes = [1, 1003] + ([(1 << 20) + 3] if dtype in (torch.float32, torch.bfloat16)
                                 else [(1 << 16) + 1])
            for numel in sizes:
                t = rank_input(rank, world, numel, dtype, op)
                torchring.allreduce(t, getattr(torchring.ReduceOp, op))
                chk.equal(f"allreduce {op} {dtype} x{numel}", t,
                          expected_allreduce(world, numel, dtype, op))
    for src in range(world):
        for dtype, numel in ((torch.float32, 70001), (torch.bfloat16, 33), (torch.int64, 5)):
            t = rank_input(rank, world, numel, dtype)
            torchring.broadcast(t, src=src)
            chk.equal(f"broadcast from {src} {dtype} x{numel}", t,
                      rank_input(src, world, numel, dtype))
    # allgather: rank r contributes r + 1 rows of 3.
    x = rank_input(rank, world, 3 * (rank + 1), torch.float32).reshape(rank + 1, 3)
    want = torch.cat([rank_input(r, world, 3 * (r + 1), torch.float32).reshape(r + 1, 3)
                      for r in range(world)])
    chk.equal("allgather (dim 0 = rank + 1)", torchring.allgather(x), want)
    # reduce_scatter: world * 3 + 1 rows, the first rank gets one more.
    rows = world * 3 + 1
    for dtype in (torch.float32, torch.int32):
        x = rank_input(rank, world, rows * 5, dtype, shape=(rows, 5))
        full = expected_allreduce(world, rows * 5, dtype, "SUM", shape=(rows, 5))
        first = sum(rows // world + (1 if r < rows % world else 0) for r in range(rank))
        mine = rows // world + (1 if rank < rows % world else 0)
        chk.equal(f"reduce_scatter {dtype} {rows} rows", torchring.reduce_scatter(x),
                  full[first:first + mine])
    # alltoall: rank r sends (r + d) % 3 rows to rank d; rows tagged by sender and receiver.
    def rows_for(src: int, dst: int) -> torch.Tensor:
        n = (src + dst) % 3
        return (torch.arange(n * 4, dtype=torch.int64).reshape(n, 4) + 1000 * src + 100 * dst)

    x = torch.cat([rows_for(rank, d) for d in range(world)])
    out, got = torchring.alltoall(x, splits=[(rank + d) % 3 for d in range(world)])
    chk.equal("alltoall rows", out, torch.cat([rows_for(s, rank) for s in range(world)]))
    chk.equal("alltoall counts", got, torch.tensor([(s + rank) % 3 for s in range(world)]))
    # send/recv around the ring (each hop from the last rank of a host to the next host's first
    # crosses hosts), and rank 0 <-> the last rank directly.
    for dtype, numel in ((torch.float32, 100003), (torch.int8, 7)):
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        buf = torch.empty(numel, dtype=dtype)
        hs = torchring.isend(rank_input(rank, world, numel, dtype), nxt, tag=3)
        hr = torchring.irecv(buf, prv, tag=3)
        hr.wait()
        hs.wait()
        chk.equal(f"recv {dtype} x{numel} from {prv}", buf, rank_input(prv, world, numel, dtype))
    last = world - 1
    if rank in (0, last):
        buf = torch.empty(9, dtype=torch.int64)
        if rank == 0:
            torchring.send(torch.arange(9) * 7, last, tag=5)
            torchring.recv(buf, last, tag=6)
            chk.equal("send/recv 0 <-> last", buf, torch.arange(9) * 5)
        else:
            torchring.recv(buf, 0, tag=5)
            torchring.send(torch.arange(9) * 5, 0, tag=6)
            chk.equal("send/recv last <-> 0", buf, torch.arange(9) * 7)
    torchring.barrier()


def _main(argv: list[str]) -> None:
    """One rank of the job: collectives, wrap parity, then its report."""
    import argparse

    import torch
    import torchring
    from _checks import Checker

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    torchring.init()
    rank, world = torchring.rank(), torchring.size()
    chk = Checker(rank)
    report = dict(rank=rank, world=world, host=socket.gethostname(),
                  transport=torchring.transport(), local_rank=torchring.local_rank(),
                  local_size=torchring.local_size())
    try:
        _collectives(chk, rank, world)
        from test_wrap_parity import _cases, _run_case
        for case in _cases():
            _run_case(chk, case, rank, world)
    finally:
        torchring.shutdown()
    report["failures"] = chk.failures
    tmp = os.path.join(a.out, f".rank{rank}.json")
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, os.path.join(a.out, f"rank{rank}.json"))


if __name__ == "__main__":
    sys.path[:0] = [_SUPPORT, _WRAP_TESTS, _ROOT]
    _main(sys.argv[1:])
