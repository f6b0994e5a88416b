"""The new collectives against a fake engine: what each submits (kind, root, keywords), how
results come back (gather's list, alltoall's splits, allgather_into's copies), and the checks
that raise before anything is submitted."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import torchring
from _fake_world import FakeWorld
from torchring import CollectiveMismatchError, ReduceOp
from torchring._core.types import OpKind


def _world(monkeypatch: pytest.MonkeyPatch, rank: int = 1, size: int = 3) -> FakeWorld:
    return FakeWorld(monkeypatch, rank=rank, size=size)


def _only_call(w: FakeWorld) -> tuple:
    (call,) = w.world.calls
    return call


def test_reduce_submits_in_place_with_the_root(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _world(monkeypatch)
    t = torch.ones(4, dtype=torch.int32)
    assert torchring.reduce(t, dst=2, op=ReduceOp.MAX) is t
    assert _only_call(w)[:5] == (OpKind.REDUCE, t, int(ReduceOp.MAX), 2, True)
    h = torchring.reduce_async(t)
    assert w.world.calls[1][3:5] == (0, False) and h.wait() is t
    with pytest.raises(ValueError, match="AVG needs a floating-point tensor"):
        torchring.reduce(t, op=ReduceOp.AVG)


def test_gather_returns_views_per_rank_on_dst_and_none_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _world(monkeypatch)
    rows = [torch.full((2, 3), float(r)) for r in range(3)]
    w.world.respond = lambda kind, t, kw: torch.cat(rows)  # what dst receives
    got = torchring.gather(torch.zeros(2, 3), dst=1)
    assert [g.tolist() for g in got] == [r.tolist() for r in rows]
    assert _only_call(w)[0] == OpKind.GATHER and _only_call(w)[3] == 1
    w.world.respond = lambda kind, t, kw: None  # a rank that is not dst gets nothing
    assert torchring.gather(torch.zeros(2, 3), dst=0) is None
    w.world.respond = lambda kind, t, kw: torch.tensor([4, 5, 6])
    got = torchring.gather(torch.tensor(5), dst=1)
    assert [g.dim() for g in got] == [0, 0, 0] and [g.item() for g in got] == [4, 5, 6]


def test_scatter_concatenates_the_chunks_on_src_only(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _world(monkeypatch, rank=1)
    out = torch.zeros(2, 2)
    chunks = [torch.full((2, 2), float(r)) for r in range(3)]
    assert torchring.scatter(out, chunks, src=1) is out
    kind, t, _, root, _, kw = _only_call(w)
    assert (kind, t, root) == (OpKind.SCATTER, out, 1)
    assert torch.equal(kw["tensors"][0], torch.cat(chunks))
    torchring.scatter(out, chunks, src=0)  # not src here: chunks are ignored
    assert w.world.calls[1][5] == {}
    scalars = [torch.tensor(r) for r in (7, 8, 9)]
    torchring.scatter(torch.tensor(0), scalars, src=1)
    assert w.world.calls[2][5]["tensors"][0].tolist() == [7, 8, 9]


@pytest.mark.parametrize("chunks, error, words", [
    (None, ValueError, r"this rank is src=1 and must pass chunks, a list of 3 tensors like tensor float32\[2\]"),
    ([torch.zeros(2)] * 2, ValueError, "chunks holds 2 tensors; expected 3"),
    ([torch.zeros(2), torch.zeros(3), torch.zeros(2)], ValueError,
     r"chunks\[1\] is float32\[3\] but tensor is float32\[2\]"),
    ([torch.zeros(2), torch.zeros(2), torch.zeros(2, dtype=torch.int64)], ValueError,
     r"chunks\[2\] is int64\[2\]"),
    ([torch.zeros(2), 1, torch.zeros(2)], TypeError, r"chunks\[1\] must be a dense torch.Tensor"),
    (torch.zeros(3, 2), TypeError, "chunks must be a list of tensors"),
])
def test_bad_chunks_on_src_are_named(monkeypatch: pytest.MonkeyPatch, chunks: Any, error: type,
                                     words: str) -> None:
    w = _world(monkeypatch, rank=1)
    with pytest.raises(error, match=words) as info:
        torchring.scatter(torch.zeros(2), chunks, src=1)
    assert str(info.value).startswith("rank 1: torchring.scatter") and w.world.calls == []


def test_allgather_into_copies_every_ranks_rows_into_the_list(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _world(monkeypatch)
    parts = [torch.arange(4).reshape(2, 2) + 10 * r for r in range(3)]
    w.world.respond = lambda kind, t, kw: torch.cat(parts)
    outs = [torch.zeros(2, 2, dtype=torch.int64) for _ in range(3)]
    got = torchring.allgather_into(outs, parts[1].clone())
    assert got == outs and all(torch.equal(o, p) for o, p in zip(outs, parts))
    assert _only_call(w)[0] == OpKind.ALLGATHER
    w.world.respond = lambda kind, t, kw: torch.zeros(5, 2, dtype=torch.int64)  # a peer sent 1 row
    with pytest.raises(CollectiveMismatchError, match="tensors have 5 rows in all, but 3 ranks"):
        torchring.allgather_into(outs, parts[1].clone())
    with pytest.raises(ValueError, match=r"tensor_list\[0\] is int64\[2, 3\] but tensor is int64\[2, 2\]"):
        torchring.allgather_into([torch.zeros(2, 3, dtype=torch.int64)] * 3, parts[1])


def test_reduce_scatter_into_checks_this_ranks_uneven_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _world(monkeypatch, rank=1)  # 7 rows over 3 ranks: 3, 2, 2; rank 1 gets rows [3, 5)
    t = torch.ones(7, 4)
    out = torch.empty(2, 4)
    assert torchring.reduce_scatter_into(out, t) is out
    kind, sent, op, root, inline, kw = _only_call(w)
    assert (kind, sent, root, kw) == (OpKind.REDUCE_SCATTER, t, -1, {"out": out})
    with pytest.raises(ValueError, match=r"out is float32\[3, 4\], expected float32\[2, 4\]: this "
                                         r"rank's rows \[3, 5\) of tensor float32\[7, 4\]"):
        torchring.reduce_scatter_into(torch.empty(3, 4), t)
    view = t[3:5]  # out inside the input: the engine writes a new tensor, copied into out after
    w.world.respond = lambda kind, t, kw: torch.full((2, 4), 6.0)
    torchring.reduce_scatter_into(view, t)
    assert "out" not in w.world.calls[-1][5] and torch.equal(t[3:5], torch.full((2, 4), 6.0))


def test_reduce_scatter_no_longer_needs_divisible_rows_and_takes_factors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    w = _world(monkeypatch)
    torchring.reduce_scatter(torch.ones(5, 2), prescale_factor=0.5)
    torchring.allreduce(torch.ones(3), postscale_factor=2)
    torchring.allreduce(torch.ones(3))
    assert [c[5] for c in w.world.calls] == [{"prescale": 0.5, "postscale": 1.0},
                                             {"prescale": 1.0, "postscale": 2.0}, {}]
    with pytest.raises(ValueError, match=r"prescale_factor/postscale_factor other than 1 need a "
                                         r"floating-point tensor, got int32\[3\]"):
        torchring.allreduce(torch.ones(3, dtype=torch.int32), prescale_factor=2)
    with pytest.raises(ValueError, match="postscale_factor must be a finite number, got nan"):
        torchring.allreduce(torch.ones(3), postscale_factor=float("nan"))
    with pytest.raises(ValueError, match="has no dim 0 to split"):
        torchring.reduce_scatter(torch.tensor(1.0))


def test_allreduce_many_runs_one_operation_per_dtype_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _world(monkeypatch)
    ts = [torch.ones(2), torch.ones(3, dtype=torch.int64), torch.ones(1), torch.ones(4, dtype=torch.int64)]
    assert torchring.allreduce_many(ts, ReduceOp.MAX) == ts
    assert [(c[0], c[1], c[2]) for c in w.world.calls] == [(OpKind.ALLREDUCE_MANY, None, 3)] * 2
    assert [[id(x) for x in c[5]["tensors"]] for c in w.world.calls] == [
        [id(ts[0]), id(ts[2])], [id(ts[1]), id(ts[3])]]
    assert torchring.allreduce_many([]) == []
    with pytest.raises(ValueError, match=r"tensors\[2\] and tensors\[0\] are the same memory"):
        torchring.allreduce_many([ts[0], ts[1], ts[0]])
    with pytest.raises(TypeError, match=r"expects a torch.Tensor as tensors\[1\], got int"):
        torchring.allreduce_many([ts[0], 3])
    with pytest.raises(ValueError, match=r"int64\[3\]"):
        torchring.allreduce_many(ts, prescale_factor=0.5)


def test_alltoall_sends_splits_and_returns_what_the_engine_received(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _world(monkeypatch)

    def respond(kind: OpKind, t: torch.Tensor, kw: dict) -> torch.Tensor:
        kw["recv_splits"].copy_(torch.tensor([1, 0, 2]))  # the engine fills in what arrived
        return torch.arange(3)

    w.world.respond = respond
    out, received = torchring.alltoall(torch.arange(6), [1, 2, 3])
    kind, _, _, _, _, kw = _only_call(w)
    assert kind == OpKind.ALLTOALL and kw["send_splits"].tolist() == [1, 2, 3]
    assert kw["send_splits"].dtype == torch.int64 and "recv_splits_known" not in kw
    assert out.tolist() == [0, 1, 2] and received.tolist() == [1, 0, 2]
    torchring.alltoall(torch.arange(6))
    assert w.world.calls[1][5]["send_splits"].tolist() == [2, 2, 2]
    torchring.alltoall(torch.arange(7))  # blocks that miss a row: the engine fails it on every rank
    assert w.world.calls[2][5]["send_splits"].tolist() == [2, 2, 2]


def test_all_to_all_single_writes_into_output_with_both_splits_known(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _world(monkeypatch)
    inp, out = torch.zeros(6, 2), torch.zeros(4, 2)
    assert torchring.all_to_all_single(out, inp, [2, 1, 1], [3, 3, 0]) is out
    kw = _only_call(w)[5]
    assert kw["out"] is out and kw["recv_splits_known"] is True
    assert kw["send_splits"].tolist() == [3, 3, 0] and kw["recv_splits"].tolist() == [2, 1, 1]
    torchring.all_to_all_single(out, inp)  # 4 rows in 3 blocks: the engine fails it on every rank
    assert w.world.calls[1][5]["recv_splits"].tolist() == [1, 1, 1]
    with pytest.raises(ValueError, match=r"output float32\[4, 3\] and input float32\[6, 2\] must have"):
        torchring.all_to_all_single(torch.zeros(4, 3), inp, [2, 1, 1], [3, 3, 0])


def test_p2p_checks_peer_and_tag(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _world(monkeypatch, rank=1)
    t = torch.ones(3)
    assert torchring.send(t, 2, tag=7) is None
    assert torchring.recv(t, 0) is t
    h = torchring.isend(t, 0)
    assert h.wait() is None
    assert torchring.irecv(t, 2, 1).wait() is t
    assert [(c[0], c[2], c[3]) for c in w.world.calls] == [("send", 2, 7), ("recv", 0, 0),
                                                           ("send", 0, 0), ("recv", 2, 1)]
    for bad, words in ((lambda: torchring.send(t, 1), "dst=1 is this rank itself"),
                       (lambda: torchring.recv(t, 3), r"src must be a rank in \[0, 3\), got 3"),
                       (lambda: torchring.send(t, 0, tag=-1), "tag must be an integer"),
                       (lambda: torchring.irecv(t, 0, tag=True), "tag must be an integer")):
        with pytest.raises(ValueError, match=words):
            bad()
    assert len(w.world.calls) == 4
