"""A host killed mid-allreduce under each cross-host algorithm (tests/support/_hosts.py): 6 hosts ×
1 rank (a count that folds two hosts in and out), TORCHRING_ALGO forced, TORCHRING_TIMEOUT=5.
Every survivor raises a CommunicatorFailedError within the timeout + slack, and its message
names the lost rank and its host (directly, or through the failure that reached it first).

This file is also the job (``__main__``): one process per host, no launcher; ranks allreduce a
small and a middle-sized tensor until an error, write ``ready<r>.json`` after a few rounds and
``error<r>.json`` (type, message, time) when they raise.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))
_SUPPORT = os.path.join(_ROOT, "tests", "support")
TIMEOUT_S = 5.0
RAISE_SLACK_S = 10.0  # a loaded 2-core machine: scheduling, torch's error path, the report
HOSTS = 6


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


@pytest.mark.parametrize("algo, lost", [("ring", 3), ("doubling", 3), ("rabenseifner", 3),
                                        ("doubling", 2), ("rabenseifner", 5), ("radix4", 5), ("radix4", 2),
                                        ("multiplying", 5)])
def test_host_killed_mid_allreduce(algo: str, lost: int) -> None:
    """Host `lost` killed: 3 is in the power-of-two core (it folds host 2 in), 2 sits out, 5 is
    a core member with no pair (under radix4 and multiplying, one of three partners each
    survivor in the core exchanges with at once)."""
    from _host_jobs import job_env, start_ranks, wait_all
    from _hosts import hosts

    with hosts(HOSTS) as hs:
        shared = hs[0].shared
        env = job_env(hs, TORCHRING_TIMEOUT=str(TIMEOUT_S), TORCHRING_ALGO=algo)
        procs, _ = start_ranks(hs, [sys.executable, __file__, shared], env)
        try:
            deadline = time.monotonic() + 120
            while not all(os.path.exists(os.path.join(shared, f"ready{r}.json")) for r in range(HOSTS)):
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                    f"the job did not start: codes {[p.poll() for p in procs]}\n" + _logs(shared)
                time.sleep(0.1)
            t_fault = time.time()
            hs[lost].kill_all()
            survivors = [r for r in range(HOSTS) if r != lost]
            deadline = time.monotonic() + TIMEOUT_S + RAISE_SLACK_S + 10
            while time.monotonic() < deadline and not all(
                    os.path.exists(os.path.join(shared, f"error{r}.json")) for r in survivors):
                time.sleep(0.1)
        finally:
            wait_all(procs, 0)
        problems = []
        for r in survivors:
            e = _read(os.path.join(shared, f"error{r}.json"))
            if e is None:
                problems.append(f"rank {r} did not raise")
                continue
            took = e["time"] - t_fault
            if took > TIMEOUT_S + RAISE_SLACK_S:
                problems.append(f"rank {r} raised after {took:.1f} s")
            if e["type"] != "CommunicatorFailedError":
                problems.append(f"rank {r} raised {e['type']}: {e['message']}")
            msg = e["message"]
            if f"rank {lost} " not in msg or (hs[lost].name not in msg and hs[lost].addr not in msg):
                problems.append(f"rank {r}'s message names neither rank {lost} nor its host "
                                f"({hs[lost].name}, {hs[lost].addr}): {msg}")
        assert not problems, "\n".join(problems) + "\n" + _logs(shared)


def _logs(shared: str) -> str:
    return "".join(f"--- rank {r}:\n{open(os.path.join(shared, f'log{r}.txt')).read()[-1500:]}"
                   for r in range(HOSTS) if os.path.exists(os.path.join(shared, f"log{r}.txt")))


def _write(out: str, name: str, data: dict) -> None:
    tmp = os.path.join(out, "." + name)
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, os.path.join(out, name))


def _job(out: str) -> None:
    import torch

    import torchring

    torchring.init()
    rank = torchring.rank()
    algo = os.environ["TORCHRING_ALGO"]
    small, middle = torch.ones(8), torch.ones(300_000)
    assert torchring.algorithm(small) == torchring.algorithm(middle) == algo
    step = 0
    try:
        while step < 100_000:
            torchring.allreduce(small)
            torchring.allreduce(middle)
            step += 1
            if step == 3:
                _write(out, f"ready{rank}.json", {"rank": rank})
    except Exception as e:  # noqa: BLE001 - reported, then the rank fails as it would
        _write(out, f"error{rank}.json", {"type": type(e).__name__, "message": str(e), "time": time.time()})
        raise


if __name__ == "__main__":
    sys.path[:0] = [_SUPPORT, _ROOT]
    _job(sys.argv[1])
