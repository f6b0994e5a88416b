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
   used it, left as it was (None) when no rank did; then the sparse gradients of embeddings
   built with sparse=True, which stay out of the buckets, are averaged (sparse_grads.py).
   ``backward()`` returns after it.
After the first synchronized step the buckets are rebuilt once in the order gradients
actually became ready on rank 0, which every rank adopts. During every backward through the
wrapper (no_sync ones too), large CPU allocations of that backward, the fresh gradients among
them, come from torchring's gradient pool (memory.py): memory kept between steps, so no page
is faulted in.

This module is the wrapper: forward arming, the output sink, the cross-rank consistency check
and buffer broadcasts. The parameter hooks, their lock, the gradient pool's scope and the
queued end-of-backward callback are the kit in hooks.py; the bucket layout and each sync's
state machine live in the Reducer.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from torch.utils import _pytree

from .._core import context as _context, gpu_path as _gpu_path
from ..collectives import basic as collectives
from .._core.errors import TorchringError
from ..trace import progress as _progress
from .._core.types import describe, dtype_name
from ..collectives._checks import dtype_advice
from .hooks import LOCK, GradHooks
from .join import Join, Round, active_join
from .reducer import BUCKET_CAP_BYTES, FIRST_BUCKET_CAP_BYTES, Reducer
from .sparse_grads import SparseGrads, sparse_parameters

__all__ = ["DistributedModel", "wrap"]

_MB = 1 << 20
_CAP_MB, _FIRST_CAP_MB = BUCKET_CAP_BYTES // _MB, FIRST_BUCKET_CAP_BYTES // _MB
_COMPRESSION = {None: None, "fp16": torch.float16, "bf16": torch.bfloat16}


def _show_entry(entry: tuple | None) -> str:
    """One entry of _verify_and_broadcast's list, as its mismatch message names it."""
    if entry is None:
        return "nothing"
    name, described, requires_grad, strides = entry
    frozen = "" if requires_grad or name.startswith("buffer") else " frozen"
    return f"'{name}' {described} strides {list(strides)}{frozen}"


def _check_module(module: nn.Module, rank: int) -> None:
    """Refuses what torchring cannot wrap: dtypes, lazy and misplaced parameters."""
    where = f"rank {rank}: torchring.wrap"
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


def _verify_and_broadcast(module: nn.Module, rank: int) -> None:
    """Every rank checks every rank's parameter list, then takes rank 0's values."""
    mine = [(n, describe(p), p.requires_grad, tuple(p.stride())) for n, p in module.named_parameters()]
    mine += [("buffer " + n, describe(b), False, tuple(b.stride())) for n, b in module.named_buffers()]
    everyone = collectives.allgather_object(mine)
    reference = everyone[0]
    for other, theirs in enumerate(everyone):
        if theirs == reference:
            continue
        for i in range(max(len(theirs), len(reference))):
            a = reference[i] if i < len(reference) else None
            b = theirs[i] if i < len(theirs) else None
            if a != b:
                raise TorchringError(
                    f"rank {rank}: torchring.wrap: the model differs between ranks: entry #{i} "
                    f"is {_show_entry(a)} on rank 0 but {_show_entry(b)} on rank {other} (rank 0 has "
                    f"{len(reference)} parameters and buffers, rank {other} has {len(theirs)}); "
                    "every rank must build the same model, registering parameters in the same order")
    with torch.no_grad():
        _broadcast_coalesced([p.data for p in module.parameters()])
        _broadcast_coalesced([b for b in module.buffers()])


class DistributedModel(nn.Module):
    """A model whose gradients are averaged across ranks; made by ``torchring.wrap``."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = _CAP_MB,
                 first_bucket_mb: float = _FIRST_CAP_MB, compression: str | None = None,
                 broadcast_buffers: bool = True) -> None:
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
        self._rank = _context.rank()
        _check_module(module, self._rank)
        self._sparse = SparseGrads(sparse_parameters(module))  # outside the buckets (sparse_grads.py)
        named = self._dense_trainable()
        params = [p for _, p in named]
        # One hook per trainable parameter; fresh CPU gradients come from memory kept between
        # steps (no page faults; memory.py). Before any collective, so a bad setting fails
        # before the others wait.
        self._hooks = GradHooks(self._on_ready, params)
        _verify_and_broadcast(module, self._rank)
        self._armed = False
        self._reducer = Reducer(params, [n for n, _ in named],
                                first_bucket_cap_bytes=int(first_bucket_mb * _MB),
                                bucket_cap_bytes=int(bucket_cap_mb * _MB),
                                compression=_COMPRESSION[compression], rank=self._rank)
        self._all_params = list(module.parameters())
        self._trainable = {id(p) for p in params} | self._sparse.ids  # sparse: trainable, not bucketed

    def _rebucket(self, learn_order: bool) -> None:
        """Lays the Reducer out over the parameters trainable now: in reverse registration order,
        learning the ready order again (`learn_order`), or in rank 0's first ready order (once;
        a collective). Parameters frozen since wrap() leave the buckets."""
        named = self._dense_trainable()
        params, names = [p for _, p in named], [n for n, _ in named]
        if learn_order:
            self._reducer.rebuild((), params, names, learn_order=True)
        else:
            self._reducer.rebuild_by_ready_order(params, names)
        self._hooks.attach(params)
        self._all_params = list(self.module.parameters())
        self._trainable = {id(p) for p in params} | self._sparse.ids

    def _dense_trainable(self) -> list[tuple[str, nn.Parameter]]:
        """The trainable parameters whose gradients go through the Reducer's buckets."""
        return [(n, p) for n, p in self.module.named_parameters()
                if p.requires_grad and id(p) not in self._sparse.ids]

    # ------------------------------------------------------------ public API
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the model; arms gradient synchronization when grad is enabled."""
        if torch._C._current_graph_task_id() == -1:  # not a recomputation inside backward
            if self._hooks.close_failed_backward() or self._reducer.in_progress:
                self._recover_from_failed_backward()
        if torch.is_grad_enabled():
            sync = bool(self.require_backward_grad_sync)
            retrain = sync and any(p.requires_grad and id(p) not in self._trainable
                                   for p in self.module.parameters())
            buffers = sync and self.training and self.broadcast_buffers
            # Under join(), a round first: which ranks still have data (the lowest sends buffers).
            join = active_join(self) if sync else None
            src = join.begin_step(buffers, retrain).source if join is not None else 0
            if retrain:
                self._rebucket_changed_trainables()
            if buffers:
                with torch.no_grad():
                    _broadcast_coalesced(list(self.module.buffers()), src)
            self._armed = sync
        out = self.module(*args, **kwargs)
        if self._armed and torch.is_grad_enabled():
            out = _through_sink(self, out)
        elif self._hooks.pooled and torch.is_grad_enabled():
            self._pool_unarmed_backward(out)
        return out

    def _pool_unarmed_backward(self, out: Any) -> None:
        """A no_sync backward is pooled from its start too: it is entered at the first output
        that needs a gradient (its node runs first in backward). No output is cloned."""
        # A tensor with a grad_fn: a leaf (a parameter returned as is) would keep the hook.
        leaf = next((t for t in _pytree.tree_leaves(out)
                     if isinstance(t, torch.Tensor) and t.grad_fn is not None), None)
        if leaf is not None:
            self._hooks.enter_at_grad_of(leaf)

    def _recover_from_failed_backward(self) -> None:
        """The last synchronized backward raised before its end-of-backward sync ran: waits for
        the buckets it launched, resets the per-backward state and raises, since ranks may now
        disagree on the next collective."""
        launched = self._reducer.recover()  # waits for what it launched: they write into buckets
        raise TorchringError(
            f"rank {self._rank}: torchring.wrap: the previous backward raised before its gradients "
            f"were averaged ({launched} of {self._reducer.num_buckets} buckets were launched), so the ranks "
            "may now disagree on which collective comes next. If every rank failed the same way, "
            "the next forward runs normally; otherwise call torchring.shutdown() and "
            "torchring.init() on every rank (or restart the job)")

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

    def join_shadow(self, step: Round) -> None:
        """A joined rank's part in one step of the active ranks (join.py): the buffer broadcast,
        a gradient sync with zeros, and the one-time bucket rebuild after the first sync."""
        if step.buffers:
            with torch.no_grad():
                _broadcast_coalesced(list(self.module.buffers()), step.source)
        with LOCK:
            self._reducer.shadow()
        self._sparse.sync(shadow=True)
        if not self._reducer.rebuilt:
            self._rebucket(learn_order=False)

    def join_adopt_state(self, src: int) -> None:
        """After join(): every rank takes rank `src`'s parameters (and buffers if broadcast)."""
        with torch.no_grad():
            _broadcast_coalesced([p.data for p in self.module.parameters()], src)
            if self.broadcast_buffers:
                _broadcast_coalesced(list(self.module.buffers()), src)

    def bucket_stats(self) -> list[dict[str, Any]]:
        """Per bucket of the last synchronized backward: bytes, params, launch lead and wait."""
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
    def _on_ready(self, i: int) -> None:
        """Parameter i's hook (under the kit's lock): hands its gradient to the Reducer."""
        if self._armed:
            self._reducer.mark_ready(i)
            # Usually queued by _Sink already (outputs that did not pass it).
            self._hooks.queue_finalize(self._on_backward_end)

    def _on_backward_end(self) -> None:
        """The end-of-backward callback: Reducer.finalize() under the kit's lock, then, after
        the first sync, the one-time rebuild in rank 0's ready order (a collective)."""
        with LOCK:
            self._reducer.finalize()
        _progress.step()  # a gradient sync is a training step, for the rank's status
        self._sparse.sync()
        if not self._reducer.rebuilt:
            self._rebucket(learn_order=False)

    def _rebucket_changed_trainables(self) -> None:
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
        self._rebucket(learn_order=True)


class _Sink(torch.autograd.Function):
    """Identity on the model's outputs. Its backward runs before any parameter's gradient
    (it is the last node of forward) and inside the outermost backward, so that backward is
    pooled from its start and the sync is queued on it: reentrant checkpointing, whose inner
    backwards fire parameter hooks first, still gets one sync per backward. Outputs are cloned
    so callers may modify them."""

    @staticmethod
    def forward(ctx: Any, model: DistributedModel, *tensors: torch.Tensor) -> Any:
        ctx.model = model
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        hooks = ctx.model._hooks
        hooks.enter_backward()  # first: the pool's end is queued before the sync's (hooks.py)
        hooks.queue_finalize(ctx.model._on_backward_end)
        return (None, *grads)


def _through_sink(model: DistributedModel, out: Any) -> Any:
    """Routes `model`'s outputs through _Sink, whose backward runs first in the outermost
    backward and queues the end-of-backward sync there (see _Sink)."""
    leaves, spec = _pytree.tree_flatten(out)
    slots = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not slots:
        return out
    passed = _Sink.apply(model, *[leaves[i] for i in slots])
    for i, t in zip(slots, passed):
        leaves[i] = t
    return _pytree.tree_unflatten(leaves, spec)


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


def _require_init(what: str) -> None:
    """Raises the not-initialized error naming torchring.<what>() before init() and after shutdown()."""
    _context.communicator(what)  # for its check only: the engine itself is not needed here


def wrap(model: nn.Module, bucket_cap_mb: float = _CAP_MB, first_bucket_mb: float = _FIRST_CAP_MB,
         compression: str | None = None, broadcast_buffers: bool = True) -> DistributedModel:
    """Makes `model` data-parallel: after backward() every rank holds the averaged gradients."""
    _require_init("wrap")
    return DistributedModel(model, bucket_cap_mb, first_bucket_mb, compression, broadcast_buffers)
