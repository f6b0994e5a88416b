"""The engine's flight recorder (engine/flight_recorder.h) on a one-rank communicator: it keeps
the last N operations in order, with their states, times and the Python line that issued them,
records failures as failed, and records nothing when off."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

import torchring
from _world import ENGINE
from torchring._core.types import OpKind, ReduceOp


def _comm(name: str, entries: int) -> Any:
    options = ENGINE.CommOptions()
    options.rank, options.size, options.hosts = 0, 1, [[0]]
    options.trace_entries, options.trace_name, options.trace_desc = entries, name, "a test group"
    comm = ENGINE.Communicator(options)
    comm.start()
    return comm


def _recorded(name: str) -> tuple[dict[str, Any], dict[int, tuple[str, int, str]]]:
    groups, frames, _ = ENGINE.trace_snapshot()
    found = [g for g in groups if g["name"] == name]
    assert len(found) == 1, [g["name"] for g in groups]
    return found[0], frames


def _line(marker: str) -> int:
    return next(n for n, text in enumerate(Path(__file__).read_text().splitlines(), 1) if text.endswith(marker))


def test_the_last_n_operations_are_kept_in_order_with_their_line() -> None:
    ENGINE.set_trace_skip_prefixes([str(Path(torchring.__file__).parent) + os.sep])
    comm = _comm("recorder-ring", 3)
    try:
        t = torch.ones(4)
        for _ in range(4):
            comm.submit(OpKind.ALLREDUCE, t, ReduceOp.SUM, -1, True).wait(10)  # the line recorded
        comm.submit(OpKind.BROADCAST, t, ReduceOp.SUM, 0, False).wait(10)  # queued: recorded from here too
        group, frames = _recorded("recorder-ring")
        assert (group["desc"], group["ranks"], group["capacity"], group["failure"]) == ("a test group", [0], 3, "")
        entries = group["entries"]
        assert [(e["id"], e["seq"], e["kind"], e["state"]) for e in entries] == [
            (2, 2, "allreduce", "completed"), (3, 3, "allreduce", "completed"), (4, 4, "broadcast", "completed")]
        assert entries[0]["what"] == "allreduce #2 float32[4] SUM" and entries[2]["root"] == 0
        for e in entries:
            assert 0 < e["enqueued_ns"] <= e["started_ns"] <= e["finished_ns"], e
        file, at, function = frames[entries[0]["frame"]]
        assert (Path(file).name, at, function) == (Path(__file__).name, _line("# the line recorded"),
                                                  "test_the_last_n_operations_are_kept_in_order_with_their_line")
        assert frames[entries[2]["frame"]][1] == _line("# queued: recorded from here too")
    finally:
        comm.shutdown()


def test_an_operation_after_shutdown_is_recorded_as_failed() -> None:
    comm = _comm("recorder-failed", 8)
    comm.shutdown()
    work = comm.submit(OpKind.ALLREDUCE, torch.ones(2), ReduceOp.SUM, -1, False)
    try:
        work.wait(10)
        raise AssertionError("an operation after shutdown must fail")
    except torchring.TorchringError:
        pass
    group, _ = _recorded("recorder-failed")
    assert [(e["kind"], e["state"]) for e in group["entries"]] == [("allreduce", "failed")]


def test_nothing_is_recorded_when_the_recorder_is_off() -> None:
    comm = _comm("recorder-off", 0)
    try:
        comm.submit(OpKind.ALLREDUCE, torch.ones(2), ReduceOp.SUM, -1, True).wait(10)
        group, _ = _recorded("recorder-off")
        assert group["entries"] == [] and group["capacity"] == 0
    finally:
        comm.shutdown()
