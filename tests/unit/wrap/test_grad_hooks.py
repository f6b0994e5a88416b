"""GradHooks (torchring/_wrap/hooks.py) in one process, no torchring.init(): the kit both drivers
of the Reducer use. A small ``Driver`` stands in for DistributedModel or GradSync and records, at
each parameter hook and at its finalize, which backward (graph task) it ran in and how many
backwards the gradient pool served at that moment (``grad_pool_stats()["active_tasks"]``)."""

from __future__ import annotations

import gc
import weakref
from typing import Iterator

import pytest
import torch
import torch.utils.checkpoint as cp
from torch import nn

from torchring._wrap import memory
from torchring._wrap.hooks import LOCK, GradHooks


def _active() -> int:
    return int(memory.grad_pool_stats()["active_tasks"])


class Driver:
    """Calls queue_finalize from every hook when `finalize_each_backward` (like the wrapper)."""

    def __init__(self, model: nn.Module, finalize_each_backward: bool = False) -> None:
        self.params = list(model.parameters())
        self.ready: list[tuple[int, int, int, bool]] = []  # (i, graph task, pooled backwards, locked)
        self.finalized: list[int] = []  # pooled backwards at each finalize
        self.finalize_each_backward = finalize_each_backward
        self.hooks = GradHooks(self.on_ready, self.params)

    def on_ready(self, i: int) -> None:
        self.ready.append((i, torch._C._current_graph_task_id(), _active(), LOCK._is_owned()))
        if self.finalize_each_backward:
            self.hooks.queue_finalize(self.finalize)

    def finalize(self) -> None:
        self.finalized.append(_active())


@pytest.fixture(autouse=True)
def _pool_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("TORCHRING_GRAD_POOL_MB", raising=False)  # auto: on while a kit lives
    yield
    gc.collect()  # the kits of the test are gone: nothing stays reserved
    assert _active() == 0, "a backward stayed registered with the gradient pool"


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def test_every_hook_calls_on_ready_under_the_lock_with_its_index() -> None:
    model = _mlp()
    driver = Driver(model)
    model(torch.ones(2, 4)).sum().backward()
    assert sorted(i for i, *_ in driver.ready) == [0, 1, 2, 3]
    assert all(locked for *_, locked in driver.ready), driver.ready


def test_a_backward_is_pooled_from_its_first_hook_until_its_end() -> None:
    """An optimizer's rule: no earlier entry than the hooks; the scope ends with the backward."""
    model = _mlp()
    driver = Driver(model)
    assert driver.hooks.pooled
    for _ in range(2):
        model(torch.ones(2, 4)).sum().backward()
        assert _active() == 0, "the pool scope outlived its backward"
    assert all(active == 1 for _, _, active, _ in driver.ready), driver.ready
    assert len({task for _, task, _, _ in driver.ready}) == 2, "one scope per backward"


def test_the_finalize_is_queued_once_per_backward_and_runs_after_the_pool_scope() -> None:
    model = _mlp()
    driver = Driver(model, finalize_each_backward=True)
    for step in range(3):
        model(torch.ones(2, 4)).sum().backward()
        assert len(driver.finalized) == step + 1, "one finalize per backward"
        assert not driver.hooks.finalize_queued
    # The scope's end was queued by the first hook, before that hook queued the finalize.
    assert driver.finalized == [0, 0, 0], driver.finalized


def test_enter_at_grad_of_pools_the_backward_before_the_first_hook() -> None:
    model = _mlp()
    driver = Driver(model)
    seen: list[int] = []
    out = model(torch.ones(2, 4))
    driver.hooks.enter_at_grad_of(out)
    out.register_hook(lambda grad: seen.append(_active()))  # runs after the kit's, before any parameter's
    out.sum().backward()
    assert seen == [1], "the output's gradient was not computed inside a pooled backward"


def test_a_reentrant_checkpoints_inner_backward_is_pooled_too() -> None:
    model = _mlp()
    driver = Driver(model, finalize_each_backward=True)
    x = torch.ones(2, 4, requires_grad=True)
    cp.checkpoint(model, x, use_reentrant=True).sum().backward()
    assert {active for _, _, active, _ in driver.ready} == {1}, driver.ready
    assert len(driver.finalized) == 1, "one finalize for the whole backward"


def test_a_backward_that_raised_is_closed_by_the_next_call_outside_backward() -> None:
    model = _mlp()
    driver = Driver(model, finalize_each_backward=True)

    def fail(grad: torch.Tensor) -> None:
        raise RuntimeError("hook failed on purpose")
    handle = model[0].weight.register_hook(fail)  # after the last layer's hooks fired
    with pytest.raises(RuntimeError, match="on purpose"):
        model(torch.ones(2, 4)).sum().backward()
    handle.remove()
    assert _active() == 1 and driver.hooks.finalize_queued and driver.finalized == []
    assert driver.hooks.close_failed_backward() is True
    assert _active() == 0 and not driver.hooks.finalize_queued
    assert driver.hooks.close_failed_backward() is False
    model(torch.ones(2, 4)).sum().backward()  # the next backward queues its finalize again
    assert driver.finalized == [0]


def test_the_kit_keeps_no_dropped_driver_alive_and_removes_its_hooks() -> None:
    model = _mlp()
    driver = Driver(model)
    gone = weakref.ref(driver)
    del driver  # no gc.collect(): nothing but the driver itself holds it
    assert gone() is None, "the hooks or the kit keep a dropped driver alive"
    model(torch.ones(2, 4)).sum().backward()
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters()), "hooks left behind"


def test_attach_replaces_the_hooks() -> None:
    model = _mlp()
    driver = Driver(model)
    driver.hooks.attach(driver.params[2:])  # the last layer only: indices start at 0 again
    model(torch.ones(2, 4)).sum().backward()
    assert sorted(i for i, *_ in driver.ready) == [0, 1]
