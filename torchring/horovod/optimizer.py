"""``hvd.DistributedOptimizer``: Horovod's optimizer wrapper, reducing gradients with torchring's
Reducer (the bucketed, backward-overlapping sync ``torchring.wrap`` uses; see _grad_sync.py).

    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    loss.backward()          # buckets are reduced as their gradients arrive
    opt.step()               # waits for the rest, then steps

The returned object is an instance of a subclass of the optimizer's own class (named like it),
sharing its param groups, state and hooks, so ``isinstance(opt, torch.optim.SGD)``,
``state_dict()`` / ``load_state_dict()`` and LR schedulers work as before. What differs from
Horovod: ``op=hvd.Adasum`` is not implemented; only ``hvd.Average`` and ``hvd.Sum`` reduce
gradients; the optimizer's existing state is kept (Horovod starts from an empty one); and
parameters added later with ``add_param_group`` are synchronized too.

Uneven data, as in Horovod: a rank out of batches calls ``hvd.join()`` and, until every rank has
joined, takes part in the others' gradient syncs with zeros (Average still divides by the set's
size); then ``hvd.broadcast_parameters(..., root_rank=hvd.join()'s result)`` gives every rank the
model of a rank that did every step. This covers optimizers on the global process set (join has
no process set); call step() (or synchronize()) before hvd.join(), not between backward and step.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterable, Iterator, Mapping

import torch

from ..trace import progress as _progress
from . import basics, knobs
from ._grad_sync import GradSync, Transport
from .compression import Compression
from .process_sets import ProcessSet, global_process_set

__all__ = ["DistributedOptimizer"]

_WHO = "hvd.DistributedOptimizer"


def _param_list(param_groups: list[dict[str, Any]]) -> list[torch.Tensor]:
    return [p for group in param_groups for p in group["params"]]


def _parameter_names(param_groups: list[dict[str, Any]], named_parameters: Any) -> dict[torch.Tensor, str]:
    """{parameter: name}, from `named_parameters` or Horovod's default names; ValueError when a
    name repeats or an optimized parameter has none."""
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}.{j}" for i, group in enumerate(param_groups)
                for j, p in enumerate(group["params"])}
    if isinstance(named_parameters, Mapping):
        named_parameters = named_parameters.items()
    pairs = list(named_parameters)
    if any(not isinstance(pair, tuple) or len(pair) != 2 for pair in pairs):
        raise ValueError(f"{_WHO}: named_parameters must be (name, parameter) pairs, as "
                         "model.named_parameters() yields them")
    count: dict[str, int] = {}
    for name, _ in pairs:
        count[name] = count.get(name, 0) + 1
    repeated = sorted(str(name) for name, n in count.items() if n > 1)
    if repeated:
        raise ValueError(f"{_WHO}: named_parameters gives the same name to several parameters: "
                         f"{', '.join(repeated)}; names must be unique (for two models, "
                         "prefix each model's names)")
    names = {p: name for name, p in pairs}
    missing = [p for p in _param_list(param_groups) if p not in names]
    if missing:
        shapes = ", ".join(str(tuple(p.shape)) for p in missing[:5])
        raise ValueError(f"{_WHO}: named_parameters has no name for {len(missing)} of the optimizer's "
                         f"parameters (shapes {shapes}{', ...' if len(missing) > 5 else ''}); pass "
                         "the named_parameters() of the whole model the optimizer trains")
    return names


def _check_groups(groups: Any) -> None:
    """Horovod's rules for `groups`: a positive int, or lists of distinct tensors."""
    if groups is None:
        return
    if isinstance(groups, bool) or not (isinstance(groups, list) or
                                        (isinstance(groups, int) and groups > 0)):
        raise ValueError(f"{_WHO}: groups must be a positive int or a list of lists of parameters, "
                         f"got {groups!r}")
    if isinstance(groups, list):
        seen: set[int] = set()
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError(f"{_WHO}: groups must hold parameters (tensors), got {type(p).__name__}")
                if id(p) in seen:
                    raise ValueError(f"{_WHO}: a parameter of shape {tuple(p.shape)} is in groups twice; "
                                     "each parameter may be in one group only")
                seen.add(id(p))


class _DistributedOptimizer:
    """What DistributedOptimizer adds to the user's optimizer class (placed before it in the MRO)."""

    # Set by DistributedOptimizer(); Horovod's attribute names.
    _parameter_names: dict[torch.Tensor, str]
    backward_passes_per_step: int
    op: int
    gradient_predivide_factor: float
    sparse_as_dense: bool
    process_set: ProcessSet

    def _hvd_start(self, names: dict[torch.Tensor, str], compression: Any, groups: Any) -> None:
        """Hooks and Reducer where gradients are reduced: on the set's ranks, more than one rank
        in the job (or HOROVOD_ELASTIC=1), as in Horovod."""
        self._parameter_names = names
        self._hvd_compression, self._hvd_groups = compression, groups
        self._synchronized = False
        self._should_synchronize = True
        self._hvd_sync: GradSync | None = None
        if self.process_set.included() and (basics.size() > 1 or knobs.current().elastic):
            self._hvd_sync_build()

    def _hvd_sync_build(self) -> None:
        params = [p for p in dict.fromkeys(_param_list(self.param_groups)) if p.requires_grad]
        transport = Transport(self.process_set, self.op, self.gradient_predivide_factor,
                              self._hvd_compression)
        self._hvd_sync = GradSync(params, [self._parameter_names[p] for p in params], transport,
                                  self.backward_passes_per_step, self._hvd_groups, self.sparse_as_dense)

    def synchronize(self) -> None:
        """Waits until every gradient is reduced across the process set and written to .grad."""
        if self._hvd_sync is not None:
            self._hvd_sync.synchronize()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside, step() does not synchronize (after an explicit synchronize())."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        """Synchronizes (unless inside skip_synchronize()), then the wrapped optimizer's step."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() after an explicit "
                    "optimizer.synchronize(): the gradients are reduced a second time, which costs "
                    "a whole round of communication. Call step() inside "
                    "`with optimizer.skip_synchronize():` when you synchronize yourself.",
                    stacklevel=2)
            self.synchronize()
        self._synchronized = False
        _progress.step()  # for the rank's status
        return super().step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's zero_grad; an error between backward and step/synchronize."""
        if self._hvd_sync is not None and self._hvd_sync.pending:
            raise AssertionError(
                f"rank {self._hvd_sync.rank}: {_WHO}: zero_grad() was called after backward() and "
                "before step() or synchronize(): gradients are being reduced in the background "
                "and clearing them now would race with that. Call zero_grad() before backward() "
                "or after step()")
        super().zero_grad(set_to_none)  # type: ignore[misc]

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Changes backward_passes_per_step (restarting the count of passes)."""
        if isinstance(passes, bool) or not isinstance(passes, int) or passes <= 0:
            raise ValueError(f"{_WHO}: backward_passes_per_step must be a positive int, got {passes!r}")
        self.backward_passes_per_step = passes
        if self._hvd_sync is not None:
            self._hvd_sync.passes = passes
            self._hvd_sync.delay = [passes] * len(self._hvd_sync.delay)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The wrapped optimizer's load_state_dict; an unfinished sync is abandoned first."""
        sync = self._hvd_sync
        if sync is not None:
            if sync.reducer.in_progress:
                sync.reducer.recover()
            sync.delay = [sync.passes] * len(sync.delay)
            sync.pending = False
        self._synchronized = False
        self._should_synchronize = True
        super().load_state_dict(state_dict)  # type: ignore[misc]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """The wrapped optimizer's add_param_group; the new parameters are synchronized too."""
        sync = getattr(self, "_hvd_sync", None)
        if sync is not None and sync.pending:
            raise RuntimeError(f"rank {sync.rank}: {_WHO}: add_param_group() between backward() and "
                               "step(); add parameter groups before backward() or after step()")
        super().add_param_group(param_group)  # type: ignore[misc]
        if not hasattr(self, "_parameter_names"):
            return  # still being built
        i = len(self.param_groups) - 1
        for j, p in enumerate(self.param_groups[i]["params"]):
            self._parameter_names.setdefault(p, f"allreduce.noname.{i}.{j}")
        if sync is not None:
            self._hvd_sync = None  # its hooks go with it
            self._hvd_sync_build()


_classes: dict[type, type] = {}
_OURS = frozenset(vars(_DistributedOptimizer))


def _distributed_class(base: type) -> type:
    """The subclass of `base` (named like it) with _DistributedOptimizer's behaviour."""
    if base not in _classes:
        _classes[base] = type(base.__name__, (_DistributedOptimizer, base),
                              {"__module__": __name__, "__qualname__": base.__qualname__})
    return _classes[base]


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Iterable[Any] | None = None,
                         compression: Any = Compression.none, backward_passes_per_step: int = 1,
                         op: int = basics.Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set) -> torch.optim.Optimizer:
    """`optimizer`, reducing gradients across the process set before each step (Horovod's API)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{_WHO}: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError(f"{_WHO}: this optimizer is a DistributedOptimizer already; wrap the "
                         "plain optimizer once")
    if op == basics.Adasum:
        raise NotImplementedError(f"{_WHO}: op=hvd.Adasum is not implemented by torchring; use "
                                  "hvd.Average (the default) or hvd.Sum")
    if op not in (basics.Average, basics.Sum):
        raise ValueError(f"{_WHO}: op must be hvd.Average or hvd.Sum, got {basics.op_name(op)}")
    if gradient_predivide_factor != 1.0:
        if op != basics.Average:
            raise ValueError(f"{_WHO}: gradient_predivide_factor={gradient_predivide_factor} needs "
                             f"op=hvd.Average (got {basics.op_name(op)}); leave it at 1.0 for hvd.Sum")
        if not gradient_predivide_factor > 0:
            raise ValueError(f"{_WHO}: gradient_predivide_factor must be positive, got "
                             f"{gradient_predivide_factor}")
    if num_groups != 0:
        warnings.warn("DistributedOptimizer(num_groups=...) is deprecated (as in Horovod); pass "
                      "groups= instead", DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step <= 0:
        raise ValueError(f"{_WHO}: backward_passes_per_step must be a positive int, got "
                         f"{backward_passes_per_step!r}")
    names = _parameter_names(optimizer.param_groups, named_parameters)
    _check_groups(groups)
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"{_WHO}: process_set must be an hvd.ProcessSet, got {type(process_set).__name__}")
    basics.size()  # ValueError before hvd.init()
    if process_set.process_set_id is None or (process_set.included() and process_set.group is None):
        raise ValueError(f"{_WHO}: {process_set} is not registered; pass it to hvd.init("
                         "process_sets=...) or hvd.add_process_set() first")
    cls = _distributed_class(type(optimizer))
    opt = cls.__new__(cls)
    # The same param group dicts, state and hooks; not an instance attribute that would hide
    # one of our methods (an LR scheduler sets optimizer.step to count calls).
    opt.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k not in _OURS})
    opt.param_groups = list(optimizer.param_groups)
    opt.backward_passes_per_step = backward_passes_per_step
    opt.op = op
    opt.gradient_predivide_factor = float(gradient_predivide_factor)
    opt.sparse_as_dense = bool(sparse_as_dense)
    opt.process_set = process_set
    opt._hvd_start(names, compression, groups)
    return opt
