"""Re-forming the world in process (torchring.elastic) on one host: a rank killed mid-epoch
costs a pause, and the survivors end with the exact weights of an epoch in which every sample
was applied once (tests/support/_elastic_job.py); a planned re-forming keeps every rank."""

from __future__ import annotations

import signal
import time
from typing import Any

import torch

from _dist import spawn
from _elastic_job import check, train

def test_a_killed_rank_costs_a_pause_and_no_sample(capsys: Any) -> None:
    outcomes = spawn(4, train, 2, 3, env={"TORCHRING_TIMEOUT": "10"}, expect_fail=True, timeout=120)
    assert outcomes[2].exitcode == -signal.SIGKILL, outcomes[2].describe()
    survivors = [outcomes[r] for r in (0, 1, 3)]
    assert all(o.ok for o in survivors), "\n".join(o.describe() for o in survivors)
    results = [o.value for o in survivors]
    assert check(results, 3) == []
    # old ranks 0, 1, 3 keep their order as 0, 1, 2
    assert [r["rank"] for r in results] == [0, 1, 2]
    # 3 steps of 4 ranks x 2 samples, then the other 24 samples as 4 steps of 3 ranks x 2
    assert all(r["steps"] == 7 for r in results), [r["steps"] for r in results]
    after = [i for r in results for step in r["trained"] if step[0] == 1 for i in step[1:]]
    assert len(after) == 24
    pause = max(r["marks"]["first_step_after"] - r["marks"]["last_step_before"] for r in results)
    with capsys.disabled():
        print(f"\n[elastic] 4 -> 3 ranks: from the last step before the kill to the first step after "
              f"the re-forming (detection, settle, init, sync): {pause * 1e3:.0f} ms")


def test_rank_0_killed_with_the_store_it_served_the_survivors_meet_at_a_standby() -> None:
    # host_store=False: rank 0's process serves the rendezvous store (the launch default), so
    # its death takes the store too; the survivors re-form through the first standby in line.
    outcomes = spawn(4, train, 0, 3, env={"TORCHRING_TIMEOUT": "10"}, expect_fail=True, timeout=120,
                     host_store=False)
    assert outcomes[0].exitcode == -signal.SIGKILL, outcomes[0].describe()
    survivors = outcomes[1:]
    assert all(o.ok for o in survivors), "\n".join(o.describe() for o in survivors)
    results = [o.value for o in survivors]
    assert check(results, 3) == []
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["epoch"] == 1 and r["steps"] == 7 for r in results), [(r["epoch"], r["steps"]) for r in results]


def test_a_lost_store_outside_the_workers_moves_at_the_next_commit() -> None:
    # The store runs in a process of its own (as torchrun's agent or a job's store server does)
    # and dies while every rank lives: rank 0's commit finds it gone, and the whole world
    # re-forms through a standby, keeping every rank and every sample.
    from _store_server import store_server

    with store_server() as (pid, port):
        env = {"TORCHRING_TIMEOUT": "10", "TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_PORT": str(port),
               "TEST_STORE_PID": str(pid)}
        results = spawn(4, train, 1, 3, "store", env=env, timeout=120, host_store=False)
    assert check(results, 4) == []
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert all(r["steps"] == 6 for r in results), [r["steps"] for r in results]


def test_wrap_keeps_averaging_over_the_re_formed_world() -> None:
    from _elastic_job import averaged_reference

    outcomes = spawn(4, train, 2, 3, "kill", "", True, env={"TORCHRING_TIMEOUT": "10"}, expect_fail=True,
                     timeout=120)
    survivors = [outcomes[r] for r in (0, 1, 3)]
    assert all(o.ok for o in survivors), "\n".join(o.describe() for o in survivors)
    results = [o.value for o in survivors]
    assert [(r["rank"], r["size"]) for r in results] == [(0, 3), (1, 3), (2, 3)]
    want = averaged_reference(results, 4)
    for r in results:
        got = torch.tensor(r["w"], dtype=torch.float64)
        assert torch.allclose(got, want, rtol=1e-12, atol=0), (r["rank"], got.tolist(), want.tolist())


def _newcomer(rank: int) -> dict[str, Any]:
    """Started with the others, it waits until they hold at step 4, then joins the running job."""
    import datetime
    import os

    import torch.distributed as dist

    from _elastic_job import train

    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), None, False,
                          timeout=datetime.timedelta(seconds=60))
    store.wait(["test/holding"])
    return train(rank, -1, 4, how="hold")


def test_a_newcomer_is_let_in_at_the_next_commit() -> None:
    three = {"WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3"}
    outcomes = spawn(4, _dispatch, env={"TORCHRING_TIMEOUT": "20"}, rank_env=[three, three, three, {}],
                     expect_fail=True, timeout=120)
    assert all(o.ok for o in outcomes), "\n".join(o.describe() for o in outcomes)
    results = [o.value for o in outcomes]
    # 4 steps of 3 ranks x 2 samples, then the other 24 as 3 steps of 4 ranks x 2
    assert sorted((r["rank"], r["size"], r["epoch"]) for r in results) == [(k, 4, 1) for k in range(4)]
    assert results[3]["rank"] == 3, "the newcomer ranks after the members"
    assert all(r["steps"] == 7 for r in results), [r["steps"] for r in results]
    assert check(results, 4) == []


def _dispatch(rank: int) -> dict[str, Any]:
    from _elastic_job import train

    return _newcomer(rank) if rank == 3 else train(rank, -1, 4, how="hold")


def _planned(rank: int) -> dict[str, Any]:
    import torchring
    import torchring.elastic as elastic

    torchring.init()
    before = torchring.allreduce(torch.full((4,), float(rank + 1))).tolist()
    start = time.monotonic()
    joined = elastic.reform()
    took = time.monotonic() - start
    after = torchring.allreduce(torch.full((4,), float(10 * (torchring.rank() + 1)))).tolist()
    group = torchring.new_group([0, 2])
    in_group = torchring.allreduce(torch.ones(2), group=group).tolist() if torchring.rank() in (0, 2) else None
    out = {"before": before, "after": after, "rank": torchring.rank(), "size": torchring.size(),
           "epoch": joined.number, "group": in_group, "took": took}
    torchring.shutdown()
    return out


def test_a_planned_re_forming_keeps_every_rank_and_closes_at_once() -> None:
    results = spawn(3, _planned, timeout=120)
    assert [r["rank"] for r in results] == [0, 1, 2] and {r["size"] for r in results} == {3}
    assert {r["epoch"] for r in results} == {1}
    assert all(r["before"] == [6.0] * 4 and r["after"] == [60.0] * 4 for r in results)
    assert results[0]["group"] == [2.0, 2.0] and results[2]["group"] == [2.0, 2.0] and results[1]["group"] is None
    # every member arrived, so the epoch closed without waiting out the settle time (1 s)
    assert max(r["took"] for r in results) < 5.0, [r["took"] for r in results]
