"""torchring.horovod's pieces that need no job: the negotiation's validation and its rounds (on
an in-process exchange between threads), the timeline file, process-set arguments, op
resolution with the deprecated average=, alltoall's split checks, and what hvd does before init."""

from __future__ import annotations

import json
import threading
import warnings
from typing import Any, Callable

import pytest
import torch

import torchring.horovod as hvd
from torchring._core.errors import (CollectiveMismatchError, CommunicatorFailedError, TorchringError,
                                    WaitTimeoutError)
from torchring._core.types import ReduceOp
from torchring.horovod import (exceptions, handles, ops_gather, ops_reduce, process_sets,
                               timeline)
from torchring.horovod.negotiator import Done, Entry, Negotiator, Request, validate


def _req(kind: str = "allreduce", shapes: Any = ((4,),), dtype: str = "torch.float32", **more: Any) -> Request:
    return Request(name=f"{kind}.x", kind=kind, dtype=dtype, shapes=tuple(map(tuple, shapes)), **more)


# ---------------------------------------------------------------------------------- validate
def test_identical_requests_are_valid() -> None:
    for kind in ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter"):
        assert validate({r: _req(kind, root=0, op=1) for r in range(3)}, frozenset()) is None


@pytest.mark.parametrize("kind, odd, words", [
    ("allreduce", dict(shapes=((5,),)), ["shape", "[4]", "[5]"]),
    ("allreduce", dict(shapes=((2, 2),)), ["shape", "[2, 2]"]),
    ("allreduce", dict(dtype="torch.int32"), ["dtype", "torch.int32", "torch.float32"]),
    ("allreduce", dict(op=4), ["op"]),
    ("allreduce", dict(prescale=0.5), ["prescale"]),
    ("allreduce", dict(postscale=2.0), ["postscale"]),
    ("allreduce", dict(shapes=((4,), (4,))), ["number of tensors"]),
    ("allreduce", dict(device="cuda"), ["device"]),
    ("reducescatter", dict(shapes=((6,),)), ["shape"]),
    ("broadcast", dict(root=2), ["root"]),
    ("broadcast", dict(shapes=((4, 1),)), ["shape"]),
    ("allgather", dict(shapes=((4, 3),)), ["dimensions"]),
    ("alltoall", dict(dtype="torch.float64"), ["dtype"]),
])
def test_a_rank_that_differs_is_named(kind: str, odd: dict, words: list[str]) -> None:
    base: dict[str, Any] = dict(op=1, root=0)
    requests = {0: _req(kind, **base), 1: _req(kind, **base),
                2: _req(kind, **{**base, "shapes": ((4,),), **odd})}
    why = validate(requests, frozenset())
    assert why is not None
    for word in words + ["rank 2", "rank 0"]:
        assert word in why, (word, why)


def test_allgather_and_alltoall_may_differ_in_dim0_only() -> None:
    for kind in ("allgather", "alltoall"):
        ok = {0: _req(kind, ((1, 3, 2),)), 1: _req(kind, ((7, 3, 2),)), 2: _req(kind, ((0, 3, 2),))}
        assert validate(ok, frozenset()) is None
        bad = {0: _req(kind, ((1, 3, 2),)), 1: _req(kind, ((1, 2, 3),))}
        assert "rank 1" in (validate(bad, frozenset()) or "")


def test_joined_ranks_refuse_data_movers_but_not_reductions() -> None:
    for kind in ("allgather", "broadcast", "alltoall"):
        why = validate({0: _req(kind, root=0), 2: _req(kind, root=0)}, frozenset({1}))
        assert why is not None and "1" in why and "join" in why
    for kind in ("allreduce", "reducescatter"):
        assert validate({0: _req(kind), 2: _req(kind)}, frozenset({1})) is None
    assert validate({0: Request("barrier", "barrier"), 1: Request("barrier", "barrier")}, frozenset()) is None


# ---------------------------------------------------------------------------------- negotiation
class _Exchange:
    """An in-process stand-in for a process set's private group: round k's allgather of every
    member returns the members' tensors once all of them gave one; allreduce_async records."""

    def __init__(self, n: int) -> None:
        self.n, self.cv, self.broken = n, threading.Condition(), False
        self.rounds: dict[int, dict[int, torch.Tensor]] = {}
        self.reduced: dict[int, list[torch.Tensor]] = {r: [] for r in range(n)}

    def group(self, pos: int) -> Any:
        ex, calls = self, [0]

        class Work:
            def __init__(self, k: int) -> None:
                self.k = k

            def wait(self, timeout: float | None = None) -> torch.Tensor:
                with ex.cv:
                    if not ex.cv.wait_for(lambda: ex.broken or len(ex.rounds[self.k]) == ex.n, timeout):
                        raise WaitTimeoutError("fake exchange: peers have not arrived")
                    if ex.broken:
                        raise RuntimeError("fake exchange: link down")
                    return torch.cat([ex.rounds[self.k][i] for i in range(ex.n)])

        class Group:
            def allgather_async(self, t: torch.Tensor) -> Work:
                k = calls[0]
                calls[0] += 1
                with ex.cv:
                    ex.rounds.setdefault(k, {})[pos] = t.clone()
                    ex.cv.notify_all()
                return Work(k)

            def allreduce_async(self, t: torch.Tensor, *args: Any, **kwargs: Any) -> Done:
                with ex.cv:
                    ex.reduced[pos].append(t.clone())
                    ex.cv.notify_all()
                return Done(t)

            def size(self) -> int:
                return ex.n

        return Group()


@pytest.fixture
def negotiators() -> Any:
    made: list[Negotiator] = []

    def make(n: int) -> list[Negotiator]:
        ex = _Exchange(n)
        made.extend(Negotiator(ex.group(r), tuple(range(n)), r, 7, 0.001, 0.0) for r in range(n))
        made[-1].exchange = ex  # type: ignore[attr-defined]
        return made[-n:]

    yield make
    for neg in made:
        neg.stop()


def _entry(name: str, log: list[str] | None = None, kind: str = "allreduce", shape: tuple = (4,),
           value: Any = None) -> Entry:
    def start(requests: dict, joined: frozenset) -> Done:
        if log is not None:
            log.append(name)
        return Done(value if value is not None else (sorted(requests), sorted(joined)))
    return Entry(Request(name=name, kind=kind, dtype="torch.float32", shapes=(shape,), op=hvd.Sum), start)


def _done(entry: Entry) -> Entry:
    assert entry.done.wait(10), f"{entry.request.name} not resolved"
    return entry


def test_names_submitted_in_different_orders_start_in_one_order(negotiators: Callable) -> None:
    negs = negotiators(3)
    names = [f"op{i}" for i in range(6)]
    logs: list[list[str]] = [[], [], []]
    entries = []
    for r, neg in enumerate(negs):
        order = names[r:] + names[:r]
        for name in (reversed(order) if r == 1 else order):
            entries.append(_entry(name, logs[r]))
            neg.submit(entries[-1])
    for e in entries:
        assert _done(e).error is None and e.result.value == ([0, 1, 2], [])
    assert sorted(logs[0]) == names and logs[0] == logs[1] == logs[2]


def test_a_name_in_flight_cannot_be_submitted_again(negotiators: Callable) -> None:
    a, b = negotiators(2)
    first = _entry("dup")
    a.submit(first)
    with pytest.raises(ValueError, match="dup"):
        a.submit(_entry("dup"))
    other = _entry("dup")
    b.submit(other)
    assert _done(first).error is None and _done(other).error is None
    again = [_entry("dup"), _entry("dup")]  # finished: the name is free again
    a.submit(again[0])
    b.submit(again[1])
    assert all(_done(e).error is None for e in again)


def test_a_mismatch_fails_on_every_rank_and_names_the_ranks(negotiators: Callable) -> None:
    negs = negotiators(2)
    bad = [_entry("m", shape=(4,)), _entry("m", shape=(5,))]
    for neg, e in zip(negs, bad):
        neg.submit(e)
    for e in bad:  # the engine's class for the same situation: the communicator stays usable
        assert isinstance(_done(e).error, CollectiveMismatchError)
        assert "rank 0" in str(e.error) and "rank 1" in str(e.error) and "'m'" in str(e.error)
    ok = [_entry("after"), _entry("after")]
    for neg, e in zip(negs, ok):
        neg.submit(e)
    assert all(_done(e).error is None for e in ok)


def test_a_joined_rank_adds_zeros_and_join_returns_the_last(negotiators: Callable) -> None:
    negs = negotiators(3)
    ex = negs[-1].exchange
    joins = [Entry(Request("join", "join"), lambda r, j: Done()) for _ in range(3)]
    negs[1].submit(joins[1])
    ops = {r: _entry("x", shape=(2, 3)) for r in (0, 2)}
    for r, e in ops.items():
        negs[r].submit(e)
    for e in ops.values():
        assert _done(e).error is None and e.result.value == ([0, 2], [1])
    with ex.cv:  # the joined rank's thread takes part in the same round, maybe a little later
        ex.cv.wait_for(lambda: ex.reduced[1], 10)
    assert [t.shape for t in ex.reduced[1]] == [torch.Size([2, 3])] and not ex.reduced[1][0].any()
    assert not joins[1].done.is_set()
    negs[2].submit(joins[2])
    negs[0].submit(joins[0])
    results = [_done(j).result.value for j in joins]
    assert results[0] == results[1] == results[2] and results[0] in (0, 2)


def test_a_failed_exchange_fails_every_entry_and_later_submits(negotiators: Callable) -> None:
    a, b = negotiators(2)
    ex = b.exchange
    waiting = _entry("never")
    a.submit(waiting)
    with ex.cv:  # a's thread is in round 0, waiting for b, when the link fails
        assert ex.cv.wait_for(lambda: 0 in ex.rounds.get(0, {}), 10)
        ex.broken = True
        ex.cv.notify_all()
    assert "link down" in str(_done(waiting).error)
    with pytest.raises(Exception, match="link down"):
        a.submit(_entry("late"))


def test_stopped_negotiator_refuses_new_operations(negotiators: Callable) -> None:
    a, _b = negotiators(2)
    a.stop()
    with pytest.raises(TorchringError, match="rank 0: late: Horovod is shutting down"):
        a.submit(_entry("late"))


# ---------------------------------------------------------------------------------- timeline
def _events(path: Any) -> list[dict]:
    with open(path) as f:
        return json.load(f)


def test_timeline_is_valid_json_with_horovods_phase_names(tmp_path: Any) -> None:
    path = tmp_path / "t.json"
    timeline.start(str(path), mark_cycles=True)
    try:
        assert timeline.active()
        timeline.negotiate_start("allreduce.w", "allreduce")
        timeline.cycle_start()
        timeline.negotiate_end("allreduce.w", "allreduce")
        timeline.op_end("allreduce.w")
        timeline.negotiate_start("allgather.open", "allgather")  # still open at stop()
    finally:
        timeline.stop()
    assert not timeline.active()
    events = _events(path)
    rows = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert sorted(rows.values()) == ["allgather.open", "allreduce.w"]
    w = next(p for p, name in rows.items() if name == "allreduce.w")
    phases = [(e["name"], e["ph"]) for e in events if e.get("pid") == w and e.get("ph") in "BE"]
    assert phases == [("NEGOTIATE_ALLREDUCE", "B"), ("NEGOTIATE_ALLREDUCE", "E"), ("ALLREDUCE", "B"),
                      ("ALLREDUCE", "E")]
    for pid in rows:
        marks = [e["ph"] for e in events if e.get("pid") == pid and e.get("ph") in ("B", "E")]
        assert marks.count("B") == marks.count("E"), (rows[pid], marks)
    assert any(e.get("name") == "CYCLE_START" for e in events)
    stamps = [e["ts"] for e in events if "ts" in e]
    assert stamps == sorted(stamps)


def test_timeline_without_mark_cycles_and_when_off(tmp_path: Any) -> None:
    timeline.negotiate_start("allreduce.off", "allreduce")  # no trace: nothing happens
    timeline.cycle_start()
    timeline.stop()
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    timeline.start(str(first))
    timeline.negotiate_start("allreduce.a", "allreduce")
    timeline.start(str(second))  # ends the first trace as valid JSON
    try:
        timeline.cycle_start()
        timeline.negotiate_start("broadcast.b", "broadcast")
    finally:
        timeline.stop()
    assert any(e.get("name") == "NEGOTIATE_ALLREDUCE" for e in _events(first))
    events = _events(second)
    assert not any(e.get("name") == "CYCLE_START" for e in events)
    assert any(e.get("name") == "NEGOTIATE_BROADCAST" for e in events)


# ---------------------------------------------------------------------------------- process sets
def test_process_set_ranks_are_sorted_and_deduplicated() -> None:
    assert hvd.ProcessSet([2, 0, 2]).ranks == [0, 2]
    assert hvd.ProcessSet(range(3)).ranks == [0, 1, 2]
    ps = hvd.ProcessSet([1, 3])
    assert (ps.size(), ps.rank(), ps.process_set_id) == (None, None, None)  # not registered


@pytest.mark.parametrize("bad", [["a"], [1.0], [True, 2], 5, None])
def test_process_set_refuses_what_is_not_a_list_of_ranks(bad: Any) -> None:
    with pytest.raises(ValueError):
        hvd.ProcessSet(bad)


def test_process_set_calls_before_init_are_refused() -> None:
    assert not hvd.is_initialized()
    with pytest.raises(ValueError, match="init"):
        hvd.add_process_set([0, 1])
    with pytest.raises(ValueError, match="global"):
        hvd.remove_process_set(hvd.global_process_set)
    assert hvd.remove_process_set(hvd.ProcessSet([0])) is False
    with pytest.raises(ValueError, match="not registered"):
        hvd.ProcessSet([0, 1]).negotiator("allreduce")


def test_automatic_names_count_per_kind() -> None:
    ps = process_sets.ProcessSet([0, 1])
    got = [ps.auto_name("allreduce"), ps.auto_name("allgather"), ps.auto_name("allreduce")]
    assert got == ["allreduce.noname.0", "allgather.noname.0", "allreduce.noname.1"]


# ---------------------------------------------------------------------------------- ops' arguments
def test_op_constants_are_horovods() -> None:
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    from torchring.horovod.basics import to_reduce_op
    assert [to_reduce_op(op) for op in (hvd.Sum, hvd.Min, hvd.Max, hvd.Product)] == [
        ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]
    with pytest.raises(RuntimeError, match="Adasum"):  # NotImplementedError is a RuntimeError
        to_reduce_op(hvd.Adasum)
    with pytest.raises(ValueError):
        to_reduce_op(17)


def test_average_is_the_deprecated_spelling_of_op() -> None:
    with pytest.warns(DeprecationWarning):
        assert ops_reduce.resolve_op(None, True, "allreduce") == hvd.Average
    with pytest.warns(DeprecationWarning):
        assert ops_reduce.resolve_op(None, False, "allreduce") == hvd.Sum
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ops_reduce.resolve_op(None, None, "allreduce") == hvd.Average
        assert ops_reduce.resolve_op(hvd.Max, None, "allreduce") == hvd.Max
    with pytest.raises(ValueError, match="not both"):
        ops_reduce.resolve_op(hvd.Sum, True, "allreduce")


@pytest.mark.parametrize("splits, rows, want", [
    (None, 6, [2, 2, 2]),
    ([1, 0, 4], 5, [1, 0, 4]),
    (torch.tensor([3, 1, 1], dtype=torch.int32), 5, [3, 1, 1]),
    (torch.tensor([0, 0, 2], dtype=torch.int64), 4, [0, 0, 2]),
])
def test_alltoall_splits(splits: Any, rows: int, want: list[int]) -> None:
    assert ops_gather._splits(splits, rows, 3, "alltoall") == want


@pytest.mark.parametrize("splits, rows, words", [
    (None, 7, "divisible"),
    ([1, 1, 9], 5, "add up"),
    (torch.ones(3, dtype=torch.float32), 3, "integers"),
    ([1.0, 1.0, 1.0], 3, "integers"),
    ([1, 1], 3, "one non-negative entry per rank"),
    ([2, -1, 1], 3, "non-negative"),
])
def test_alltoall_bad_splits(splits: Any, rows: int, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        ops_gather._splits(splits, rows, 3, "alltoall")


def test_tensors_that_cannot_go_to_the_engine() -> None:
    with pytest.raises(ValueError, match="torch.Tensor"):
        ops_reduce.check_tensor([1, 2], "allreduce")
    with pytest.raises(ValueError, match="sparse"):
        ops_reduce.check_tensor(torch.eye(2).to_sparse(), "allreduce")
    with pytest.raises(ValueError, match="contiguous"):
        ops_reduce.check_tensor(torch.ones(3, 4).t(), "allreduce_", in_place=True)
    with pytest.raises(ValueError, match="complex64 is not supported"):
        ops_reduce.check_tensor(torch.ones(2, dtype=torch.complex64), "allreduce")
    t = torch.ones(3, 4).t()
    assert ops_reduce.check_tensor(t, "allreduce") is t


def test_before_init() -> None:
    assert not hvd.is_initialized()
    for fn in (hvd.size, hvd.rank, hvd.local_rank):
        with pytest.raises(ValueError, match="init"):
            fn()
    with pytest.raises(ValueError):
        hvd.allreduce(torch.ones(2))
    with pytest.raises(ValueError, match="no such handle"):
        hvd.poll(123456)
    assert hvd.synchronize(123456) is None


def test_failures_reach_users_as_horovod_internal_error() -> None:
    failed = Entry(Request("x", "allreduce"), lambda r, j: Done())
    failed.resolve(error=RuntimeError("rank 1 disagreed"))
    with pytest.raises(hvd.HorovodInternalError, match="rank 1 disagreed"):
        handles.wait_entry(failed)
    misuse = Entry(Request("y", "allreduce"), lambda r, j: Done())
    misuse.resolve(error=ValueError("bad argument"))
    with pytest.raises(ValueError, match="bad argument"):
        handles.wait_entry(misuse)


@pytest.mark.parametrize("exc,wrapped", [
    (RuntimeError("torch refused"), True),  # Horovod's rule: any RuntimeError of an operation
    (CommunicatorFailedError("rank 1 died"), True),
    (CollectiveMismatchError("rank 1 sent [4]"), True),
    (TorchringError("Horovod is shutting down"), True),
    (ValueError("bad argument"), False),
    (TypeError("not a tensor"), False),
    (NotImplementedError("hvd.Adasum"), False),
    (KeyboardInterrupt(), False),
])
def test_one_mapping_to_horovods_error(exc: BaseException, wrapped: bool) -> None:
    got = exceptions.to_horovod(exc)
    if not wrapped:
        assert got is exc
        return
    assert type(got) is hvd.HorovodInternalError and str(got) == str(exc) and got.__cause__ is exc
    assert exceptions.to_horovod(got) is got  # never wrapped twice


def test_only_a_failed_communicator_counts_as_one() -> None:
    failed = exceptions.communicator_failed
    assert failed(CommunicatorFailedError("rank 1 died"))
    assert failed(exceptions.to_horovod(CommunicatorFailedError("rank 1 died")))
    assert failed(hvd.HorovodInternalError("raised by the script"))  # as Horovod treats it
    assert failed(exceptions.to_horovod(RuntimeError("torch refused")))
    assert not failed(exceptions.to_horovod(CollectiveMismatchError("rank 1 sent [4]")))
    assert not failed(exceptions.to_horovod(TorchringError("Horovod is shutting down")))
    assert not failed(CollectiveMismatchError("rank 1 sent [4]"))
    assert not failed(ValueError("bad argument"))


def test_horovods_names_for_the_exceptions() -> None:
    assert hvd.HorovodInternalError is exceptions.HorovodInternalError
    assert hvd.elastic.HostsUpdatedInterrupt is exceptions.HostsUpdatedInterrupt
    assert hvd.elastic.state.HostsUpdatedInterrupt is exceptions.HostsUpdatedInterrupt
    assert exceptions.HostsUpdatedInterrupt(skip_sync=True).skip_sync
    fine = Entry(Request("z", "allreduce"), lambda r, j: Done())
    fine.resolve(Done(41))
    assert handles.wait_entry(fine) == 41
