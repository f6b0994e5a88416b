"""Membership epochs (torchring/elastic/membership.py) on a real TCPStore, joiners as threads:
who is in, in which order, when the epoch closes, and what a late or lonely joiner is told."""

from __future__ import annotations

import datetime
import threading
import time
import uuid
from typing import Any

import pytest
import torch.distributed as dist

from torchring.elastic.membership import Epoch, JobEndedError, Member, NotAMemberError, current, join


@pytest.fixture()
def store() -> Any:
    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30),
                         wait_for_workers=False)


def _join_all(store: Any, job: str, members: list[Member], epoch: int = 1, expected: int = 4, min_size: int = 1,
              settle: float = 0.3, timeout: float = 10.0, delays: dict[str, float] | None = None,
              gather: float = 0.0, alive: Any = None) -> dict[str, Any]:
    results: dict[str, Any] = {}

    def one(m: Member) -> None:
        time.sleep((delays or {}).get(m.uid, 0.0))
        client = dist.TCPStore("127.0.0.1", store.port, None, False, timeout=datetime.timedelta(seconds=30))
        try:
            results[m.uid] = join(client, job, epoch, m, expected, min_size, settle, timeout, gather=gather,
                                  alive=alive)
        except Exception as exc:  # the test inspects it
            results[m.uid] = exc

    threads = [threading.Thread(target=one, args=(m,)) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def _member(old_rank: int, name: str = "") -> Member:
    return Member(name or f"host:{old_rank}", old_rank, "host")


def test_every_survivor_gets_the_same_epoch_ranked_by_old_rank(store: Any) -> None:
    job = uuid.uuid4().hex
    members = [_member(r) for r in (3, 0, 2)]  # rank 1 is gone; they arrive out of order
    start = time.monotonic()
    got = _join_all(store, job, members, expected=4, settle=0.3)
    assert time.monotonic() - start < 5
    epochs = list(got.values())
    assert all(isinstance(e, Epoch) for e in epochs), epochs
    assert {e.members for e in epochs} == {(members[1], members[2], members[0])}  # old ranks 0, 2, 3
    assert {got[m.uid].rank for m in members} == {0, 1, 2}
    assert got["host:0"].rank == 0 and got["host:2"].rank == 1 and got["host:3"].rank == 2
    assert all(e.number == 1 and e.size == 3 for e in epochs)
    assert current(store, job) == 1


def test_all_alive_closes_without_waiting_to_settle(store: Any) -> None:
    job = uuid.uuid4().hex
    start = time.monotonic()
    got = _join_all(store, job, [_member(r) for r in range(4)], expected=4, settle=20.0)
    assert time.monotonic() - start < 5, "waited for the settle time although every member had arrived"
    assert [got[f"host:{r}"].rank for r in range(4)] == [0, 1, 2, 3]


def test_newcomers_rank_after_the_survivors(store: Any) -> None:
    job = uuid.uuid4().hex
    members = [Member("new:a", -1, "new"), _member(1), _member(0)]
    got = _join_all(store, job, members, expected=3, delays={"new:a": 0.0, "host:1": 0.1, "host:0": 0.2})
    assert [m.uid for m in got["host:0"].members] == ["host:0", "host:1", "new:a"]


def test_a_late_joiner_is_told_it_is_not_a_member(store: Any) -> None:
    job = uuid.uuid4().hex
    got = _join_all(store, job, [_member(0), _member(1), _member(2)], expected=4, settle=0.2,
                    delays={"host:2": 2.0})
    assert got["host:0"].size == 2 and got["host:1"].size == 2
    assert isinstance(got["host:2"], NotAMemberError), got["host:2"]
    assert "after it closed with 2 members" in str(got["host:2"]) and "rank 2 before" in str(got["host:2"])


@pytest.mark.parametrize("gather", [0.0, 1.5])
def test_gather_waits_for_a_survivor_that_notices_later(store: Any, gather: float) -> None:
    # A silent host's survivors notice apart: host:2 arrives 0.8 s after the others, longer
    # than the settle time. Only a gather time that covers the gap keeps it in the epoch.
    job = uuid.uuid4().hex
    got = _join_all(store, job, [_member(0), _member(1), _member(2)], expected=4, settle=0.2,
                    delays={"host:2": 0.8}, gather=gather)
    if gather:
        assert [got[f"host:{r}"].rank for r in range(3)] == [0, 1, 2]
    else:
        assert got["host:0"].size == 2 and isinstance(got["host:2"], NotAMemberError), got


def test_a_rank_known_alive_is_waited_for_past_the_settle_time(store: Any) -> None:
    # Old rank 2 posted its failure on the old world's board (it lives) and arrives 1 s late;
    # rank 3 never posted (the silent one). The epoch waits for 2, not for 3.
    job = uuid.uuid4().hex
    start = time.monotonic()
    got = _join_all(store, job, [_member(0), _member(1), _member(2)], expected=4, settle=0.2,
                    delays={"host:2": 1.0}, alive=lambda: {0, 1, 2})
    assert [got[f"host:{r}"].rank for r in range(3)] == [0, 1, 2] and got["host:0"].size == 3, got
    assert time.monotonic() - start < 5


def test_too_few_members_time_out_naming_the_shortfall(store: Any) -> None:
    job = uuid.uuid4().hex
    got = _join_all(store, job, [_member(0)], expected=4, min_size=2, settle=0.1, timeout=1.0)
    assert isinstance(got["host:0"], TimeoutError), got["host:0"]
    assert "has 1 of the 2 members it needs" in str(got["host:0"])


def test_the_expected_count_does_not_close_below_the_minimum(store: Any) -> None:
    # Two survivors expected (a third died), but the job needs three: they wait, and a newcomer
    # arriving in time completes the epoch.
    job = uuid.uuid4().hex
    got = _join_all(store, job, [_member(0), _member(1), Member("new:a", -1, "new")], expected=2, min_size=3,
                    settle=0.1, timeout=10.0, delays={"new:a": 0.5})
    assert [m.uid for m in got["host:0"].members] == ["host:0", "host:1", "new:a"]


def test_a_waiting_newcomer_ends_when_the_launcher_says_the_job_ended(store: Any) -> None:
    job = uuid.uuid4().hex
    threading.Timer(0.3, lambda: store.set(f"{job}-ended", "1")).start()
    start = time.monotonic()
    with pytest.raises(JobEndedError, match="finished while this process waited to join epoch 1"):
        join(store, job, 1, Member("new:a", -1, "new"), 0, 1, 0.1, 30.0, may_close=False,
             ended_key=f"{job}-ended")
    assert time.monotonic() - start < 5
