"""collectives' CUDA dispatch, on CPU against a fake engine: which NCCL call each kind makes
with its header check, the row counts an NCCL allgather agrees on first, and the staged path
(a pinned copy submitted to the CPU engine under the caller's name, the result copied back)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from torchring._core import context as _context, gpu_path as _gpu_path
from torchring.collectives import basic as collectives
from torchring._core.types import OpKind, ReduceOp


class _Work:
    def __init__(self, seq: int, result: Any = None) -> None:
        self.seq, self.result, self.calls = seq, result, []

    def wait(self, timeout: float = 0.0) -> Any:
        self.calls.append(("wait", timeout))
        return self.result

    def synchronize(self, timeout: float = 0.0) -> Any:
        self.calls.append(("synchronize", timeout))
        return self.result

    def is_completed(self) -> bool:
        return bool(self.calls)


class _Engine:
    """The CPU communicator (submit, submit_check) and the NCCL one, recording every call."""

    def __init__(self, gathered_rows: list[int]) -> None:
        self.calls: list[tuple] = []
        self.names: list[str] = []
        self.rows = gathered_rows
        self.seq = 40

    def submit(self, kind: int, t: torch.Tensor, op: int, root: int, inline: bool) -> _Work:
        self.calls.append(("submit", kind, t, op, root, inline))
        self.seq += 1
        if kind == OpKind.ALLGATHER and t.dtype == torch.int64 and t.numel() == 1:
            return _Work(self.seq, torch.tensor(self.rows))
        return _Work(self.seq, t * 10)  # what the CPU engine "reduced"

    def submit_check(self, kind: int, like: torch.Tensor, op: int, root: int) -> _Work:
        self.calls.append(("check", kind, like, op, root))
        self.seq += 1
        return _Work(self.seq)

    def __getattr__(self, name: str) -> Any:  # allreduce, broadcast, allgather, reduce_scatter
        def nccl_call(*args: Any) -> _Work:  # the last argument is the header check
            self.calls.append((f"nccl.{name}", *args))
            return _Work(args[-1].seq, "nccl result")
        return nccl_call


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> _Engine:
    fake = _Engine(gathered_rows=[3, 5])

    def communicator(what: str) -> _Engine:
        fake.names.append(what)
        return fake

    monkeypatch.setattr(_context, "communicator", communicator)
    monkeypatch.setattr(_gpu_path, "nccl_comm", lambda: fake)
    monkeypatch.setattr(collectives, "_pinned_copy", lambda t: t.clone())
    return fake


def test_nccl_allreduce_checks_the_header_then_runs_with_the_check(engine: _Engine) -> None:
    t = torch.ones(6)
    handle = collectives._nccl(OpKind.ALLREDUCE, t, ReduceOp.AVG, -1, "allreduce_async")
    check, call = engine.calls
    assert check[:2] == ("check", 0) and check[2] is t and check[3:] == (1, -1)
    assert call[0] == "nccl.allreduce" and call[1] is t and call[2] == 1
    assert repr(handle) == "<torchring.Handle #41 pending>", "one sequence number: the check's"
    assert engine.names == ["allreduce_async"]
    assert handle.wait(timeout=2.0) == "nccl result"
    assert handle.work.calls == [("wait", 2.0)]


def test_nccl_broadcast_and_reduce_scatter(engine: _Engine) -> None:
    t = torch.ones(4)
    collectives._nccl(OpKind.BROADCAST, t, 0, 1, "broadcast")
    collectives._nccl(OpKind.REDUCE_SCATTER, t, ReduceOp.MAX, -1, "reduce_scatter")
    kinds = [(c[0], c[1]) if c[0] == "check" else (c[0],) for c in engine.calls]
    assert kinds == [("check", 1), ("nccl.broadcast",), ("check", 3), ("nccl.reduce_scatter",)]
    assert engine.calls[0][3:] == (0, 1) and engine.calls[1][2] == 1  # root 1 in check and call
    assert engine.calls[2][3:] == (3, -1) and engine.calls[3][2] == 3  # MAX in check and call


def test_nccl_allgather_agrees_on_row_counts_first(engine: _Engine) -> None:
    t = torch.ones(3, 2)
    collectives._nccl(OpKind.ALLGATHER, t, 0, -1, "allgather")
    rows, check, call = engine.calls
    assert rows[:2] == ("submit", 2) and rows[2].tolist() == [3] and rows[5] is True
    assert check[:2] == ("check", 2)
    assert call[0] == "nccl.allgather" and call[1] is t and call[2] == [3, 5]


@pytest.mark.parametrize("inline", [True, False])
def test_staged_allreduce_submits_a_copy_under_the_callers_name_and_copies_back(
        engine: _Engine, inline: bool) -> None:
    t = torch.arange(4, dtype=torch.float32)
    what = "allreduce" if inline else "allreduce_async"
    handle = collectives._staged(OpKind.ALLREDUCE, t, ReduceOp.SUM, -1, inline, what)
    (submit,) = engine.calls
    assert submit[:2] == ("submit", 0) and submit[2] is not t and submit[3:] == (0, -1, inline)
    assert engine.names == [what]
    assert t.tolist() == [0, 1, 2, 3], "nothing written back before wait()"
    assert handle.wait() is t and t.tolist() == [0, 10, 20, 30]


def test_staged_allgather_returns_a_new_tensor(engine: _Engine) -> None:
    t = torch.ones(2, 2)
    out = collectives._staged(OpKind.ALLGATHER, t, 0, -1, True, "allgather").wait()
    assert out is not t and out.tolist() == [[10, 10], [10, 10]] and t.tolist() == [[1, 1], [1, 1]]


def test_nccl_runs_what_nccl_has_and_stages_the_rest() -> None:
    for kind in (OpKind.ALLREDUCE, OpKind.BROADCAST, OpKind.ALLGATHER, OpKind.REDUCE_SCATTER):
        assert collectives.nccl_runs(kind, torch.float32, True, False)
        assert not collectives.nccl_runs(kind, torch.int16, True, False), "NCCL has no int16"
        assert not collectives.nccl_runs(kind, torch.float32, False, False), "groups are staged"
        assert not collectives.nccl_runs(kind, torch.float32, True, True), "factors, out=: staged"
        for op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):  # NCCL has no bitwise reduction
            assert collectives.nccl_runs(kind, torch.int32, True, False, op) == (not kind.reduces), (kind, op)
        assert collectives.nccl_runs(kind, torch.int32, True, False, ReduceOp.MAX)
    for kind in (OpKind.REDUCE, OpKind.GATHER, OpKind.SCATTER, OpKind.ALLTOALL, OpKind.ALLREDUCE_MANY):
        assert not collectives.nccl_runs(kind, torch.float32, True, False)
