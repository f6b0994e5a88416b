"""Gradient compression for ``hvd.DistributedOptimizer`` and ``hvd.allreduce(compression=...)``.

A compressor turns a tensor into what travels (``compress(t) -> (wire, ctx)``) and the reduced
wire tensor back into the original kind (``decompress(wire, ctx)``). ``Compression.fp16`` and
``Compression.bf16`` send floating-point tensors as 16-bit floats and restore their dtype;
tensors of other dtypes pass through both steps unchanged. Users may subclass ``Compressor``
with their own static (or instance) methods; DistributedOptimizer applies a custom compressor
to each gradient bucket, and the built-in 16-bit ones through the bucket's preallocated wire
buffer (the same cast, without an allocation per step).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression",
           "wire_dtype"]


class Compressor:
    """Base class of compressors: compress(tensor) -> (tensor, ctx); decompress(tensor, ctx)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The tensor to send, and what decompress() needs to undo the change."""
        raise NotImplementedError("a Compressor subclass must define compress(tensor)")

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The received tensor turned back into what compress() was given."""
        raise NotImplementedError("a Compressor subclass must define decompress(tensor, ctx)")


class NoneCompressor(Compressor):
    """Sends tensors as they are (the default)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """`tensor` itself; no context."""
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """`tensor` itself."""
        return tensor


class _CastCompressor(Compressor):
    """Sends floating-point tensors as `wire` (a 16-bit float dtype); the context is the
    original dtype, restored by decompress. Other dtypes are not touched."""

    wire: torch.dtype = torch.float16

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:  # type: ignore[override]
        """A 16-bit copy of a floating-point `tensor` (other dtypes as they are) and its dtype."""
        if tensor.dtype.is_floating_point and tensor.dtype != cls.wire:
            return tensor.to(cls.wire), tensor.dtype
        return tensor, tensor.dtype

    @classmethod
    def decompress(cls, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:  # type: ignore[override]
        """`tensor` cast back to the dtype compress() recorded."""
        if isinstance(ctx, torch.dtype) and ctx.is_floating_point and tensor.dtype != ctx:
            return tensor.to(ctx)
        return tensor


class FP16Compressor(_CastCompressor):
    """Sends floating-point tensors as float16."""

    wire = torch.float16


class BF16Compressor(_CastCompressor):
    """Sends floating-point tensors as bfloat16 (Horovod has no such compressor)."""

    wire = torch.bfloat16


class Compression:
    """The compressors to pass as ``compression=``: none (the default), fp16, bf16."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


def wire_dtype(compression: Any) -> tuple[bool, torch.dtype | None]:
    """(True, dtype) when `compression` is a built-in compressor (class or instance) that a
    bucket can apply as a plain cast to dtype (None: no cast); (False, None) for anything else."""
    kind = compression if isinstance(compression, type) else type(compression)
    if kind is NoneCompressor:
        return True, None
    if kind in (FP16Compressor, BF16Compressor):
        return True, kind.wire
    return False, None
