"""hvd.Compression in one process: 16-bit compressors cast floating-point tensors only and
restore the dtype; none passes everything through; wire_dtype tells the optimizer which
compressors a bucket can apply as a plain cast."""

from __future__ import annotations

import pytest
import torch

from torchring.horovod.compression import (BF16Compressor, Compression, Compressor,
                                           FP16Compressor, NoneCompressor, wire_dtype)

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]


def _values(dtype: torch.dtype) -> torch.Tensor:
    # Small integers: exact in every dtype, float16 and bfloat16 included.
    return (torch.arange(60) % 7 - (0 if dtype == torch.uint8 else 3)).to(dtype).reshape(3, 4, 5)


@pytest.mark.parametrize("name,wire", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("dtype", FLOATS)
def test_16_bit_compressors_cast_floats_and_restore_them(name: str, wire: torch.dtype,
                                                         dtype: torch.dtype) -> None:
    compression = getattr(Compression, name)
    x = _values(dtype)
    sent, ctx = compression.compress(x)
    assert sent.dtype == wire
    assert torch.equal(sent.double(), x.double())
    back = compression.decompress(sent, ctx)
    assert back.dtype == dtype and back.shape == x.shape
    assert torch.equal(back, x)


@pytest.mark.parametrize("name", ["fp16", "bf16", "none"])
@pytest.mark.parametrize("dtype", INTS)
def test_integer_tensors_pass_through(name: str, dtype: torch.dtype) -> None:
    compression = getattr(Compression, name)
    x = _values(dtype)
    sent, ctx = compression.compress(x)
    assert sent.dtype == dtype and torch.equal(sent, x)
    back = compression.decompress(sent, ctx)
    assert back.dtype == dtype and torch.equal(back, x)


def test_fp16_rounds_like_a_cast() -> None:
    x = torch.tensor([1.0 + 2.0 ** -12, 70000.0, -3.5], dtype=torch.float64)
    sent, ctx = Compression.fp16.compress(x)
    assert torch.equal(sent, x.to(torch.float16))
    assert torch.equal(Compression.fp16.decompress(sent, ctx), x.to(torch.float16).double())


def test_none_returns_the_same_tensor() -> None:
    x = torch.ones(4)
    sent, ctx = Compression.none.compress(x)
    assert sent is x and ctx is None
    assert Compression.none.decompress(sent, ctx) is x


def test_compression_names_are_compressor_classes() -> None:
    assert Compression.none is NoneCompressor
    assert Compression.fp16 is FP16Compressor
    assert Compression.bf16 is BF16Compressor
    for c in (Compression.none, Compression.fp16, Compression.bf16):
        assert issubclass(c, Compressor)
    # usable as classes (Horovod's way) and as instances
    sent, ctx = FP16Compressor().compress(torch.ones(2))
    assert sent.dtype == torch.float16 and ctx == torch.float32


def test_base_class_must_be_overridden() -> None:
    with pytest.raises(NotImplementedError):
        Compressor.compress(torch.ones(1))
    with pytest.raises(NotImplementedError):
        Compressor.decompress(torch.ones(1), None)


class _Halving(Compressor):
    @staticmethod
    def compress(tensor):
        return tensor * 0.5, 2.0

    @staticmethod
    def decompress(tensor, ctx):
        return tensor * ctx


class _FP16Subclass(FP16Compressor):
    pass


def test_wire_dtype() -> None:
    assert wire_dtype(Compression.none) == (True, None)
    assert wire_dtype(Compression.fp16) == (True, torch.float16)
    assert wire_dtype(Compression.bf16()) == (True, torch.bfloat16)
    # anything else is applied through compress/decompress, subclasses of built-ins included
    assert wire_dtype(_Halving) == (False, None)
    assert wire_dtype(_FP16Subclass) == (False, None)
