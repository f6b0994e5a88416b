"""GradHooks: the autograd side of a gradient sync, one kit for both drivers of the Reducer.

``torchring.wrap``'s DistributedModel (model.py) and ``hvd.DistributedOptimizer``'s GradSync
(horovod/_grad_sync.py) each own one. Words used here and as names below: a *backward* is one
autograd graph task (torch numbers them; a reentrant checkpoint's recomputation inside backward
is a backward of its own); a parameter's *hook* is its post-accumulate-grad hook, which calls
the driver's ``on_ready(i)`` once parameter i's gradient is complete; the *end* of a backward
is torch's final callback on that graph task, which never runs when the backward raised.

The kit holds:
- the hooks: one per parameter given (to the kit, then to ``attach``), each holding a weak
  reference to the kit, which holds the driver weakly too (torch keeps parameter hooks where
  the garbage collector cannot see them, so a strong one would keep a dropped driver and its
  buckets alive); a finalizer removes them when the kit is collected, ``attach`` when it hooks
  a new list;
- the one lock (``LOCK``): autograd runs a model's CUDA part on a device thread and its CPU
  part on the caller's, so hooks can fire on two threads at once; every ``on_ready`` runs under
  it, and a driver holds it around the Reducer's other calls;
- the gradient pool's scope per backward (memory.py): large CPU allocations of a backward come
  from memory kept between steps. The rule, the same for both drivers: a backward is pooled
  from the first moment the kit sees it until its end. The kit sees it in ``enter_backward()``,
  which a driver that sees the backward start calls (the wrapper, from its output's node, before
  any gradient is allocated), and in every hook (an optimizer sees nothing earlier, and the
  inner backward of a reentrant checkpoint is seen only there). Each backward is begun once and
  its end queued on that backward itself, so the scope ends with it even when the driver has
  no finalize to run, and before any finalize queued later (a finalize's allocations, rebuilt
  buckets among them, are no gradients). A backward that raised never reaches its end:
  ``close_failed_backward()``, called by the driver outside backward, ends its scope;
- the finalize, queued once per backward: ``queue_finalize(fn)`` queues fn on the backward
  running now unless one is queued and has not run yet.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Sequence

import torch

from . import memory

__all__ = ["GradHooks", "LOCK"]

# One lock for every kit (module-level, so that a driver holding a kit stays deep-copyable).
LOCK = threading.RLock()


def _graph_task() -> int:
    """The id of the backward this thread runs, or -1 outside backward."""
    return torch._C._current_graph_task_id()


def _remove(handles: list[Any]) -> None:
    """Removes the hooks of a kit (on attach, and when the kit is collected)."""
    for handle in handles:
        handle.remove()
    handles.clear()


class GradHooks:
    """Parameter hooks, the lock, the pool scope and the queued finalize of one driver."""

    def __init__(self, on_ready: Callable[[int], None], params: Sequence[torch.Tensor]) -> None:
        """Hooks `params` for `on_ready`, a method of the driver (which the kit holds weakly).
        Backwards are pooled when some are on the CPU: the pool keeps their gradients' bytes
        (+ slack) until the kit is collected (memory.reserve_grad_pool)."""
        # The driver and its method's function apart: both survive copy.deepcopy of a driver.
        self._driver = weakref.ref(on_ready.__self__)  # type: ignore[attr-defined]
        self._on_ready = on_ready.__func__  # type: ignore[attr-defined]
        self._handles: list[Any] = []  # filled in place: the finalizer below holds this list
        weakref.finalize(self, _remove, self._handles).atexit = False
        cpu_grad_bytes = sum(p.numel() * p.element_size() for p in params if p.device.type == "cpu")
        self.pooled = cpu_grad_bytes > 0 and memory.reserve_grad_pool(self, cpu_grad_bytes)
        self._pooled_tasks: set[int] = set()  # backwards pooled now (their end has not run)
        self._finalize_queued = False
        self.attach(params)

    def attach(self, params: Sequence[torch.Tensor]) -> None:
        """Hooks `params` (replacing the hooks of an earlier list): `on_ready(i)` for params[i]."""
        _remove(self._handles)
        kit = weakref.ref(self)

        def hook_for(i: int) -> Callable[[torch.Tensor], None]:
            def hook(p: torch.Tensor) -> None:
                owner = kit()
                if owner is not None:
                    owner._fire(i)
            return hook
        self._handles.extend(p.register_post_accumulate_grad_hook(hook_for(i))
                             for i, p in enumerate(params))

    def _fire(self, i: int) -> None:
        with LOCK:
            self.enter_backward()
            driver = self._driver()
            if driver is not None:
                self._on_ready(driver, i)

    def enter_backward(self) -> None:
        """The backward running now is pooled until its end (see the module docstring)."""
        if not self.pooled:
            return
        with LOCK:
            if _graph_task() in self._pooled_tasks:
                return
            task = memory.grad_pool_begin()
            if task >= 0:
                self._pooled_tasks.add(task)
                torch.autograd.Variable._execution_engine.queue_callback(lambda: self._end_pool(task))

    def enter_at_grad_of(self, tensor: torch.Tensor) -> None:
        """Enters the backward that computes `tensor`'s gradient, when it does (a tensor hook)."""
        kit = weakref.ref(self)  # the tensor may outlive the kit

        def enter(grad: torch.Tensor) -> None:
            owner = kit()
            if owner is not None:
                owner.enter_backward()
        tensor.register_hook(enter)

    def _end_pool(self, task: int) -> None:
        with LOCK:
            self._pooled_tasks.discard(task)
        memory.grad_pool_end(task)

    def queue_finalize(self, finalize: Callable[[], None]) -> None:
        """Queues `finalize` on the backward running now, unless one is queued and has not run."""
        with LOCK:
            if self._finalize_queued:
                return
            self._finalize_queued = True

        def run() -> None:
            self._finalize_queued = False  # first: a finalize that raises leaves none queued
            finalize()
        torch.autograd.Variable._execution_engine.queue_callback(run)

    @property
    def finalize_queued(self) -> bool:
        """True from queue_finalize() until that backward's end ran the finalize."""
        return self._finalize_queued

    def close_failed_backward(self) -> bool:
        """Outside backward: ends the pool scopes of backwards that raised, forgets a finalize
        they queued, and says whether there was one (False inside a backward: nothing to do)."""
        if _graph_task() != -1:
            return False
        with LOCK:
            tasks, self._pooled_tasks = self._pooled_tasks, set()
            queued, self._finalize_queued = self._finalize_queued, False
        for task in tasks:
            memory.grad_pool_end(task)
        return queued
