"""``torchring.SyncBatchNorm``: batch normalization over the batch of every rank of a group.

    model = torchring.SyncBatchNorm.convert_sync_batchnorm(model)   # every BatchNorm*d
    model = torchring.wrap(model)

In training mode each rank normalizes with the mean and variance of the concatenation of all
ranks' batches (per-rank batch sizes may differ, a rank may even have none), and the running
statistics move as one BatchNorm's would on that concatenated batch. In eval mode the layer is
an ordinary BatchNorm (running statistics, no communication). Works on CPU and CUDA tensors:
the statistics travel through torchring's collectives on the group (the world by default).

How one training step communicates (every rank of the group, in the same order):
1. forward: one allgather of each rank's (count, mean, M2) per channel, M2 being the sum of
   squared deviations from the rank's own mean. The global mean and variance combine them
   without cancellation: M2 = sum_r M2_r + sum_r count_r * (mean_r - mean)^2.
2. backward (when the input needs a gradient): one SUM allreduce of the per-channel
   ``sum(dy)`` and ``sum(dy * (x - mean))``, the two sums the input gradient of a batch norm
   needs over the whole batch. The weight and bias gradients stay local: the gradient sync of
   ``torchring.wrap`` (or an optimizer) averages them like every other parameter's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .._core import context as _context
from ..collectives import basic as collectives
from ..collectives.groups import Group, world_group

__all__ = ["SyncBatchNorm"]


class _GroupRef:
    """Holds a module's Group so that copy.deepcopy(model) shares it instead of copying a
    communicator; pickling refuses with a message (a Group lives only in its session)."""

    __slots__ = ("group",)

    def __init__(self, group: Group) -> None:
        self.group = group

    def __deepcopy__(self, memo: dict) -> "_GroupRef":
        return self

    def __reduce__(self) -> Any:
        raise TypeError("torchring.SyncBatchNorm with group= cannot be pickled (a Group belongs to "
                        "one torchring session); save model.state_dict() instead")


def _channel_shape(x: torch.Tensor) -> list[int]:
    """Shape that broadcasts a per-channel vector against `x` (N, C, ...)."""
    return [1, x.size(1)] + [1] * (x.dim() - 2)


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))


def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    """Statistics of half-precision inputs are computed in float32, float64 stays float64."""
    return torch.promote_types(x.dtype, torch.float32)


class _SyncBatchNormFn(torch.autograd.Function):
    """Training-mode batch norm with statistics over every rank of `group` (see module doc)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, eps: float,
                momentum: float, group: Group) -> torch.Tensor:
        acc = _stat_dtype(x)
        channels, shape, dims = x.size(1), _channel_shape(x), _reduce_dims(x)
        count = x.numel() // channels
        xa = x.to(acc)
        if count > 0:
            mean_r = xa.mean(dims)
            m2_r = (xa - mean_r.view(shape)).square().sum(dims)
        else:  # no rows here: take part in the allgather with a count of 0
            mean_r = m2_r = torch.zeros(channels, dtype=acc, device=x.device)
        mine = torch.cat([torch.tensor([float(count)], dtype=acc, device=x.device), mean_r, m2_r])
        gathered = collectives.allgather(mine.unsqueeze(0), group)  # (ranks, 1 + 2C)
        counts, means, m2s = gathered[:, :1], gathered[:, 1:1 + channels], gathered[:, 1 + channels:]
        total = int(counts.sum().item())
        if total == 1:
            raise ValueError(f"rank {_context.rank()}: torchring.SyncBatchNorm: expected more than "
                             f"1 value per channel in training mode over the {group.size()} ranks of "
                             f"{'the world' if group.id == 0 else f'group {group.id}'}, got 1; use "
                             "larger batches or eval mode")
        ctx.group, ctx.total = group, total
        ctx.bias_dtype = None if bias is None else bias.dtype
        if total == 0:  # every rank's batch is empty: nothing to normalize or to learn from
            ctx.save_for_backward(x, weight, None, None)
            return torch.empty_like(x)
        mean = (counts * means).sum(0) / total
        m2 = m2s.sum(0) + (counts * (means - mean).square()).sum(0)
        var = m2 / total
        invstd = torch.rsqrt(var + eps)
        with torch.no_grad():
            if running_mean is not None:
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            if running_var is not None:  # unbiased, as BatchNorm keeps it
                unbiased = (var * (total / (total - 1))).to(running_var.dtype)
                running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
        y = (xa - mean.view(shape)) * invstd.view(shape)
        if weight is not None:
            y = y * weight.to(acc).view(shape)
        if bias is not None:
            y = y + bias.to(acc).view(shape)
        ctx.save_for_backward(x, weight, mean, invstd)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        nothing = (None,) * 5
        if mean is None:  # every batch was empty (see forward)
            return (torch.zeros_like(x) if need_x else None, None, None) + nothing
        acc, shape, dims = mean.dtype, _channel_shape(x), _reduce_dims(x)
        xmu = x.to(acc) - mean.view(shape)
        dya = dy.to(acc)
        sum_dy = dya.sum(dims)
        sum_dy_xmu = (dya * xmu).sum(dims)
        grad_w = (sum_dy_xmu * invstd).to(weight.dtype) if need_w and weight is not None else None
        grad_b = sum_dy.to(ctx.bias_dtype) if need_b and ctx.bias_dtype is not None else None
        grad_x = None
        if need_x:
            both = collectives.allreduce(torch.cat([sum_dy, sum_dy_xmu]), group=ctx.group)
            mean_dy, mean_dy_xmu = (both / ctx.total).split(sum_dy.numel())
            scale = invstd if weight is None else invstd * weight.to(acc)
            grad_x = (dya - mean_dy.view(shape) - xmu * (invstd.square() * mean_dy_xmu).view(shape))
            grad_x = (grad_x * scale.view(shape)).to(x.dtype)
        return (grad_x, grad_w, grad_b) + nothing


class SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics span the batches of every rank of `group`."""

    # Whether eval mode with batch statistics (track_running_stats=False) also synchronizes.
    # torch.nn.SyncBatchNorm does not; Horovod's does (torchring.horovod sets it).
    _sync_in_eval = False

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, group: Group | None = None,
                 device: Any = None, dtype: Any = None, *, bias: bool = True) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype,
                         bias=bias)
        if group is not None and not isinstance(group, Group):
            raise TypeError(f"torchring.SyncBatchNorm: group must be a torchring.Group (from "
                            f"torchring.new_group()) or None for the world, got {type(group).__name__}")
        self._group = None if group is None else _GroupRef(group)

    @property
    def group(self) -> Group | None:
        """The group whose ranks share batch statistics (None: the world)."""
        return None if self._group is None else self._group.group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"torchring.SyncBatchNorm: expected an input of at least 2 dimensions "
                             f"(N, C, ...), got {input.dim()}D of shape {list(input.shape)}")

    def _resolve_group(self) -> Group:
        """The group to synchronize over, looked up at forward time (after init())."""
        return self.group if self.group is not None else world_group()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalizes `input` (N, C, ...) with statistics over the group's ranks in training."""
        self._check_input_dim(input)
        if input.size(1) != self.num_features:
            raise ValueError(f"torchring.SyncBatchNorm: input has {input.size(1)} channels (dim 1 of "
                             f"{list(input.shape)}), the layer was built for {self.num_features}")
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        tracked = not self.training or self.track_running_stats
        running_mean = self.running_mean if tracked else None
        running_var = self.running_var if tracked else None
        group = None
        if batch_stats and (self.training or self._sync_in_eval) and _context.is_initialized():
            group = self._resolve_group()
            if not group.is_member:
                raise ValueError(f"rank {_context.rank()}: torchring.SyncBatchNorm: this rank is not "
                                 f"a member of its group (world ranks {list(group.ranks)}); build "
                                 "the layer with a group this rank belongs to")
        if group is None or group.size() == 1:
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                                batch_stats, factor, self.eps)
        return _SyncBatchNormFn.apply(input, self.weight, self.bias, running_mean, running_var,
                                      self.eps, factor, group)

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, group: Group | None = None) -> nn.Module:
        """Returns `module` with every BatchNorm*d replaced by a SyncBatchNorm sharing its state."""
        out = module
        if isinstance(module, _BatchNorm):
            out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                module.track_running_stats, group, bias=module.bias is not None)
            if module.affine:
                with torch.no_grad():
                    out.weight = module.weight
                    out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.training = module.training
            if hasattr(module, "qconfig"):
                out.qconfig = module.qconfig
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, group))
        return out
