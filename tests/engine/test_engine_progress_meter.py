"""The engine's progress meter (engine/progress_meter.h), what a rank's status line reads: the
operation in flight and its age, the operations counted, and the time with one in flight kept
as a union (never more than the wall time, however many overlap)."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from _world import ENGINE, run_world
from torchring._core.types import OpKind, ReduceOp


def test_the_operation_a_rank_waits_in_is_current_and_its_time_counts_once() -> None:
    before = ENGINE.trace_progress()
    seen: dict[str, Any] = {}
    both_done, read = threading.Barrier(2), threading.Barrier(2)
    begin = time.monotonic()

    def fn(rank: int, comm: Any) -> float:
        t = torch.full((1024,), float(rank + 1))
        if rank == 1:
            time.sleep(0.6)  # rank 0 waits in its allreduce meanwhile
            seen["during"] = ENGINE.trace_progress()
        comm.submit(OpKind.ALLREDUCE, t, ReduceOp.SUM, -1, True).wait(20)
        both_done.wait(10)
        if rank == 0:  # while both communicators (and their recorders) still live
            seen["after"] = ENGINE.trace_progress()
        read.wait(10)
        return float(t[0])

    assert run_world(2, fn) == [3.0, 3.0]
    wall = time.monotonic() - begin
    after = seen["after"]
    during = seen["during"]["current"]
    assert during is not None and during["kind"] == "allreduce" and during["state"] in ("scheduled", "started")
    assert during["describe"] == "float32[1024] SUM" and 0.4 < during["age_s"] < 5, during
    assert after["current"] is None and after["last"]["kind"] == "allreduce" and after["last"]["ago_s"] >= 0
    grown = after["in_flight_s"] - before["in_flight_s"]
    assert 0.4 < grown <= wall + 0.05, (grown, wall)


def test_many_overlapping_operations_add_no_more_than_the_wall_time() -> None:
    def fn(rank: int, comm: Any) -> int:
        t = torch.ones(256)
        works = [comm.submit(OpKind.ALLREDUCE, t.clone(), ReduceOp.SUM, -1, False) for _ in range(700)]
        for w in works:
            w.wait(20)
        # The meter reads live recorders only: a communicator that ends between two reads
        # leaves its time out. The operations can all end within one 5 ms interval, so the
        # communicator stays up until the reader has read twice more.
        seen, deadline = len(readings), time.monotonic() + 10
        while len(readings) < seen + 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        return 700

    stop = threading.Event()
    readings: list[dict[str, Any]] = []

    def read() -> None:  # the status writer reads while the operations run, as in a job
        while not stop.is_set():
            readings.append(ENGINE.trace_progress())
            time.sleep(0.005)

    before = ENGINE.trace_progress()
    begin = time.monotonic()
    reader = threading.Thread(target=read)
    reader.start()
    try:
        run_world(2, fn)
    finally:
        stop.set()
        reader.join()
    wall = time.monotonic() - begin
    after = ENGINE.trace_progress()
    assert 0 < after["in_flight_s"] - before["in_flight_s"] <= wall + 0.05, (before, after, wall)
    flights = [r["in_flight_s"] for r in readings]
    committed = [r["in_flight_s"] for r in readings if r["current"] is None]
    assert committed == sorted(committed), "the committed time never goes back"
    assert max(flights, default=0) <= after["in_flight_s"] + 0.05
