"""The engine's flight recorder (engine/flight_recorder.h) on a one-rank communicator: it keeps
the last N operations in order, with their states, times and the Python line that issued them,
each with its own shape, kind, root and seq whatever N and however many shapes came before,
sends and receives with their own seq, peer and tag between collectives (world 2), records
failures as failed, and records nothing when off. Each operation has its own line when calls
move between places and threads. On a host of two ranks, an operation run at once is recorded
while it waits for its peer, whole and with its line."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

import torchring
from _world import ENGINE, run_world
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


def _fast(run: Any, t: torch.Tensor) -> None:
    assert run(t, int(ReduceOp.SUM))  # the engine's fast call, as torchring.allreduce makes it


def _other_fast(run: Any, t: torch.Tensor) -> None:
    assert run(t, int(ReduceOp.SUM))


def test_calls_from_changing_places_are_each_recorded_with_their_own_line() -> None:
    # A call from the place of the last one is answered from the instructions its frames are
    # at, without reading their code objects (bindings_trace.cpp, KeptWalk): calls that move
    # between places, between the frames that lead to one place (two helpers called from the
    # same line), and between the fast call (one call out) and the others must each be
    # recorded with their own line.
    ENGINE.set_trace_skip_prefixes([str(Path(torchring.__file__).parent) + os.sep])
    comm = _comm("recorder-places", 64)
    try:
        run, t, expected = ENGINE.allreduce_now_function(comm), torch.ones(4), []
        for i in range(12):
            if i % 3 == 0:
                _fast(run, t)  # place A
                expected.append(_line("# place A"))
            elif i % 3 == 1:
                _fast(run, t)  # place B
                expected.append(_line("# place B"))
            else:
                for helper in (_fast, _other_fast, _fast):
                    helper(run, t)  # place C, through two helpers
                    expected.append(_line("# place C, through two helpers"))
            if i % 4 == 3:  # now and then, between the others
                comm.submit(OpKind.ALLREDUCE, t, ReduceOp.SUM, -1, True).wait(10)  # place D
                expected.append(_line("# place D"))
        group, frames = _recorded("recorder-places")
        got = [(Path(frames[e["frame"]][0]).name, frames[e["frame"]][1]) for e in group["entries"]]
        assert got == [(Path(__file__).name, at) for at in expected]
    finally:
        comm.shutdown()


def test_threads_calling_from_their_own_places_are_each_recorded_with_their_line() -> None:
    # Two threads, each in its own loop, alternate on one communicator: each operation (its
    # thread told by its shape) has its own thread's line, whatever the other called last.
    ENGINE.set_trace_skip_prefixes([str(Path(torchring.__file__).parent) + os.sep])
    comm = _comm("recorder-threads", 128)
    turns = [threading.Semaphore(1), threading.Semaphore(0)]

    def loop(me: int) -> None:
        run, t = ENGINE.allreduce_now_function(comm), torch.ones(4 + me)
        for _ in range(20):
            assert turns[me].acquire(timeout=10)
            if me == 0:
                _fast(run, t)  # thread 0's place
            else:
                _fast(run, t)  # thread 1's place
            turns[1 - me].release()

    try:
        threads = [threading.Thread(target=loop, args=(me,)) for me in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        group, frames = _recorded("recorder-threads")
        got = [(e["shape"][0], frames[e["frame"]][1]) for e in group["entries"]]
        assert got == [(4, _line("# thread 0's place")), (5, _line("# thread 1's place"))] * 20
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


def _shape(i: int) -> tuple[int, ...]:
    """The i-th operation's shape in the tests below: a few repeat, most are new."""
    return (3,) if i % 3 == 0 else (i % 5 + 1, i + 1)


def _check_kept(capacity: int, operations: int) -> None:
    """`operations` allreduces and broadcasts of many shapes on a recorder of `capacity`: after
    every one, each kept record still names its own shape, kind, root and seq."""
    name = f"recorder-shapes-{capacity}-{operations}"
    comm = _comm(name, capacity)
    try:
        for i in range(operations):
            kind = OpKind.BROADCAST if i % 4 == 1 else OpKind.ALLREDUCE
            comm.submit(kind, torch.ones(_shape(i)), ReduceOp.SUM, 0 if kind == OpKind.BROADCAST else -1,
                        True).wait(10)
            entries = _recorded(name)[0]["entries"]
            assert [e["id"] for e in entries] == list(range(max(0, i + 1 - capacity), i + 1)), (i, entries)
            for e in entries:
                j = e["id"]
                kind_j = "broadcast" if j % 4 == 1 else "allreduce"
                assert (e["seq"], e["kind"], tuple(e["shape"]), e["root"], e["state"]) == (
                    j, kind_j, _shape(j), 0 if kind_j == "broadcast" else -1, "completed"), (i, e)
    finally:
        comm.shutdown()


def test_each_kept_record_has_its_own_shape_kind_root_and_seq() -> None:
    # Capacities that are and are not powers of two, a ring overwritten many times over, and
    # far more distinct shapes than it holds: no record shows another's fields.
    for capacity, operations in ((1, 5), (5, 3), (7, 100), (8, 300), (64, 400)):
        _check_kept(capacity, operations)


def test_send_and_recv_keep_their_own_seq_peer_and_tag_between_collectives() -> None:
    # A collective's seq counts collectives, a send's or recv's counts those: records of both
    # kinds, interleaved, each keep their own count beside the recorder's id.
    name = f"recorder-p2p-{os.getpid()}"
    both = threading.Barrier(2)

    def steps(rank: int, comm: Any) -> list[dict[str, Any]]:
        for n in range(3):
            comm.submit(OpKind.ALLREDUCE, torch.ones(2 + n), ReduceOp.SUM, -1, True).wait(10)
            if rank == 0:
                comm.send(torch.ones(n + 1), 1, 5 + n).wait()
            else:
                comm.recv(torch.empty(n + 1), 0, 5 + n).wait()
        both.wait(10)  # both ranks done, neither shut down yet
        groups = ENGINE.trace_snapshot()[0]
        both.wait(10)
        return groups

    groups = run_world(2, steps, options={"trace_name": name, "trace_entries": 16})[0]
    found = [g for g in groups if g["name"] == name]
    assert len(found) == 2
    kinds = []
    for group in found:
        entries = group["entries"]
        assert [(e["id"], e["seq"], e["p2p"], tuple(e["shape"])) for e in entries] == [
            (0, 0, False, (2,)), (1, 0, True, (1,)), (2, 1, False, (3,)), (3, 1, True, (2,)),
            (4, 2, False, (4,)), (5, 2, True, (3,))], entries
        assert [e["tag"] for e in entries if e["p2p"]] == [5, 6, 7]
        kinds.append(sorted({(e["kind"], e["peer"]) for e in entries if e["p2p"]}))
    assert sorted(kinds) == [[("recv", 0)], [("send", 1)]], kinds


def test_an_operation_run_at_once_is_recorded_while_it_waits_for_its_peer() -> None:
    # On a host of two ranks, the entry of an operation run at once is written once its header
    # is out, while the rank waits for its peers (Communicator::writeDeferredTrace): rank 0's
    # allreduce must show up, started and with its line, while rank 1 has not come yet, and
    # end completed with its times in order, its sum exact.
    ENGINE.set_trace_skip_prefixes([str(Path(torchring.__file__).parent) + os.sep])
    name = f"recorder-waiting-{os.getpid()}"
    seen: list[dict[str, Any]] = []

    def own_entries() -> tuple[list[dict[str, Any]], dict[int, tuple[str, int, str]]]:
        groups, frames, _ = ENGINE.trace_snapshot()
        entries = [e for g in groups if g["name"] == name for e in g["entries"]]
        return entries, frames

    both = threading.Barrier(2)

    def steps(rank: int, comm: Any) -> tuple[float, list[dict[str, Any]]]:
        t = torch.full((1024,), float(rank + 1))
        if rank == 1:  # late: first look at what rank 0's recorder says while it waits
            deadline = time.monotonic() + 10
            while not seen and time.monotonic() < deadline:
                entries, frames = own_entries()
                seen.extend((e, frames.get(e["frame"])) for e in entries)
                time.sleep(0.01)
        comm.submit(OpKind.ALLREDUCE, t, ReduceOp.SUM, -1, True).wait(10)  # the waiting line
        both.wait(10)  # both ranks done, neither shut down yet
        entries = own_entries()[0] if rank == 0 else []
        both.wait(10)
        return t[0].item(), entries

    results = run_world(2, steps, options={"trace_name": name, "trace_entries": 16})
    assert seen, "rank 0's allreduce was not recorded while it waited for rank 1"
    entry, frame = seen[0]
    assert (entry["kind"], entry["seq"], entry["state"], entry["shape"]) == ("allreduce", 0, "started", [1024]), entry
    assert entry["finished_ns"] == 0 < entry["enqueued_ns"] <= entry["started_ns"], entry
    assert frame is not None and (Path(frame[0]).name, frame[1]) == (Path(__file__).name, _line("# the waiting line"))
    assert [r[0] for r in results] == [3.0, 3.0]
    finished = [e for e in results[0][1] if e["state"] == "completed"]
    assert len(finished) == 2, results[0][1]  # both ranks' entries, both whole
    for e in finished:
        assert (e["kind"], e["seq"], e["shape"]) == ("allreduce", 0, [1024]), e
        assert 0 < e["enqueued_ns"] <= e["started_ns"] <= e["finished_ns"], e
