"""Groups against a fake session: what new_group() publishes, checks and wires, group ranks in
the methods, non-members, destroy() and shutdown(), world_group()."""

from __future__ import annotations

import json

import pytest
import torch

import torchring
from _fake_world import PREFIX, FakeWorld
from torchring import CommunicatorFailedError
from torchring._core import context as _context
from torchring._core.types import OpKind


def _published(w: FakeWorld, gid: int, rank: int) -> list[int]:
    return json.loads(w.store.get(f"{PREFIX}group/{gid}/ranks/{rank}"))


def test_members_check_every_ranks_list_then_wire_their_own_communicator(
        monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(monkeypatch, rank=3, size=4, hosts=[[0, 1], [2, 3]])
    for r in (0, 1, 2):
        w.publish(1, r, [1, 3])
    g = torchring.new_group([3, 1])
    assert (g.id, g.ranks, g.rank(), g.size(), g.is_member) == (1, (1, 3), 1, 2, True)
    assert _published(w, 1, 3) == [1, 3]
    # group ranks 0, 1 are world ranks 1, 3: one on each host; no arena for groups; the flight
    # recorder's dumps name the group and its world ranks
    label = "group 1 of world ranks [1, 3] (the ranks in this message are group ranks): "
    assert w.made == [(1, 2, [[0], [1]], {"arena_bytes": 0, "label": label, "trace_name": "group1",
                                          "trace_desc": "torchring.new_group", "trace_ranks": [1, 3]})]
    assert w.wired == [(f"{PREFIX}group/1/", 1, [[0], [1]])]
    assert w.log == ["group1 start"]
    assert w.state.groups == {1: w.comms[0]}


def test_a_rank_that_asked_for_another_group_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(monkeypatch, rank=0, size=3)
    w.publish(1, 1, [0, 1])
    w.publish(1, 2, [0, 2])
    with pytest.raises(ValueError, match=r"^rank 0: torchring.new_group\(\[0, 1\]\) makes group 1 "
                                         r"here, but rank 2's group 1 is new_group\(\[0, 2\]\)"):
        torchring.new_group([0, 1])
    assert w.made == [] and w.state.groups == {}


def test_a_rank_that_never_calls_is_named_after_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(monkeypatch, rank=1, size=3, timeout=0.2)
    w.publish(1, 0, [0, 1])
    with pytest.raises(CommunicatorFailedError, match="rank 2 to call torchring.new_group"):
        torchring.new_group([0, 1])


def test_non_members_publish_and_go_on_but_cannot_use_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(monkeypatch, rank=0, size=4)
    g = torchring.new_group([1, 3])  # nobody else has published: a non-member waits for no one
    assert (g.ranks, g.rank(), g.size(), g.is_member) == ((1, 3), -1, 2, False)
    assert _published(w, 1, 0) == [1, 3] and w.made == []
    for call in (lambda: g.allreduce(torch.ones(2)), lambda: g.send(torch.ones(1), 1),
                 lambda: torchring.barrier(group=g)):
        with pytest.raises(ValueError, match=r"rank 0: torchring\.\w+ on group 1 \(world ranks "
                                             r"\[1, 3\]\), but rank 0 is not a member"):
            call()
    assert w.world.calls == []


def test_each_call_is_the_next_group_and_singletons_need_no_peers(monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(monkeypatch, rank=2, size=4)
    solo = torchring.new_group([2])
    other = torchring.new_group([1])
    assert (solo.id, solo.rank(), other.id, other.rank()) == (1, 0, 2, -1)
    assert _published(w, 1, 2) == [2] and _published(w, 2, 2) == [1]
    label = "group 1 of world ranks [2] (the ranks in this message are group ranks): "
    assert w.made == [(0, 1, [[0]], {"arena_bytes": 0, "label": label, "trace_name": "group1",
                                     "trace_desc": "torchring.new_group", "trace_ranks": [2]})]
    assert w.wired == []
    assert w.log == ["group1 start"]


def test_group_methods_take_group_ranks_and_run_on_the_groups_communicator(
        monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(monkeypatch, rank=3, size=4)
    for r in (0, 1, 2):
        w.publish(1, r, [1, 3])
    g = torchring.new_group([1, 3])
    comm = w.comms[0]
    t = torch.arange(4.0)
    assert g.broadcast(t, src=0) is t
    g.send(t, dst=0, tag=5)
    assert g.reduce(t, dst=1) is t
    assert [c[:1] + c[2:5] for c in comm.calls if c[0] != "send"] == [
        (OpKind.BROADCAST, 0, 0, True), (OpKind.REDUCE, 0, 1, True)]
    assert ("send", 0, 5) in [(c[0], c[2], c[3]) for c in comm.calls]
    assert w.world.calls == []
    with pytest.raises(ValueError, match=r"^rank 3 \(rank 1 of group 1, world ranks \[1, 3\]\): "
                                         r"torchring\.broadcast: src must be a rank of the group "
                                         r"\(group ranks, not world ranks\) in \[0, 2\), got 3"):
        g.broadcast(t, src=3)
    assert g.world_rank(1) == 3 and g.group_rank(1) == 0 and g.group_rank(2) == -1


def test_destroy_shuts_the_communicator_and_later_calls_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(monkeypatch, rank=0, size=1)
    g = torchring.new_group([0])
    g.destroy()
    assert w.log == ["group1 start", "group1 shutdown"] and w.state.groups == {}
    with pytest.raises(RuntimeError, match=r"rank 0: torchring.allreduce on group 1 \(world ranks "
                                           r"\[0\]\), which was destroyed"):
        g.allreduce(torch.ones(1))
    g.destroy()  # twice is harmless
    assert w.log.count("group1 shutdown") == 1


def test_shutdown_destroys_every_group_first_and_kills_old_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(monkeypatch, rank=0, size=1)
    g1, g2 = torchring.new_group([0]), torchring.new_group([0])
    world = torchring.world_group()
    torchring.shutdown()
    assert w.log == ["group1 start", "group2 start", "group1 shutdown", "group2 shutdown",
                     "world shutdown"]
    FakeWorld(monkeypatch, rank=0, size=1)  # a new session
    for g in (g1, world):
        with pytest.raises(RuntimeError, match="belongs to a torchring session that was shut down"):
            g.barrier()
    g2.destroy()  # a dead group's destroy() touches nothing of the new session
    world.destroy()
    assert _context.is_initialized()


def test_world_group_is_the_world(monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(monkeypatch, rank=2, size=3)
    g = torchring.world_group()
    assert g is torchring.world_group()
    assert (g.id, g.ranks, g.rank(), g.size(), g.is_member) == (0, (0, 1, 2), 2, 3, True)
    t = torch.ones(3)
    g.allreduce(t)
    torchring.allreduce(t, group=g)
    assert [c[0] for c in w.world.calls] == [OpKind.ALLREDUCE, OpKind.ALLREDUCE]
    with pytest.raises(ValueError, match=r"^rank 2: torchring.broadcast: src must be a rank in \[0, 3\)"):
        g.broadcast(t, src=3)
    g.destroy()
    assert w.log == ["world shutdown"] and not _context.is_initialized()


def test_group_argument_must_be_a_group(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeWorld(monkeypatch, rank=0, size=2)
    with pytest.raises(TypeError, match="group must be a torchring.Group"):
        torchring.allreduce(torch.ones(1), group=[0, 1])


def test_before_init_group_calls_say_to_init(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_context, "_state", None)
    with pytest.raises(RuntimeError, match=r"torchring.new_group\(\) was called while torchring is not"):
        torchring.new_group([0])
    with pytest.raises(RuntimeError, match=r"torchring.world_group\(\) was called"):
        torchring.world_group()
