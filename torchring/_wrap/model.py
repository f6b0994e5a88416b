"""``torchring.wrap(model)``: averaged gradients on every rank, communicated during backward.

How one synchronized step runs:
1. forward (grad enabled, not in ``no_sync``) arms the hooks and, in training mode,
   broadcasts the buffers (BatchNorm statistics) from rank 0;
2. in backward, each parameter's post-accumulate-grad hook calls the Reducer's
   ``mark_ready(i)`` (reducer.py): the gradient moves into its bucket (``.grad`` becomes a view
   of the bucket, so later steps accumulate in place and need no copy), the bucket counts down,
   and a bucket whose gradients have all arrived is launched as an async AVG allreduce as soon
   as every earlier bucket was launched, so every rank issues the same collectives in the same
   order;
3. an end-of-backward callback calls the Reducer's ``finalize()``: it launches what is left (a
   parameter this rank did not use contributes its accumulated gradient or zeros), allreduces
   a used-flag per parameter (MAX; a parameter holding a gradient from no_sync steps counts as
   used), waits for every bucket and settles each parameter's ``.grad``: averaged when any rank
   used it, left as it was (None) when no rank did. ``backward()`` returns after it.
After the first synchronized step the buckets are rebuilt once in the order gradients
actually became ready on rank 0, which every rank adopts. During every backward through the
wrapper (no_sync ones too), large CPU allocations of that backward, the fresh gradients among
them, come from torchring's gradient pool (memory.py): memory kept between steps, so no page
is faulted in.

This module is the torch integration: forward arming, the output sink, the parameter hooks,
autograd callbacks, gradient-pool scoping, the cross-rank consistency check and buffer
broadcasts. The bucket layout and each sync's state machine live in the Reducer.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator

import torch
from torch import nn

from torch.utils import _pytree

from .._core import context as _context, gpu_path as _gpu_path
from ..collectives import basic as collectives
from ..collectives._checks import dtype_advice
from . import memory
from .._core.errors import TorchringError
from .._core.types import describe, dtype_name
from .join import Join, Round
from .reducer import Reducer

__all__ = ["DistributedModel", "wrap"]

_MB = 1 << 20
# Autograd runs a model's CUDA part on a device thread and its CPU part on the caller's: the
# hooks of a mixed model can fire on two threads at once. One lock keeps bucket counts and the
# launch order consistent (module-level, so a wrapped model stays deep-copyable).
_HOOK_LOCK = threading.RLock()
_COMPRESSION = {None: None, "fp16": torch.float16, "bf16": torch.bfloat16}


def _show_entry(entry: tuple | None) -> str:
    """One entry of _verify_and_broadcast's list, as its mismatch message names it."""
    if entry is None:
        return "nothing"
    name, described, requires_grad, strides = entry
    frozen = "" if requires_grad or name.startswith("buffer") else " frozen"
    return f"'{name}' {described} strides {list(strides)}{frozen}"


class DistributedModel(nn.Module):
    """A model whose gradients are averaged across ranks; made by ``torchring.wrap``."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25, first_bucket_mb: float = 1,
                 compression: str | None = None, broadcast_buffers: bool = True) -> None:
        super().__init__()
        if compression not in _COMPRESSION:
            raise ValueError(f"torchring.wrap: compression must be None, 'fp16' or 'bf16', "
                             f"got {compression!r}")
        if bucket_cap_mb <= 0 or first_bucket_mb <= 0:
            raise ValueError(f"torchring.wrap: bucket sizes must be positive, got "
                             f"bucket_cap_mb={bucket_cap_mb}, first_bucket_mb={first_bucket_mb}")
        self.module = module
        self.broadcast_buffers = broadcast_buffers
        self.require_backward_grad_sync = True
        self._compression = _COMPRESSION[compression]
        self._caps = (int(first_bucket_mb * _MB), int(bucket_cap_mb * _MB))
        self._rank = _context.rank()
        self._check_module(module)
        # Fresh CPU gradients come from memory kept between steps (no page faults); see
        # memory.py. Before any collective, so a bad setting fails before the others wait.
        cpu_grad_bytes = sum(p.numel() * p.element_size() for p in module.parameters()
                             if p.requires_grad and p.device.type == "cpu")
        self._pool = cpu_grad_bytes > 0 and memory.reserve_grad_pool(self, cpu_grad_bytes)
        self._pool_task = -1  # the backward (autograd graph task) whose allocations are pooled
        self._verify_and_broadcast()
        self._armed = False
        self._callback_queued = False
        self._join: Join | None = None  # set inside `with model.join():` (join.py)
        self._hooks: list[Any] = []  # one list, filled in place: the finalizer below holds it
        weakref.finalize(self, _remove_hooks, self._hooks).atexit = False
        self._reducer: Reducer
        # bucket_stats() of the Reducer that re-bucketing replaced, until the new one finalized.
        self._previous_stats: list[dict[str, Any]] | None = None
        self._setup_buckets(rebuild_by_ready_order=False)

    # ----------------------------------------------------------------- set-up
    def _check_module(self, module: nn.Module) -> None:
        where = f"rank {self._rank}: torchring.wrap"
        for name, sub in module.named_modules():
            if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse:
                raise ValueError(f"{where}: '{name}' has sparse=True; sparse gradients are not "
                                 "supported, construct it with sparse=False")
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if advice := dtype_advice(t.dtype):  # the collectives' rule
                raise TypeError(f"{where}: '{name}' has dtype {dtype_name(t.dtype)}, which torchring "
                                f"cannot communicate; {advice}")
        for name, p in module.named_parameters():
            if isinstance(p, nn.parameter.UninitializedParameter):
                raise ValueError(f"{where}: parameter '{name}' is uninitialized (lazy module); "
                                 "run one forward pass before wrapping")
            if p.device.type == "cuda":
                _gpu_path.check(p, f"{where}: parameter '{name}'")
            elif p.device.type != "cpu":
                raise ValueError(f"{where}: parameter '{name}' {describe(p)} is on {p.device}; "
                                 "torchring handles CPU and CUDA models")

    def _verify_and_broadcast(self) -> None:
        """Every rank checks every rank's parameter list, then takes rank 0's values."""
        mine = [(n, describe(p), p.requires_grad, tuple(p.stride()))
                for n, p in self.module.named_parameters()]
        mine += [("buffer " + n, describe(b), False, tuple(b.stride()))
                 for n, b in self.module.named_buffers()]
        everyone = collectives.allgather_object(mine)
        reference = everyone[0]
        for rank, theirs in enumerate(everyone):
            if theirs == reference:
                continue
            for i in range(max(len(theirs), len(reference))):
                a = reference[i] if i < len(reference) else None
                b = theirs[i] if i < len(theirs) else None
                if a != b:
                    raise TorchringError(
                        f"rank {self._rank}: torchring.wrap: the model differs between ranks: entry #{i} "
                        f"is {_show_entry(a)} on rank 0 but {_show_entry(b)} on rank {rank} (rank 0 has "
                        f"{len(reference)} parameters and buffers, rank {rank} has {len(theirs)}); "
                        "every rank must build the same model, registering parameters in the same order")
        with torch.no_grad():
            _broadcast_coalesced([p.data for p in self.module.parameters()])
            _broadcast_coalesced([b for b in self.module.buffers()])

    def _setup_buckets(self, rebuild_by_ready_order: bool) -> None:
        """A Reducer over the parameters trainable now (in reverse registration order), or,
        with `rebuild_by_ready_order`, the current one re-laid in rank 0's first ready order
        (once; a collective); then one hook per parameter."""
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        params, names = [p for _, p in named], [n for n, _ in named]
        if rebuild_by_ready_order:  # parameters frozen since wrap() leave the buckets
            self._reducer.rebuild_by_ready_order(params, names)
        else:
            if "_reducer" in self.__dict__ and self._previous_stats is None:
                # Re-bucketing: bucket_stats() keeps the last sync's until the new one finalized.
                self._previous_stats = self._reducer.bucket_stats()
            self._reducer = Reducer(params, names, first_bucket_cap_bytes=self._caps[0],
                                    bucket_cap_bytes=self._caps[1], compression=self._compression,
                                    rank=self._rank)
        _remove_hooks(self._hooks)
        self._all_params = list(self.module.parameters())
        self._hooks.extend(p.register_post_accumulate_grad_hook(self._make_hook(i))
                           for i, p in enumerate(params))
        self._trainable = {id(p) for p in params}

    # ------------------------------------------------------------ public API
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the model; arms gradient synchronization when grad is enabled."""
        if torch._C._current_graph_task_id() == -1:  # not a recomputation inside backward
            self._end_pool()  # a backward that failed never reached _finalize
            if self._callback_queued or self._reducer.in_progress:
                self._unfinished_backward()
        if torch.is_grad_enabled():
            sync = bool(self.require_backward_grad_sync)
            retrain = sync and any(p.requires_grad and id(p) not in self._trainable
                                   for p in self.module.parameters())
            buffers = sync and self.training and self.broadcast_buffers
            # Under join(), a round first: which ranks still have data (the lowest sends buffers).
            src = self._join.begin_step(buffers, retrain).source if sync and self._join else 0
            if retrain:
                self._retrain_new_parameters()
            if buffers:
                with torch.no_grad():
                    _broadcast_coalesced(list(self.module.buffers()), src)
            self._armed = sync
        out = self.module(*args, **kwargs)
        if self._armed and torch.is_grad_enabled():
            out = self._through_sink(out)
        elif self._pool and torch.is_grad_enabled():
            self._pool_unarmed_backward(out)
        return out

    def _pool_unarmed_backward(self, out: Any) -> None:
        """A no_sync backward also takes its fresh gradients from the pool: a hook on the first
        output that needs a gradient (it fires first in backward) turns the pool on, and a
        callback at the end of that backward turns it off. No output is cloned."""
        # A tensor with a grad_fn: a leaf (a parameter returned as is) would keep the hook.
        leaf = next((t for t in _pytree.tree_leaves(out)
                     if isinstance(t, torch.Tensor) and t.grad_fn is not None), None)
        if leaf is None:
            return

        model = weakref.ref(self)  # the output may outlive the wrapper

        def pool_on(grad: torch.Tensor) -> None:
            wrapper = model()
            if wrapper is not None:  # the next forward ends the task if this backward fails
                wrapper._pool_task = memory.grad_pool_begin()
                torch.autograd.Variable._execution_engine.queue_callback(wrapper._end_pool)
        leaf.register_hook(pool_on)

    def _unfinished_backward(self) -> None:
        """The last synchronized backward raised before its end-of-backward sync ran: waits for
        the buckets it launched, resets the per-backward state and raises, since ranks may now
        disagree on the next collective."""
        launched = self._reducer.recover()  # waits for what it launched: they write into buckets
        self._callback_queued = False
        raise TorchringError(
            f"rank {self._rank}: torchring.wrap: the previous backward raised before its gradients "
            f"were averaged ({launched} of {self._reducer.num_buckets} buckets were launched), so the ranks "
            "may now disagree on which collective comes next. If every rank failed the same way, "
            "the next forward runs normally; otherwise call torchring.shutdown() and "
            "torchring.init() on every rank (or restart the job)")

    def _end_pool(self) -> None:
        if self._pool_task >= 0:
            memory.grad_pool_end(self._pool_task)
            self._pool_task = -1

    def _through_sink(self, out: Any) -> Any:
        """Routes the outputs through _Sink, whose backward runs first in the outermost
        backward and queues the end-of-backward sync there (see _Sink)."""
        leaves, spec = _pytree.tree_flatten(out)
        slots = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not slots:
            return out
        passed = _Sink.apply(self, *[leaves[i] for i in slots])
        for i, t in zip(slots, passed):
            leaves[i] = t
        return _pytree.tree_unflatten(leaves, spec)

    def _queue_finalize(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    @contextlib.contextmanager
    def no_sync(self, enabled: bool = True) -> Iterator[None]:
        """Inside, forward+backward only accumulate gradients locally (no communication)."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = not enabled and previous
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Context manager for uneven inputs: a rank out of batches answers the others' steps."""
        if not divide_by_initial_world_size:
            raise NotImplementedError(
                f"rank {self._rank}: torchring.wrap: model.join(divide_by_initial_world_size=False) "
                "is not supported: gradients are averaged over the whole world, ranks that joined "
                "counting as zeros; scale the learning rate if you need the other average")
        return Join(self, enable, throw_on_early_termination)

    def _join_shadow(self, step: Round) -> None:
        """A joined rank's part in one step of the active ranks (join.py): the buffer broadcast,
        a gradient sync with zeros, and the one-time bucket rebuild after the first sync."""
        if step.buffers:
            with torch.no_grad():
                _broadcast_coalesced(list(self.module.buffers()), step.source)
        with _HOOK_LOCK:
            self._reducer.shadow()
        if not self._reducer.rebuilt:
            self._setup_buckets(rebuild_by_ready_order=True)

    def _join_final(self, src: int) -> None:
        """After join(): every rank takes rank `src`'s parameters (and buffers if broadcast)."""
        with torch.no_grad():
            _broadcast_coalesced([p.data for p in self.module.parameters()], src)
            if self.broadcast_buffers:
                _broadcast_coalesced(list(self.module.buffers()), src)

    def bucket_stats(self) -> list[dict[str, Any]]:
        """Per bucket of the last synchronized backward: bytes, params, launch lead and wait."""
        if self._previous_stats is not None:  # re-bucketed since; no sync finished yet
            return [dict(s) for s in self._previous_stats]
        return self._reducer.bucket_stats()

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's state_dict, with the same keys as the unwrapped model."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Loads a state_dict of the unwrapped model."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)

    # --------------------------------------------------------------- backward
    def _make_hook(self, i: int):
        # A weak reference: torch keeps parameter hooks where the garbage collector cannot
        # see them, so a strong one would keep a dropped wrapper (and its buckets) alive.
        model = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            wrapper = model()
            if wrapper is not None and wrapper._armed:
                with _HOOK_LOCK:
                    wrapper._reducer.mark_ready(i)
                    if not wrapper._callback_queued:  # usually queued by _Sink already (outputs
                        wrapper._queue_finalize()     # that did not pass it)
        return hook

    def _finalize(self) -> None:
        try:
            with _HOOK_LOCK:
                self._reducer.finalize()
            self._previous_stats = None
        finally:
            # Also after a failure, so that a rebuilt communicator starts from a clean state.
            self._callback_queued = False
            self._end_pool()
        if not self._reducer.rebuilt:
            self._setup_buckets(rebuild_by_ready_order=True)

    def _retrain_new_parameters(self) -> None:
        """Parameters that became trainable, or were added, after wrap(): every rank checks the
        others train the same ones, then all re-bucket together."""
        names = [n for n, p in self.module.named_parameters() if p.requires_grad]
        everyone = collectives.allgather_object(names)
        for rank, theirs in enumerate(everyone):
            if theirs != everyone[0]:
                raise TorchringError(
                    f"rank {self._rank}: torchring.wrap: ranks train different parameters: rank 0 "
                    f"trains {len(everyone[0])}, rank {rank} trains {len(theirs)} (first difference: "
                    f"{next((a, b) for a, b in zip(everyone[0] + [None], theirs + [None]) if a != b)}); "
                    "set requires_grad the same way on every rank")
        known = {id(p) for p in self._all_params}
        added = [p for p in self.module.parameters() if id(p) not in known]
        if added:  # new parameters (a replaced head): every rank starts from rank 0's values
            with torch.no_grad():
                _broadcast_coalesced([p.data for p in added])
        self._setup_buckets(rebuild_by_ready_order=False)


class _Sink(torch.autograd.Function):
    """Identity on the model's outputs. Its backward runs before any parameter's gradient
    (it is the last node of forward) and inside the outermost backward, so the sync is queued
    on that graph task: reentrant checkpointing, whose inner backwards fire parameter hooks
    first, still gets one sync per backward. Outputs are cloned so callers may modify them."""

    @staticmethod
    def forward(ctx: Any, model: DistributedModel, *tensors: torch.Tensor) -> Any:
        ctx.model = model
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.model._queue_finalize()
        if ctx.model._pool:  # until _finalize: the parameters' gradients come from the pool
            ctx.model._pool_task = memory.grad_pool_begin()
        return (None, *grads)


def _remove_hooks(hooks: list[Any]) -> None:
    """Removes a wrapper's parameter hooks (on re-bucketing, and when it is collected)."""
    for hook in hooks:
        hook.remove()
    hooks.clear()


def _broadcast_coalesced(tensors: list[torch.Tensor], src: int = 0) -> None:
    """Broadcasts `tensors` from `src` with one collective per (device, dtype)."""
    by_kind: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((str(t.device), t.dtype), []).append(t)
    for kind in sorted(by_kind, key=str):
        group = by_kind[kind]
        flat = torch.cat([t.reshape(-1) for t in group]) if len(group) > 1 else group[0].reshape(-1).clone()
        collectives.broadcast(flat, src)
        offset = 0
        for t in group:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def wrap(model: nn.Module, bucket_cap_mb: float = 25, first_bucket_mb: float = 1,
         compression: str | None = None, broadcast_buffers: bool = True) -> DistributedModel:
    """Makes `model` data-parallel: after backward() every rank holds the averaged gradients."""
    _context.communicator("wrap")
    return DistributedModel(model, bucket_cap_mb, first_bucket_mb, compression, broadcast_buffers)
