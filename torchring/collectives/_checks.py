"""The checks every collective's input gets before it is queued: tensor, op, scaling factors,
ranks, rows. Package-internal: basic, rooted, exchange and p2p call them, and so do the front
ends with rules of their own wording (torchring.horovod's check_tensor, wrap's module check),
through the rule functions here (dtype_advice; types.reduction_refusal for dtype x op).

Every message starts with ``tg.where(what)``: the rank, the group and the function the caller
called (docs/errors.md lists them).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .._core import gpu_path as _gpu_path
from .._core.group_wiring import Target
from .._core.types import DTYPES, OpKind, ReduceOp, describe, dtype_name, reduction_refusal


def dtype_advice(dtype: torch.dtype) -> str | None:
    """None for a dtype the engine moves, else the advice that ends every front end's message."""
    if dtype in DTYPES:
        return None
    return "use one of " + ", ".join(dtype_name(d) for d in DTYPES)


def check_tensor(t: Any, what: str, tg: Target, name: str = "tensor") -> torch.Tensor:
    """`t` if a collective can take it: a dense, contiguous CPU or CUDA tensor of an engine dtype."""
    where = tg.where(what)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where} expects a torch.Tensor as {name}, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{where}: {t.layout} tensors are not supported ({name}); pass a dense "
                        "tensor (tensor.to_dense())")
    advice = dtype_advice(t.dtype)
    if advice:
        raise TypeError(f"{where}: {name} {describe(t)} has a dtype torchring does not support; {advice}")
    if t.device.type == "cuda":
        _gpu_path.check(t, where)
    elif t.device.type != "cpu":
        raise ValueError(f"{where}: {name} {describe(t)} is on {t.device}; torchring handles "
                         "CPU and CUDA tensors")
    if not t.is_contiguous():
        raise ValueError(f"{where}: {name} {describe(t)} is not contiguous (strides "
                         f"{t.stride()}); pass tensor.contiguous() and use that tensor afterwards")
    return t


def check_op(kind: OpKind, t: torch.Tensor, op: Any, what: str, tg: Target) -> ReduceOp:
    """`op` if a `kind` collective of `t` can reduce with it (types.reduction_refusal's rule)."""
    where = tg.where(what)
    if not isinstance(op, ReduceOp):
        raise TypeError(f"{where}: op must be a torchring.ReduceOp, got {op!r}")
    refusal = reduction_refusal(kind, t.dtype, op, scaled=False)
    if refusal == "bool":
        raise TypeError(f"{where}: bool tensors support ReduceOp.MIN, MAX, BAND, BOR and BXOR only, got "
                        f"{op.name}; convert to an integer dtype to sum or multiply")
    if refusal == "bitwise":
        raise TypeError(f"{where}: ReduceOp.{op.name} needs an integer or bool tensor, got {describe(t)}; "
                        "view it as an integer dtype of the same size, or use another op")
    if refusal == "avg":
        raise ValueError(f"{where}: ReduceOp.AVG needs a floating-point tensor, got {describe(t)}; "
                         "use SUM and divide, or convert to float")
    return op


def scale_kwargs(kind: OpKind, t: torch.Tensor, prescale: Any, postscale: Any, what: str,
                 tg: Target) -> dict[str, float]:
    """The engine's prescale/postscale keywords (none when both are 1)."""
    for name, value in (("prescale_factor", prescale), ("postscale_factor", postscale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{tg.where(what)}: {name} must be a finite number, got {value!r}")
    if prescale == 1 and postscale == 1:
        return {}
    if reduction_refusal(kind, t.dtype, None, scaled=True) == "scale":
        raise ValueError(f"{tg.where(what)}: prescale_factor/postscale_factor other than 1 need a "
                         f"floating-point tensor, got {describe(t)}; scale it yourself or convert")
    return {"prescale": float(prescale), "postscale": float(postscale)}


def check_rank(value: Any, name: str, what: str, tg: Target) -> int:
    """A src/dst/peer argument: a rank of `tg`'s group."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < tg.size:
        kind = "a rank" if tg.is_world else "a rank of the group (group ranks, not world ranks)"
        raise ValueError(f"{tg.where(what)}: {name} must be {kind} in [0, {tg.size}), got {value!r}")
    return value


def check_rows(t: torch.Tensor, what: str, tg: Target) -> None:
    """Refuses a scalar where dim 0 is split over the ranks."""
    if t.dim() == 0:
        raise ValueError(f"{tg.where(what)}: tensor {describe(t)} has no dim 0 to split over the "
                         f"ranks; pass a tensor of at least one dimension (tensor.reshape(1))")


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True if the bytes of contiguous `a` and `b` overlap."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()
