"""Re-forming the world in process (torchring.elastic): a rank killed mid-epoch costs a pause,
and the survivors end with the model of an exact reference — every sample of the epoch applied
exactly once, none lost with the dead rank and none repeated after the rollback.

The model is linear in its inputs (loss = w · x(i)), the gradients integer-valued and summed
(not averaged), the learning rate a power of two: whatever the world size and order, the final
weights are w0 - lr * sum of x(i) over the epoch's samples, exactly, if and only if each
sample was trained on once."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

from _dist import spawn

SAMPLES, FEATURES, BATCH, LR = 48, 8, 2, 2.0 ** -10


def _x(i: int) -> torch.Tensor:
    return torch.tensor([float((i * (j + 3)) % 11) for j in range(FEATURES)], dtype=torch.float64)


class _Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(FEATURES, dtype=torch.float64))


def _train(rank: int, kill_rank: int, kill_step: int) -> dict[str, Any]:
    import torchring
    import torchring.elastic as elastic

    torchring.init()
    model = _Linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    sampler = elastic.ElasticSampler(list(range(SAMPLES)), shuffle=True, seed=5)
    state = elastic.State(model=model, optimizer=optimizer, sampler=sampler, step=0)
    trained: list[list[int]] = []  # (epoch, indices) of each step this process completed
    marks: dict[str, float] = {}

    @elastic.run
    def train(state: Any) -> None:
        indices = list(iter(state.sampler))
        for b in range(0, len(indices), BATCH):
            if torchring.rank() == kill_rank and state.step == kill_step and elastic.epoch() == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            chunk = indices[b:b + BATCH]
            optimizer.zero_grad()
            (model.w * sum(_x(i) for i in chunk)).sum().backward()
            torchring.allreduce(model.w.grad)  # a SUM: exact for integer-valued gradients
            optimizer.step()
            if elastic.epoch() == 0:
                marks["last_step_before"] = time.monotonic()
            else:
                marks.setdefault("first_step_after", time.monotonic())
            state.sampler.record_batch(b // BATCH, BATCH)
            state.step += 1
            trained.append([elastic.epoch(), *chunk])
            state.commit()

    train(state)
    result = {"w": model.w.detach().tolist(), "rank": torchring.rank(), "size": torchring.size(),
              "epoch": elastic.epoch(), "steps": state.step, "trained": trained, "marks": marks}
    torchring.shutdown()
    return result


def test_a_killed_rank_costs_a_pause_and_no_sample(capsys: Any) -> None:
    outcomes = spawn(4, _train, 2, 3, env={"TORCHRING_TIMEOUT": "10"}, expect_fail=True, timeout=120)
    assert outcomes[2].exitcode == -signal.SIGKILL, outcomes[2].describe()
    survivors = [outcomes[r] for r in (0, 1, 3)]
    assert all(o.ok for o in survivors), "\n".join(o.describe() for o in survivors)
    results = [o.value for o in survivors]
    # the survivors form epoch 1 of 3 ranks, keeping their order (old 0, 1, 3 -> new 0, 1, 2)
    assert [(r["rank"], r["size"], r["epoch"]) for r in results] == [(0, 3, 1), (1, 3, 1), (2, 3, 1)]
    # 3 steps of 4 ranks x 2 samples, then the other 24 samples as 4 steps of 3 ranks x 2
    assert all(r["steps"] == 7 for r in results), [r["steps"] for r in results]
    want = -LR * sum(_x(i) for i in range(SAMPLES))
    for r in results:
        assert torch.equal(torch.tensor(r["w"], dtype=torch.float64), want), (r["rank"], r["w"], want.tolist())
    # no sample lost or repeated: the survivors' steps after the re-forming cover exactly the
    # samples nobody had trained on by the last commit
    after = sorted(i for r in results for step in r["trained"] if step[0] == 1 for i in step[1:])
    before = sorted(i for r in results for step in r["trained"] if step[0] == 0 for i in step[1:])
    assert len(after) == 24 and len(set(after)) == 24 and not set(after) & set(before)
    pause = max(r["marks"]["first_step_after"] - r["marks"]["last_step_before"] for r in results)
    with capsys.disabled():
        print(f"\n[elastic] 4 -> 3 ranks: from the last step before the kill to the first step after "
              f"the re-forming (detection, settle, init, sync): {pause * 1e3:.0f} ms")


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
