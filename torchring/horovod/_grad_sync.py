"""The gradient sync behind ``hvd.DistributedOptimizer``: torchring's Reducer, driven by hooks.

One ``GradSync`` per optimizer (on the ranks of its process set, when there is more than one
rank or HOROVOD_ELASTIC is set):

- a post-accumulate-grad hook on every parameter that required a gradient at construction
  counts backward passes; on the k-th (``backward_passes_per_step``) it calls the Reducer's
  ``mark_ready``, so full buckets are reduced while backward goes on; a further pass before the
  sync is the AssertionError Horovod users know;
- ``synchronize()`` launches what is left (a parameter without a gradient on this rank adds
  zeros) and waits (Reducer.finalize); then, as in Horovod, a parameter whose gradient is still
  None (no rank produced one) gets a zero gradient, so every rank steps every parameter the same
  way (SGD's weight decay and momentum apply to it, as under Horovod);
- the buckets travel on ``process_set.group`` (direct engine collectives, in launch order) as a
  Sum, or an Average split into prescale 1/f and postscale f/size (gradient_predivide_factor f);
- the first sync after the Reducer was built ends with one allgather among the set's ranks:
  every rank adopts rank 0's gradient-ready order for its buckets (as torchring.wrap does; the
  next rank's when rank 0 had joined and has none), the ranks check that they sync the same
  parameters, and they learn which parameters produced sparse gradients anywhere. Without
  ``sparse_as_dense`` those leave the buckets and are reduced from then on by allgathering their
  indices and values; in that first sync, and for a sparse gradient first seen later, the
  gradient travels densified in its bucket (the same average). A gradient that arrived sparse is
  handed back to the optimizer sparse;
- ``groups=`` fixes the buckets: a group (Horovod's unit of fusion) is never split, and whole
  groups share a bucket up to the bucket cap, in backward order;
- after ``hvd.shutdown(); hvd.init()`` (elastic reset) the set's group is a new one: the
  Reducer is built again and the first-sync agreement runs again;
- from the first hook of a backward to its end, large CPU allocations (fresh gradients) come
  from torchring's gradient pool, as under torchring.wrap (the rule is _wrap/hooks.py's; _wrap/memory.py);
- on the global process set, ``hvd.join()`` works: each sync first submits a negotiated marker,
  and a rank that has joined takes part in the syncs it misses with zeros (``shadow()``,
  driven by the marker on its negotiation thread; see _join_sync.py).

Parameters that did not require a gradient when the optimizer was made get no hook and are
never synchronized, as in Horovod.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .._core import context as _context
from .._core.types import ReduceOp
from .._wrap.buckets import assign
from .._wrap.hooks import LOCK, GradHooks
from .._wrap.reducer import BUCKET_CAP_BYTES, FIRST_BUCKET_CAP_BYTES, Reducer
from . import _join_sync, basics, knobs, timeline
from .compression import wire_dtype
from .exceptions import raised_as_horovod

__all__ = ["GradSync", "Transport", "bucket_caps", "group_assignment", "sparse_reduce"]

_OWNER = "hvd.DistributedOptimizer"


def bucket_caps() -> tuple[int, int]:
    """(first bucket, later buckets) in bytes: torchring.wrap's 1 and 25 MiB, never above
    HOROVOD_FUSION_THRESHOLD (Horovod's ceiling on one fused message; 0 = one tensor each)."""
    limit = knobs.current().fusion_threshold_bytes
    return min(limit, FIRST_BUCKET_CAP_BYTES), min(limit, BUCKET_CAP_BYTES)


def group_assignment(params: Sequence[torch.Tensor], groups: Any, first_cap: int,
                     cap: int) -> list[list[int]]:
    """Buckets (lists of indices into `params`, launch order) for Horovod's `groups`: an int n
    splits the parameters into n consecutive groups, a list of tensor lists names groups (every
    other parameter is a group of its own). Groups are taken in backward order (the group whose
    first-registered parameter comes last, first), split only by device and dtype, and packed
    whole into buckets by buckets.assign with the caps."""
    pos = {id(p): i for i, p in enumerate(params)}
    if isinstance(groups, int):
        d, r = divmod(len(params), groups)
        units = [list(range(k * d + min(k, r), (k + 1) * d + min(k + 1, r))) for k in range(groups)]
    else:
        units = [[pos[id(p)] for p in g if id(p) in pos] for g in groups]
        grouped = {i for u in units for i in u}
        units += [[i] for i in range(len(params)) if i not in grouped]
    units = [sorted(u, reverse=True) for u in units if u]
    units.sort(key=lambda u: -u[-1])
    parts: list[list[int]] = []  # each unit split by (device, dtype)
    for unit in units:
        kinds: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i in unit:
            kinds.setdefault((params[i].device, params[i].dtype), []).append(i)
        parts.extend(kinds.values())
    sizes = [(sum(params[i].numel() * params[i].element_size() for i in part),
              params[part[0]].device, params[part[0]].dtype) for part in parts]
    return [[i for k in bucket for i in parts[k]]
            for bucket in assign(sizes, list(range(len(parts))), first_cap, cap)]


class _Decompressing:
    """A bucket's allreduce under a custom compressor: wait() decompresses into the bucket."""

    def __init__(self, handle: Any, bucket: torch.Tensor, sent: torch.Tensor, ctx: Any,
                 compressor: Any) -> None:
        self.handle, self.bucket, self.sent, self.ctx, self.compressor = handle, bucket, sent, ctx, compressor

    def wait(self) -> None:
        self.handle.wait()
        out = self.compressor.decompress(self.sent, self.ctx)
        if out.data_ptr() != self.bucket.data_ptr():
            self.bucket.copy_(out.reshape(self.bucket.shape))


class _Timed:
    """A bucket's allreduce shown in the timeline: its ALLREDUCE phase ends when wait() returns."""

    def __init__(self, handle: Any, name: str) -> None:
        self.handle, self.name = handle, name
        timeline.negotiate_end(name, "allreduce")

    def wait(self) -> None:
        self.handle.wait()
        timeline.op_end(self.name)


class Transport:
    """The Reducer's allreduce_async and agree_on_order for one optimizer: the buckets on the
    process set's group with Horovod's op and scaling; holds no reference to the optimizer."""

    def __init__(self, process_set: Any, op: int, predivide: float, compression: Any) -> None:
        self.process_set, self.op, self.predivide = process_set, op, float(predivide)
        builtin, self.wire = wire_dtype(compression)
        self.compressor = None if builtin else compression
        self.order: list[str] = []  # the agreed ready order, set before the rebuild asks
        self.bucket = 0  # the index of the next bucket of this sync

    def __call__(self, tensor: torch.Tensor, op: ReduceOp) -> Any:
        group = self.process_set.group
        if op != ReduceOp.AVG:  # the Reducer's used-map (MAX), after the sync's last bucket
            self.bucket = 0
            return group.allreduce_async(tensor, op)
        if self.compressor is None:
            handle = self._reduce(group, tensor)
        else:
            sent, ctx = self.compressor.compress(tensor)
            handle = _Decompressing(self._reduce(group, sent), tensor, sent, ctx, self.compressor)
        self.bucket += 1
        if timeline.active():  # one timeline row per bucket, ALLREDUCE until its wait() returns
            handle = _Timed(handle, f"allreduce.DistributedOptimizer.bucket{self.bucket - 1}")
        return handle

    def _reduce(self, group: Any, tensor: torch.Tensor) -> Any:
        if self.op == basics.Sum:
            return group.allreduce_async(tensor, ReduceOp.SUM)
        f = self.predivide  # Average: sum(x / f) * f / size
        return group.allreduce_async(tensor, ReduceOp.AVG, 1.0 / f, f)

    def reducer(self, params: list[torch.Tensor], names: list[str], groups: Any, rank: int) -> Reducer:
        """A Reducer over `params` that launches on this transport (bucket_caps(); Horovod's
        `groups`, when given, fix the buckets)."""
        first, cap = bucket_caps()
        fixed = group_assignment(params, groups, first, cap) if groups is not None else None
        return Reducer(params, names, first_bucket_cap_bytes=first, bucket_cap_bytes=cap,
                       compression=self.wire, allreduce_async=self, agree_on_order=self.agreed_order,
                       rank=rank, owner=_OWNER, assignment=fixed)

    def current_group(self, rank: int) -> Any:
        """The process set's group now; ValueError when the set is not set up (any more)."""
        group = self.process_set.group
        if group is None:
            raise ValueError(f"rank {rank}: {_OWNER}: {self.process_set} is not set up "
                             "(hvd.shutdown() was called, or the set was removed); call hvd.init() "
                             "(and add the set again) before training with this optimizer")
        return group

    def agreed_order(self, mine: list[str]) -> list[str]:
        """Reducer.rebuild_by_ready_order's agreement: the order GradSync agreed on already."""
        return list(self.order)


def sparse_reduce(grad: torch.Tensor | None, like: torch.Tensor, sparse_dim: int, group: Any,
                  average: bool) -> torch.Tensor:
    """The sum (or average) over `group` of every member's sparse gradient of parameter `like`
    (None: this rank contributes nothing), by allgathering indices and values; coalesced."""
    if grad is None:
        indices = torch.zeros(0, sparse_dim, dtype=torch.int64, device=like.device)
        values = like.new_zeros((0, *like.shape[sparse_dim:]))
    else:
        g = (grad if grad.is_sparse else grad.to_sparse(sparse_dim)).coalesce()
        indices, values = g.indices().t().contiguous(), g.values().contiguous()
    h_indices, h_values = group.allgather_async(indices), group.allgather_async(values)
    all_indices, all_values = h_indices.wait(), h_values.wait()
    if average:
        all_values = all_values / group.size()
    return torch.sparse_coo_tensor(all_indices.t(), all_values, like.shape,
                                   check_invariants=False).coalesce()


def _first_sync_outcome(everyone: list[Any], rank: int) -> tuple[list[str], dict[str, int]]:
    """From the first-sync allgather of (ready order, (name, shape) list, sparse found) per set
    rank: the order to adopt (set rank 0's, or the lowest rank's with one) and every sparse
    parameter found anywhere; raises unless every rank syncs set rank 0's parameters."""
    reference = everyone[0][1]
    for r, (_, theirs, _) in enumerate(everyone):
        if theirs != reference:
            diff = next((a, b) for a, b in zip(reference + [None], theirs + [None]) if a != b)
            raise ValueError(
                f"rank {rank}: {_OWNER}: the ranks of the process set sync different "
                f"parameters: set rank 0 has {diff[0]}, set rank {r} has {diff[1]} (name, shape); "
                "build the same model and optimizer on every rank")
    found: dict[str, int] = {}
    for _, _, theirs in everyone:
        found.update(theirs)
    return next((order for order, _, _ in everyone if order), []), found


class GradSync:
    """Hooks, counters and the Reducer of one DistributedOptimizer (see the module docstring)."""

    def __init__(self, params: list[torch.Tensor], names: list[str], transport: Transport,
                 passes: int, groups: Any, sparse_as_dense: bool) -> None:
        self.params, self.names, self.transport = params, names, transport
        self.passes, self.groups, self.sparse_as_dense = passes, groups, sparse_as_dense
        self.rank = _context.rank()
        self.index = {n: j for j, n in enumerate(names)}
        self.delay = [passes] * len(params)  # backward passes left before mark_ready
        self.pending = False                 # a hook fired since the last sync
        self.sparse: dict[int, int] = {}     # outside the buckets: param index -> sparse_dim
        self.sparse_now: dict[int, int] = {}  # gradients that arrived sparse in this sync
        self.seen_sparse: dict[int, int] = {}  # ever, on this rank
        # Hooks; as under torchring.wrap, a backward's large CPU allocations come from the pool.
        self._hooks = GradHooks(self.on_grad, params)
        # hvd.join() reaches the syncs of optimizers on the global set only (join has no set).
        self.join_key = (_join_sync.register(self, names, [tuple(p.shape) for p in params])
                         if transport.process_set.process_set_id == 0 else None)
        self._build()

    def _build(self) -> None:
        """A Reducer over the parameters not reduced sparsely; the first-sync agreement is due."""
        self.group = self.transport.current_group(self.rank)
        dense = [j for j in range(len(self.params)) if j not in self.sparse]
        position = {j: i for i, j in enumerate(dense)}
        self.slot: list[int | None] = [position.get(j) for j in range(len(self.params))]
        self.reducer = self.transport.reducer([self.params[j] for j in dense],
                                              [self.names[j] for j in dense], self.groups, self.rank)
        self.agreed = False
        self.order: list[str] = []

    def _on_current_group(self) -> None:
        """After an hvd re-init the set has a new group: starts over on it."""
        if self.transport.current_group(self.rank) is not self.group:
            if self.reducer.in_progress:
                self.reducer.recover()
            self.sparse.clear()
            self.delay = [self.passes] * len(self.params)
            self._build()

    def on_grad(self, j: int) -> None:
        """Parameter j's post-accumulate-grad hook (under the kit's lock)."""
        self._on_current_group()
        if self.delay[j] <= 0:
            raise AssertionError(
                f"rank {self.rank}: {_OWNER}: parameter '{self.names[j]}' got a gradient from "
                f"more than backward_passes_per_step={self.passes} backward passes before "
                "step() or synchronize(). Increase backward_passes_per_step to accumulate "
                "that many passes locally, or step after each group of passes")
        self.pending = True
        self.delay[j] -= 1
        if self.delay[j] > 0 or self.slot[j] is None:
            return  # sparse ones are reduced in synchronize()
        p = self.params[j]
        if p.grad is not None and p.grad.is_sparse:
            self._densify(j)
        if not self.agreed:
            self.order.append(self.names[j])
        with raised_as_horovod():
            self.reducer.mark_ready(self.slot[j])

    def _densify(self, j: int) -> None:
        p = self.params[j]
        self.sparse_now[j] = self.seen_sparse[j] = p.grad.sparse_dim()
        p.grad = p.grad.to_dense()

    def synchronize(self) -> None:
        """Reduces every gradient (what the hooks did not launch yet too) and writes the results."""
        self._hooks.close_failed_backward()  # the pool scope of a backward that raised ends here
        with LOCK:
            self._on_current_group()
            # Parameters the hooks did not hand to the Reducer (no gradient on this rank, or
            # fewer backward passes than backward_passes_per_step); only they can need help.
            unmarked = [j for j, left in enumerate(self.delay) if left > 0 and self.slot[j] is not None]
            try:
                if self.join_key is not None:  # before anything here waits for the other ranks
                    with raised_as_horovod():
                        _join_sync.submit_marker(self.join_key)
                for j in unmarked:  # the buckets copy dense gradients only
                    g = self.params[j].grad
                    if g is not None and g.is_sparse:
                        self._densify(j)
                with raised_as_horovod():
                    self.reducer.finalize()
                self._reduce_sparse(contribute=True)
                if not self.agreed:
                    with raised_as_horovod():
                        self._agree()
                for j, dim in list(self.sparse_now.items()) + list(self.sparse.items()):
                    g = self.params[j].grad
                    if g is not None and not g.is_sparse:
                        self.params[j].grad = g.to_sparse(dim)
                for j in unmarked:
                    p = self.params[j]
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)  # no rank had one (Horovod's zero-fill)
            finally:
                self._next_sync()

    def shadow(self) -> None:
        """This rank has joined (hvd.join()): takes part in one sync of the other ranks with
        zeros, issuing the collectives synchronize() issues, in its order, without touching any
        gradient; the first sync's agreement runs here too (a rank may join before it)."""
        with LOCK:
            self._on_current_group()
            if self.reducer.in_progress:
                raise RuntimeError(
                    f"rank {self.rank}: {_OWNER}: hvd.join() was called after backward() and "
                    "before step() (this rank's gradients are being reduced already), so it cannot "
                    "take part in the other ranks' sync with zeros; call step() or synchronize() "
                    "before hvd.join()")
            try:
                with raised_as_horovod():
                    self.reducer.shadow()
                self._reduce_sparse(contribute=False)
                if not self.agreed:
                    with raised_as_horovod():
                        self._agree()
            finally:
                # Backward passes counted since the last sync (fewer than backward_passes_per_step)
                # never reach the others, as in Horovod; the next sync starts afresh.
                self._next_sync()

    def _next_sync(self) -> None:
        """After a sync (or a shadowed one): every parameter waits for its passes again."""
        self.delay, self.pending, self.sparse_now = [self.passes] * len(self.params), False, {}

    def _reduce_sparse(self, contribute: bool) -> None:
        """The allgathers of the parameters outside the buckets; a joined rank adds nothing."""
        average = self.transport.op == basics.Average
        for j in sorted(self.sparse):
            p = self.params[j]
            reduced = sparse_reduce(p.grad if contribute else None, p, self.sparse[j], self.group, average)
            if contribute:
                p.grad = reduced

    def _agree(self) -> None:
        """The first-sync allgather: the ready order of set rank 0 (of the lowest rank with
        one, when a rank joined before its first sync), the same parameters everywhere, and which
        parameters produced sparse gradients on any rank."""
        names = self.reducer.layout()
        mine = [(n, tuple(self.params[self.index[n]].shape)) for bucket in names for n in bucket]
        sparse = {self.names[j]: d for j, d in self.seen_sparse.items()}
        everyone = self.group.allgather_object((self.order, sorted(mine), sparse))
        self.agreed = True
        self.transport.order, found = _first_sync_outcome(everyone, self.rank)
        leaving = {self.index[n]: d for n, d in found.items()}
        if leaving and not self.sparse_as_dense:
            self.sparse.update(leaving)
            for j, d in leaving.items():
                self.sparse_now.setdefault(j, d)  # reduced densely this time: hand it back sparse
            self._build()  # without them (a fixed layout for groups=, else the agreed order)
            self.agreed = True
        self.reducer.rebuild_by_ready_order()
