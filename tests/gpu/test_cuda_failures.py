"""Failures on the staged path (several ranks sharing the GPU): CUDA tensors through pinned host
copies and the CPU engine (TORCHRING_CUDA_PATH=staged, so a host with more GPUs runs it too).

- A mismatch (another count, shape, dtype, op, root, kind or order on one rank; the cases of
  tests/support/_mismatches.py, as tests/spawned/api/test_mismatch.py runs them on the CPU)
  raises CollectiveMismatchError on every rank, naming rank 0's call and the first differing
  rank's, without waiting for the timeout; the next collective is exact. Async handles too.
- Handle.wait(timeout) expires with WaitTimeoutError while a peer is late, then completes.
- One rank never joins a collective: every other rank raises CommunicatorFailedError within
  TORCHRING_TIMEOUT (the staged path's watchdog is the CPU engine's), and the next call fails
  at once; nothing hangs.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

import pytest
import torch

from _checks import Checker, expected_allreduce, rank_input
from _dist import Outcome, session, spawn
from _mismatch_job import check_results, run_cases

STAGED = {"TORCHRING_CUDA_PATH": "staged"}
MISMATCH_TIMEOUT = 20.0  # TORCHRING_TIMEOUT of the mismatch job: a mismatch must be found long before
SILENT_TIMEOUT = 5.0  # TORCHRING_TIMEOUT of the silent-rank job
SILENT_MARGIN = 8.0  # how much later than the timeout the others may raise


def _device(device_type: str, chk: Checker) -> torch.device:
    """This rank's device; on CUDA the job must have taken the staged path."""
    import torchring

    if device_type == "cpu":
        return torch.device("cpu")
    chk.true("torchring.cuda.path()", torchring.cuda.path() == "staged",
             f"{torchring.cuda.path()} ({torchring.cuda.reason()}), expected staged")
    dev = torchring.cuda.device()
    if dev is None:
        raise RuntimeError(f"no CUDA device: {torchring.cuda.reason()}")
    return dev


def _timed_wait(chk: Checker, rank: int, world: int, dev: torch.device) -> str | None:
    """Rank 0's allreduce_async waits 0.2 s while the others start 1.5 s late: WaitTimeoutError
    (returned), then wait() gives the exact result; the others' blocking calls are exact too."""
    import torchring

    torchring.barrier()
    t = rank_input(rank, world, 1000, torch.int32).to(dev)
    want = expected_allreduce(world, 1000, torch.int32, "SUM")
    expired = None
    if rank == 0:
        handle = torchring.allreduce_async(t)
        try:
            handle.wait(timeout=0.2)
        except torchring.WaitTimeoutError as e:
            expired = str(e)
        if world > 1:
            chk.true("is_completed() after the expired wait", handle.is_completed() is False)
        out = handle.wait()
        chk.true("wait() after an expired wait returns the tensor", out is t)
    else:
        time.sleep(1.5)
        torchring.allreduce(t)
    chk.equal("allreduce with a late peer", t.cpu(), want)
    return expired


def _mismatch_job(rank: int, odd: int, device_type: str) -> dict[str, Any]:
    """A timed wait, then every mismatch case with an exact allreduce after each, then async
    handles behind a mismatched one (_mismatch_job.run_cases)."""
    import torchring

    chk = Checker(rank)
    with session():
        world = torchring.size()
        dev = _device(device_type, chk)
        expired = _timed_wait(chk, rank, world, dev)
        errors, elapsed = run_cases(chk, rank, world, odd, dev)
    return {"errors": errors, "elapsed": elapsed, "failures": chk.failures, "expired": expired}


def check_mismatch_results(results: list[dict[str, Any]], odd: int, world: int) -> None:
    """Every rank raised for every call of every case, naming rank 0's call and the first
    differing rank's; quickly; the ranks word it alike; the timed wait expired on rank 0."""
    check_results(results, odd, world, MISMATCH_TIMEOUT * 0.75, "mismatches found only near the timeout")
    expired = results[0]["expired"]
    assert expired is not None and "Handle.wait(timeout=0.2) expired" in expired, expired


@pytest.mark.parametrize("world,odd", [(2, 0), (4, 3)])
def test_staged_mismatch_and_timed_wait(world: int, odd: int) -> None:
    env = {**STAGED, "TORCHRING_TIMEOUT": str(MISMATCH_TIMEOUT)}
    check_mismatch_results(spawn(world, _mismatch_job, odd, "cuda", env=env, timeout=120), odd, world)


def _silent_job(rank: int, late: int, flags: str, device_type: str) -> dict[str, Any]:
    """Every rank but `late` calls an allreduce that `late` never joins, then one more; `late`
    waits until they all gave up (their flag files), then leaves."""
    import torchring

    chk = Checker(rank)
    torchring.init()
    out: dict[str, Any] = {"failures": chk.failures}
    try:
        world = torchring.size()
        dev = _device(device_type, chk)
        t = torch.ones(16, device=dev)
        torchring.allreduce(t)  # every rank is up and the path works
        chk.equal("allreduce before the silent rank", t.cpu(), torch.full((16,), float(world)))
        if rank == late:
            deadline = time.monotonic() + 3 * (SILENT_TIMEOUT + SILENT_MARGIN)
            while len(os.listdir(flags)) < world - 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            out["flags_seen"] = len(os.listdir(flags))
        else:
            start = time.monotonic()
            try:
                x = torch.ones(1 << 16, device=dev)
                if rank % 2:  # odd ranks wait on a handle, even ranks block in the call
                    torchring.allreduce_async(x).wait()
                else:
                    torchring.allreduce(x)
                out["error"] = None
            except torchring.TorchringError as e:
                out["error"] = f"{type(e).__name__}: {e}"
            out["elapsed"] = time.monotonic() - start
            start = time.monotonic()
            try:
                torchring.allgather(torch.ones(2, device=dev))
                out["after"] = "no error"
            except Exception as e:  # noqa: BLE001 - the type is the result
                out["after"] = type(e).__name__
            out["after_s"] = time.monotonic() - start
            open(os.path.join(flags, str(rank)), "w").close()
    finally:
        start = time.monotonic()
        try:
            torchring.shutdown()
            out["shutdown"] = None
        except Exception as e:  # noqa: BLE001 - reported, not required
            out["shutdown"] = f"{type(e).__name__}: {e}"
        out["shutdown_s"] = time.monotonic() - start
    return out


def check_silent_results(outcomes: list[Outcome], late: int, world: int) -> None:
    """Every rank returned; the others raised CommunicatorFailedError within the timeout (and at
    once for the next call), one of them naming the silent rank; shutdown was prompt."""
    for o in outcomes:
        assert o.ok, o.describe()
        assert not o.value["failures"], "\n".join(o.value["failures"])
        assert o.value["shutdown_s"] < SILENT_TIMEOUT + SILENT_MARGIN, f"rank {o.rank}: shutdown took {o.value}"
    assert outcomes[late].value["flags_seen"] == world - 1, outcomes[late].value
    survivors = [o.value for o in outcomes if o.rank != late]
    for rank, r in ((o.rank, o.value) for o in outcomes if o.rank != late):
        assert r["error"] is not None, f"rank {rank}: no error while rank {late} never joined"
        assert r["error"].startswith("CommunicatorFailedError: "), f"rank {rank}: {r['error']}"
        assert r["elapsed"] < SILENT_TIMEOUT + SILENT_MARGIN, f"rank {rank}: raised after {r['elapsed']:.1f} s"
        assert r["after"] == "CommunicatorFailedError" and r["after_s"] < 2, f"rank {rank}: the next call: {r}"
    # A silent rank is seen by its ring neighbours, whose own peers then look silent: one
    # survivor naming it is enough (as tests/spawned/api/test_failures.py has it on the CPU).
    named = [r for r in survivors if re.search(rf"\b(rank|peer) {late}\b", r["error"])]
    assert named, f"rank {late} named by no survivor: {[r['error'] for r in survivors]}"


def test_staged_silent_rank_fails_the_others_within_the_timeout(tmp_path) -> None:
    world, late = 3, 1
    env = {**STAGED, "TORCHRING_TIMEOUT": str(SILENT_TIMEOUT)}
    outcomes = spawn(world, _silent_job, late, str(tmp_path), "cuda", env=env, timeout=90, expect_fail=True)
    check_silent_results(outcomes, late, world)
