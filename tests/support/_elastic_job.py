"""The elastic training job of the recovery tests (tests/spawned/elastic/, tests/spawned/multihost/):
a linear model whose exact result tells whether every sample of the epoch was trained on once.

loss = w · x(i) with integer-valued x(i), gradients summed over the ranks (not averaged), SGD
with a power-of-two learning rate: whatever the world size and the order, the final weights
are w0 - LR * sum of x(i) over the epoch, exactly, if and only if each sample was applied once
(none lost with a dead rank, none repeated after the rollback to the last commit).

One member, the victim, stops at the start of step `at_step` of epoch 0 in one of these ways:
"kill" SIGKILLs itself; "wait" writes victim<rank>.json (host, pid) into `out_dir` and sleeps,
for the test to kill, pause or cut off its host; "store" SIGKILLs the store server (pid
$TEST_STORE_PID) and trains on, so that the next commit finds the store gone. With "hold" every member instead commits
again and again at that step until a newcomer is let in (State.commit raises WorldChanged).
A process started after the others (elastic.init() finds the job running) is a newcomer.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from typing import Any

import torch

SAMPLES, FEATURES, BATCH, LR = 48, 8, 2, 2.0 ** -10


def x(i: int) -> torch.Tensor:
    """Sample i's input (integer-valued float64)."""
    return torch.tensor([float((i * (j + 3)) % 11) for j in range(FEATURES)], dtype=torch.float64)


def expected_weights() -> torch.Tensor:
    """The weights after one epoch in which every sample was applied once."""
    return -LR * sum(x(i) for i in range(SAMPLES))


class Linear(torch.nn.Module):
    """w · x, w starting at zero."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(FEATURES, dtype=torch.float64))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return (self.w * inputs).sum()


def train(launch_rank: int, victim: int, at_step: int, how: str = "kill", out_dir: str = "",
          wrapped: bool = False) -> dict[str, Any]:
    """One rank of the job (the launcher's `launch_rank`; torchring initialized here); returns
    what the test checks. `wrapped`: the gradients are averaged by torchring.wrap instead of
    summed by an explicit allreduce (the weights are then a float reference's, not exact)."""
    import torchring
    import torchring.elastic as elastic

    elastic.init()
    model = Linear()
    net = torchring.wrap(model) if wrapped else model
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    sampler = elastic.ElasticSampler(list(range(SAMPLES)), shuffle=True, seed=5)
    state = elastic.State(model=model, optimizer=optimizer, sampler=sampler, step=0)
    trained: list[list[int]] = []  # [epoch, indices...] of each step this process completed
    marks: dict[str, float] = {}

    @elastic.run
    def run(state: Any) -> None:
        indices = list(iter(state.sampler))
        for b in range(0, len(indices), BATCH):
            if how == "hold" and state.step == at_step and elastic.epoch() == 0:
                _hold(state, out_dir)
            if torchring.rank() == victim and state.step == at_step and elastic.epoch() == 0:
                _stop(how, out_dir)
            chunk = indices[b:b + BATCH]
            optimizer.zero_grad()
            net(sum(x(i) for i in chunk)).backward()  # wrapped: the hooks average the gradient
            if not wrapped:
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

    run(state)
    result = {"w": model.w.detach().tolist(), "rank": torchring.rank(), "size": torchring.size(),
              "epoch": elastic.epoch(), "steps": state.step, "trained": trained, "marks": marks}
    torchring.shutdown()
    return result


def train_hvd(launch_rank: int, victim: int, at_step: int, refill: int = 0,
              distributed_optimizer: bool = False) -> dict[str, Any]:
    """The same job through torchring.horovod: hvd.init, hvd.elastic.TorchState and run, a
    summed hvd.allreduce (or, with `distributed_optimizer`, hvd.DistributedOptimizer summing
    in its hooks); the victim SIGKILLs itself at step `at_step`. With `refill` N, the
    survivors commit again and again once re-formed until newcomers bring the world back to N
    (commit raises HostsUpdatedInterrupt when one waits)."""
    import torchring.horovod as hvd
    from torchring.elastic import world

    hvd.init()
    model = Linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    if distributed_optimizer:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), op=hvd.Sum)
    sampler = hvd.elastic.ElasticSampler(list(range(SAMPLES)), shuffle=True, seed=5)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, step=0)
    trained: list[list[int]] = []

    @hvd.elastic.run
    def run(state: Any) -> None:
        indices = list(iter(state.sampler))
        for b in range(0, len(indices), BATCH):
            if hvd.rank() == victim and state.step == at_step and world.epoch() == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            while refill and world.epoch() > 0 and hvd.size() < refill:
                state.commit()
                time.sleep(0.05)
            chunk = indices[b:b + BATCH]
            optimizer.zero_grad()
            model(sum(x(i) for i in chunk)).backward()
            if not distributed_optimizer:
                model.w.grad.copy_(hvd.allreduce(model.w.grad, op=hvd.Sum))
            optimizer.step()  # a DistributedOptimizer waits for its hooks' sums first
            state.sampler.record_batch(b // BATCH, BATCH)
            state.step += 1
            trained.append([world.epoch(), *chunk])
            state.commit()

    run(state)
    result = {"w": model.w.detach().tolist(), "rank": hvd.rank(), "size": hvd.size(), "epoch": world.epoch(),
              "steps": state.step, "trained": trained}
    hvd.shutdown()
    return result


def _hold(state: Any, out_dir: str) -> None:
    """Commit until the newcomer is let in (commit raises WorldChanged on every rank at once);
    rank 0 says in the store (and, given `out_dir`, in its file "holding") that the world is
    holding, for the newcomer to start then."""
    import torchring
    from torchring._core import context

    if torchring.rank() == 0:
        context.wiring()[0].set("test/holding", "1")
        if out_dir:
            open(os.path.join(out_dir, "holding"), "w").close()
    while True:
        state.commit()
        time.sleep(0.05)


def _stop(how: str, out_dir: str) -> None:
    if how == "store":
        os.kill(int(os.environ["TEST_STORE_PID"]), signal.SIGKILL)
        time.sleep(0.2)  # gone before this step's allreduce and the commit after it
        return
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    with open(os.path.join(out_dir, f"victim{os.environ.get('RANK', '?')}.json"), "w") as f:
        json.dump({"host": socket.gethostname(), "pid": os.getpid()}, f)
    time.sleep(600)  # the test kills, pauses or cuts off this host


def averaged_reference(results: list[dict[str, Any]], world: int) -> torch.Tensor:
    """The weights of a single process replaying the survivors' steps with gradients averaged
    over the ranks of each step's world (`world` before the loss, one fewer after); the lost
    rank's chunks in epoch 0 are the samples no survivor trained on by the last commit."""
    steps_before = [len([s for s in r["trained"] if s[0] == 0]) for r in results][0]
    seen_before = {i for r in results for s in r["trained"] if s[0] == 0 for i in s[1:]}
    after_start = {i for r in results for s in r["trained"] if s[0] == 1 for i in s[1:]}
    lost = sorted(set(range(SAMPLES)) - seen_before - after_start)
    w = torch.zeros(FEATURES, dtype=torch.float64)
    for k in range(steps_before):
        chunks = [r["trained"][k][1:] for r in results] + [lost[k * BATCH:(k + 1) * BATCH]]
        w -= LR * (sum(sum(x(i) for i in c) for c in chunks) / world)
    for k in range(steps_before, len(results[0]["trained"])):
        chunks = [r["trained"][k][1:] for r in results]
        w -= LR * (sum(sum(x(i) for i in c) for c in chunks) / (world - 1))
    return w


def check(results: list[dict[str, Any]], size: int) -> list[str]:
    """What is wrong with the results of the ranks of epoch 1, a world of `size`."""
    problems = []
    got = sorted((r["rank"], r["size"], r["epoch"]) for r in results)
    if got != [(k, size, 1) for k in range(size)]:
        problems.append(f"(rank, size, epoch) of the survivors: {got}, expected ranks 0..{size - 1} "
                        f"of {size} in epoch 1")
    want = expected_weights()
    for r in results:
        if not torch.equal(torch.tensor(r["w"], dtype=torch.float64), want):
            problems.append(f"rank {r['rank']}: weights {r['w']}, expected {want.tolist()}")
    after = [i for r in results for step in r["trained"] if step[0] == 1 for i in step[1:]]
    before = {i for r in results for step in r["trained"] if step[0] == 0 for i in step[1:]}
    if len(after) != len(set(after)) or set(after) & before:
        problems.append(f"samples trained twice: {sorted(after)} after the re-forming, {sorted(before)} before")
    return problems
