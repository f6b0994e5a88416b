"""The NCCL shrink's decisions without a GPU (torchring/_core/nccl_shrink.py): which old ranks a
re-formed world leaves out, when a rank can shrink, that every rank takes the same path (a
shrink only when all can, with the same plan), and which communicator is freed."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch.distributed as dist

from torchring._core import nccl_shrink


@pytest.mark.parametrize("old_world,old_ranks,exclude", [
    (4, [0, 1, 3], [2]),          # rank 2 lost
    (4, [1, 2, 3], [0]),          # rank 0 lost: the others move up
    (8, [0, 3, 4, 7], [1, 2, 5, 6]),
    (3, [0, 1, 2], []),           # a planned re-forming with everyone: the old communicator as is
    (3, [0, 1, -1], None),        # a newcomer: only a new communicator can take it in
    (3, [1, 0], None),            # another order than NCCL's
    (3, [0, 5], None),            # not a rank of the old world
])
def test_plan_is_the_old_ranks_left_out(old_world: int, old_ranks: list[int], exclude: list[int] | None) -> None:
    assert nccl_shrink.plan(old_world, old_ranks) == exclude


class FakeComm:
    """The engine's NcclComm as far as nccl_shrink uses it; a shrink child records its parent."""

    supported = True
    made: list["FakeComm"] = []

    def __init__(self, parent: "FakeComm", exclude: list[int], parent_failed: bool, timeout: float) -> None:
        assert not parent_failed
        self.parent, self.exclude = parent, exclude
        kept = [r for r in range(parent.size) if r not in exclude]
        self.rank, self.size, self.device = kept.index(parent.rank), len(kept), parent.device
        self.is_failed, self.events = False, []
        FakeComm.made.append(self)

    @classmethod
    def root(cls, rank: int, size: int, device: int = 0, failed: bool = False) -> "FakeComm":
        comm = cls.__new__(cls)
        comm.parent, comm.exclude, comm.rank, comm.size, comm.device = None, None, rank, size, device
        comm.is_failed, comm.events = failed, []
        return comm

    @staticmethod
    def shrink_supported() -> bool:
        return FakeComm.supported

    def failed(self) -> bool:
        return self.is_failed

    def abort(self, why: str) -> None:
        self.events.append("abort")

    def close(self) -> None:
        self.events.append("close")


class FakeEngine:
    NcclComm = FakeComm


@pytest.mark.parametrize("parent,exclude,device,supported,can", [
    (FakeComm.root(1, 4), [2], 0, True, True),
    (None, [2], 0, True, False),                     # nothing kept (the staged path, or no GPU)
    (FakeComm.root(1, 4), None, 0, True, False),     # a newcomer joins
    (FakeComm.root(1, 4), [2], 0, False, False),     # NCCL older than 2.27
    (FakeComm.root(1, 4), [2], 1, True, False),      # another device now
    (FakeComm.root(1, 4, failed=True), [2], 0, True, False),  # it failed, or was aborted
])
def test_a_rank_can_shrink_only_a_healthy_kept_parent(parent: Any, exclude: Any, device: int, supported: bool,
                                                      can: bool) -> None:
    assert nccl_shrink.can_shrink(parent, exclude, device, supported) is can


def _all_ranks(parents: list[FakeComm | None], excludes: list[list[int] | None]) -> list[Any]:
    """shrunk() on every rank of the new world at once (threads, one store), as setup() calls it."""
    store = dist.HashStore()
    out: list[Any] = [None] * len(parents)

    def one(rank: int) -> None:
        out[rank] = nccl_shrink.shrunk(FakeEngine, (parents[rank], excludes[rank]), store, rank, len(parents),
                                       0, 10.0)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(len(parents))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    return out


def test_survivors_shrink_together_and_keep_their_order() -> None:
    FakeComm.made.clear()
    parents = [FakeComm.root(r, 4) for r in (0, 1, 3)]  # old rank 2 was lost
    got = _all_ranks(parents, [[2], [2], [2]])
    assert [c.rank for c in got] == [0, 1, 2] and all(c.size == 3 for c in got)
    assert [c.parent for c in got] == parents and len(FakeComm.made) == 3


def test_one_rank_that_cannot_sends_every_rank_to_a_new_communicator() -> None:
    FakeComm.made.clear()
    parents = [FakeComm.root(0, 4), FakeComm.root(1, 4, failed=True), FakeComm.root(3, 4)]
    assert _all_ranks(parents, [[2], [2], [2]]) == [None, None, None]
    assert FakeComm.made == []  # nobody started a shrink the others would never join


def test_ranks_with_different_plans_do_not_shrink() -> None:
    parents = [FakeComm.root(0, 4), FakeComm.root(1, 4), FakeComm.root(3, 4)]
    assert _all_ranks(parents, [[2], [2], [1, 2]]) == [None, None, None]


def test_the_same_world_keeps_its_communicator_and_release_frees_only_a_replaced_one() -> None:
    parents = [FakeComm.root(r, 2) for r in range(2)]
    got = _all_ranks(parents, [[], []])
    assert got == parents
    nccl_shrink.release(parents[0], got[0])
    assert parents[0].events == []  # it is the new world's communicator
    old = FakeComm.root(0, 3)
    nccl_shrink.release(old, FakeComm(old, [2], False, 1.0))
    assert old.events == ["abort", "close"]
    nccl_shrink.release(None, None)
