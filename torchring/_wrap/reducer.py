"""The Reducer: a bucket layout over a list of parameters, and the state of one gradient sync.

Words used here and as variable names: parameter ``i`` is ``params[i]``, named ``names[i]``;
a *bucket* is one flat buffer that holds the gradients of several parameters (buckets.py);
*launching* a bucket starts its AVG allreduce, and buckets are launched strictly in index
order, so every rank issues the same collectives in the same order; a *sync* is everything
between two ``finalize()`` calls; the *used-map* has one flag per parameter, set when this rank
contributes a gradient to the sync.

The contract, for whichever driver owns the Reducer (``torchring.wrap``'s module wrapper in
model.py; an optimizer that syncs in ``step()``):

1. ``mark_ready(i)`` once parameter i's gradient for this sync is complete in
   ``params[i].grad``: the wrapper calls it from a post-accumulate-grad hook in every
   synchronized backward; an optimizer with ``backward_passes_per_step=k`` counts the hook
   calls and calls it in the k-th backward. The gradient moves into its bucket slot (``.grad``
   becomes a view of the bucket, so later accumulation happens in place, without a copy), the
   bucket counts down, and every bucket that is complete and whose predecessors were launched
   is launched. A second call for the same parameter in one sync does nothing.
2. ``launch_remaining()`` launches every bucket not launched yet: a parameter that was not
   marked contributes the gradient it holds (left by no_sync steps or set by the user; it then
   counts as used) or zeros; then it launches one MAX allreduce of the used-map. Optional:
   ``finalize()`` calls it when it was not called; a driver calls it early to overlap.
3. ``finalize()`` waits for every bucket and the used-map and settles each ``.grad``: the
   average over all ranks when any rank used the parameter, left None when no rank did. The
   sync's state is reset afterwards, also when it raised: then it first waits for every
   allreduce it launched (a failure such as a CollectiveMismatchError leaves the communicator
   alive, so the later ones still write into the buckets), ignoring their errors, and raises
   the first one; the next ``mark_ready`` starts a new sync. ``mark_ready`` after
   ``launch_remaining`` and before ``finalize`` is a driver bug and raises RuntimeError.
4. ``rebuild_by_ready_order()`` after a ``finalize()``, at the same point on every rank: the
   first time, every rank adopts the order in which rank 0's gradients became ready in its
   first sync (through ``agree_on_order``, rank 0's broadcast by default) and the buckets are
   laid out again in that order; later calls return False at once. ``rebuild(order, params,
   names, learn_order=True)`` lays the buckets out over a new parameter list (parameters that
   became trainable) and makes the next sync's ready order the one adopted again.
5. ``recover()`` when a sync was abandoned (a backward raised between ``mark_ready`` and
   ``finalize``): waits for what was launched, resets, and returns how many buckets had been
   launched, so the driver can tell the user that ranks may now disagree on the next collective.

Nothing here takes a lock: a driver whose ``mark_ready`` calls come from several threads (a
model with CPU and CUDA parts) holds one around them and around ``finalize()`` (hooks.py's
``LOCK``, which the drivers' parameter hooks run under).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

from .._core import context as _context
from . import buckets
from ..collectives import basic as collectives
from .._core.types import ReduceOp

__all__ = ["Reducer", "AllreduceAsync", "AgreeOnOrder", "Allocate", "FIRST_BUCKET_CAP_BYTES",
           "BUCKET_CAP_BYTES"]

# The bucket caps of torchring.wrap and hvd.DistributedOptimizer: a small first bucket, launched
# early in backward, then DDP's 25 MiB.
FIRST_BUCKET_CAP_BYTES = 1 << 20
BUCKET_CAP_BYTES = 25 << 20

# allreduce_async(tensor, op) -> a handle whose wait() returns once `tensor` holds the result.
AllreduceAsync = Callable[[torch.Tensor, ReduceOp], Any]
# agree_on_order(names in this rank's ready order) -> the order every rank adopts.
AgreeOnOrder = Callable[[list[str]], list[str]]
# allocate(numel, dtype, device) -> a flat, uninitialized bucket buffer.
Allocate = Callable[[int, torch.dtype, torch.device], torch.Tensor]


def _rank0_order(order: list[str]) -> list[str]:
    """Rank 0's gradient-ready order, on every rank (a collective)."""
    return collectives.broadcast_object(order, src=0)


class Reducer:
    """Buckets the gradients of `params` and averages them across ranks, one sync at a time."""

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str], *,
                 first_bucket_cap_bytes: int = FIRST_BUCKET_CAP_BYTES,
                 bucket_cap_bytes: int = BUCKET_CAP_BYTES,
                 compression: torch.dtype | None = None,
                 allreduce_async: AllreduceAsync | None = None,
                 agree_on_order: AgreeOnOrder | None = None, allocate: Allocate | None = None,
                 rank: int | None = None, owner: str = "torchring.wrap",
                 assignment: Sequence[Sequence[int]] | None = None) -> None:
        """`allreduce_async` defaults to torchring.collectives.allreduce_async (looked up now),
        `agree_on_order` to rank 0's order, `allocate` to shared memory on the CPU; `rank` and
        `owner` only name this process and the caller in messages. `assignment` (lists of
        parameter indices, one device and dtype each, in launch order) fixes the buckets: the
        caps and rebuild_by_ready_order() then do not apply (rebuild() drops it)."""
        self._caps = (int(first_bucket_cap_bytes), int(bucket_cap_bytes))
        self._compression = compression
        self._allreduce_async = allreduce_async or collectives.allreduce_async
        self._agree = agree_on_order or _rank0_order
        self._allocate = allocate
        self._rank = _context.rank() if rank is None else rank
        self._owner = owner
        self._ready_order: list[str] = []  # names, in the order gradients arrived (first sync)
        self._assignment = [list(b) for b in assignment] if assignment is not None else None
        self._rebuilt = assignment is not None
        self._stats: list[dict[str, Any]] = []
        self._layout(list(params), list(names), first=())

    # ------------------------------------------------------------------- layout
    def _layout(self, params: list[torch.Tensor], names: list[str], first: Sequence[str]) -> None:
        """Buckets for `params`: those named in `first` in that order, then the rest in reverse
        registration order."""
        if len(params) != len(names):
            raise ValueError(f"rank {self._rank}: {self._owner}: {len(params)} parameters but "
                             f"{len(names)} names; give one name per parameter")
        self._params, self._names = params, names
        position = {n: i for i, n in enumerate(names)}
        # dict.fromkeys: a name given twice (an order recorded over a backward that failed
        # and was retried) must not put one parameter in two buckets.
        order = list(dict.fromkeys(position[n] for n in first if n in position))
        placed = set(order)
        order += [i for i in reversed(range(len(params))) if i not in placed]
        self._buckets = buckets.build(params, names, order, *self._caps, self._compression,
                                      self._allocate, self._assignment)
        self._slot: list[tuple[buckets.Bucket, int]] = [None] * len(params)  # type: ignore[list-item]
        for bucket in self._buckets:
            for j, i in enumerate(bucket.slots):
                self._slot[i] = (bucket, j)
        self._used = torch.zeros(len(params), dtype=torch.uint8)
        self._reset()

    def rebuild(self, order: Sequence[str], params: Sequence[torch.Tensor] | None = None,
                names: Sequence[str] | None = None, *, learn_order: bool = False) -> None:
        """Lays the buckets out again, the parameters named in `order` first (between syncs);
        with `params` and `names`, over that new list (the driver's indices change); with
        `learn_order`, rebuild_by_ready_order() applies again after the next sync. bucket_stats()
        keeps the last finalized sync's until the next one is finalized."""
        if self.in_progress:
            raise RuntimeError(f"rank {self._rank}: {self._owner}: buckets cannot be rebuilt "
                               "during a sync; call finalize() or recover() first")
        if params is None:
            params, names = self._params, self._names
        self._assignment = None
        if learn_order:
            self._ready_order, self._rebuilt = [], False
        self._layout(list(params), list(names or []), first=order)

    def rebuild_by_ready_order(self, params: Sequence[torch.Tensor] | None = None,
                               names: Sequence[str] | None = None) -> bool:
        """Once, after a finalize(): adopts rank 0's first ready order (see rebuild); True if it did."""
        if self._rebuilt:
            return False
        mine, self._ready_order, self._rebuilt = self._ready_order, [], True
        self.rebuild(self._agree(mine), params, names)
        return True

    @property
    def rebuilt(self) -> bool:
        """True once the buckets follow the agreed ready order."""
        return self._rebuilt

    @property
    def num_buckets(self) -> int:
        """How many buckets the parameters are split into."""
        return len(self._buckets)

    def layout(self) -> list[list[str]]:
        """The parameter names of each bucket, in launch order."""
        return [list(bucket.names) for bucket in self._buckets]

    def bucket_stats(self) -> list[dict[str, Any]]:
        """Per bucket of the last finalized sync: bytes, params, launch lead and wait."""
        return [dict(s) for s in self._stats]

    # --------------------------------------------------------------------- sync
    @property
    def in_progress(self) -> bool:
        """True between the first mark_ready (or launch_remaining) and finalize/recover."""
        return (self._next_bucket > 0 or self._used_handle is not None
                or any(b.pending != len(b.params) for b in self._buckets))

    def mark_ready(self, i: int) -> None:
        """Parameter i's gradient for this sync is complete: bucket it, launch what is ready."""
        if self._used_handle is not None:
            raise RuntimeError(
                f"rank {self._rank}: {self._owner}: parameter '{self._names[i]}' was reported ready "
                "after launch_remaining() and before finalize(): its bucket may already be in "
                "flight, and writing into it would corrupt the average. The driver must call "
                "finalize() (or recover()) before any gradient of the next sync is reported, and "
                "must not run backward between launch_remaining() and finalize()")
        bucket, j = self._slot[i]
        if bucket.fired[j]:
            return
        p = self._params[i]
        if p.grad is None:
            raise RuntimeError(f"rank {self._rank}: {self._owner}: '{self._names[i]}'.grad is None in "
                               "its post-accumulate-grad hook: another hook cleared it (optimizer in "
                               "backward?); gradients must stay until backward returns")
        buckets.adopt_grad(p, bucket.views[j])
        bucket.fired[j] = True
        self._used[i] = 1
        if not self._rebuilt:
            self._ready_order.append(self._names[i])
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_bucket < len(self._buckets) and self._buckets[self._next_bucket].pending == 0:
            bucket = self._buckets[self._next_bucket]
            self._next_bucket += 1
            send = bucket.buffer
            if bucket.wire is not None:
                bucket.wire.copy_(bucket.buffer)
                send = bucket.wire
            bucket.launched_at = time.perf_counter()
            bucket.handle = self._allreduce_async(send, ReduceOp.AVG)

    def launch_remaining(self) -> None:
        """Launches every bucket not launched yet (unmarked parameters: their gradient or zeros),
        then the used-map's MAX allreduce."""
        if self._used_handle is not None:
            return
        self._sync_end = time.perf_counter()
        with torch.no_grad():  # bucket copies must never record autograd history
            for bucket in self._buckets[self._next_bucket:]:
                for j, p in enumerate(bucket.params):
                    if bucket.fired[j]:
                        continue
                    view = bucket.views[j]
                    if p.grad is None:
                        view.zero_()
                        self._was_none.append((bucket.slots[j], p))
                        continue
                    # Not marked in this sync, but it holds a gradient (from no_sync steps, or
                    # set by the user): that counts as used, as in DDP's no_sync session.
                    self._used[bucket.slots[j]] = 1
                    buckets.adopt_grad(p, view)
                bucket.pending = 0
            self._launch_ready()
        self._used_handle = self._allreduce_async(self._used, ReduceOp.MAX)

    def finalize(self) -> None:
        """Waits for every bucket and settles each .grad (average, or None where no rank used it)."""
        try:
            self._finish_sync()
        except Exception:
            # A failed collective can leave the communicator alive (CollectiveMismatchError):
            # the later allreduces then still run and write into the buckets (the .grad views)
            # and the used-map, so wait for them before the next sync may touch either.
            self._wait_quietly()
            raise
        finally:
            # Also after a failure, so that the next sync (or a rebuilt communicator) starts clean.
            self._reset()

    def _finish_sync(self) -> None:
        """finalize() without the cleanup: launch what is left, wait, settle, record stats."""
        with torch.no_grad():
            if self._used_handle is None:
                self.launch_remaining()
            for bucket in self._buckets:
                start = time.perf_counter()
                bucket.handle.wait()
                bucket.waited = time.perf_counter() - start
                if bucket.wire is not None:
                    bucket.buffer.copy_(bucket.wire)
            self._used_handle.wait()
            for i, p in self._was_none:
                if self._used[i]:
                    bucket, j = self._slot[i]
                    p.grad = bucket.views[j]
        self._stats = [dict(bucket=b.index, bytes=b.nbytes, params=len(b.params),
                            launch_before_backward_end_ms=(self._sync_end - b.launched_at) * 1e3,
                            wait_ms=b.waited * 1e3) for b in self._buckets]

    def shadow(self) -> None:
        """Takes part in one sync with nothing to contribute (a rank that has joined, join.py):
        every bucket's allreduce and the used-map's, in launch order, on zeros; no .grad is
        touched and the results are dropped."""
        if self.in_progress:
            raise RuntimeError(f"rank {self._rank}: {self._owner}: cannot shadow a sync while one "
                               "is in progress; call finalize() or recover() first")
        handles = [self._allreduce_async(torch.zeros_like(b.buffer if b.wire is None else b.wire),
                                         ReduceOp.AVG) for b in self._buckets]
        handles.append(self._allreduce_async(torch.zeros_like(self._used), ReduceOp.MAX))
        for handle in handles:
            handle.wait()

    def recover(self) -> int:
        """Abandons an unfinished sync: waits for what it launched, resets; how many buckets it launched."""
        launched = self._next_bucket
        self._wait_quietly()  # they still write into the buckets
        self._reset()
        return launched

    def _wait_quietly(self) -> None:
        """Waits for every launched bucket and the used-map, ignoring their errors (the caller
        reports the failed or abandoned sync)."""
        pending = [b.handle for b in self._buckets[:self._next_bucket]] + [self._used_handle]
        for handle in pending:
            if handle is None:
                continue
            try:
                handle.wait()
            except Exception:  # noqa: BLE001 - only the first failure is the caller's to raise
                pass

    def _reset(self) -> None:
        for bucket in self._buckets:
            bucket.pending = len(bucket.params)
            bucket.fired = [False] * len(bucket.params)
            bucket.handle = None
        self._used.zero_()
        self._next_bucket = 0
        self._used_handle: Any = None
        self._was_none: list[tuple[int, torch.Tensor]] = []
        self._sync_end = 0.0
