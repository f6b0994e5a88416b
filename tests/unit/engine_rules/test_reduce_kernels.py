"""The engine's reduction kernels (csrc/core/reduce.cpp) against torch, in process, through the
test-only ``reduce_tensors`` binding: exact integer sums, float16/bfloat16 accumulated in float32
and rounded once, NaN and inf, block boundaries."""

from __future__ import annotations

import pytest
import torch

from torchring._core import build as _build

ENGINE = _build.load()
OPS = {"SUM": 0, "MIN": 2, "MAX": 3, "PRODUCT": 4, "BAND": 5, "BOR": 6, "BXOR": 7}
SIZES = [1, 511, 512, 513, 2000]  # the kernels walk blocks of 512 elements


def _reference(srcs: list[torch.Tensor], op: str, scale: float = 1.0) -> torch.Tensor:
    """What the kernel must produce: torch's reduction in float32 (16-bit floats) or the dtype."""
    acc_dtype = torch.float32 if srcs[0].dtype in (torch.float16, torch.bfloat16) else srcs[0].dtype
    acc = srcs[0].to(acc_dtype)
    for s in srcs[1:]:
        s = s.to(acc_dtype)
        acc = {"SUM": torch.add, "PRODUCT": torch.mul, "MIN": torch.minimum, "MAX": torch.maximum,
               "BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op](acc, s)
    if scale != 1.0:
        acc = acc * scale
    return acc.to(srcs[0].dtype)


def _run(srcs: list[torch.Tensor], op: str, scale: float = 1.0) -> torch.Tensor:
    dst = torch.empty_like(srcs[0])
    ENGINE.reduce_tensors(dst, srcs, OPS[op], scale)
    return dst


def test_engine_enums_match_their_python_mirror() -> None:
    assert ENGINE.REDUCE_OPS == {"SUM": 0, "AVG": 1, "MIN": 2, "MAX": 3, "PRODUCT": 4, "BAND": 5, "BOR": 6,
                                 "BXOR": 7}
    assert ENGINE.DTYPES == ["float32", "float64", "float16", "bfloat16", "int8", "uint8",
                             "int32", "int64", "bool", "int16"]


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
                                   torch.float32, torch.float64])
@pytest.mark.parametrize("op", ["SUM", "MIN", "MAX", "PRODUCT"])
def test_exact_dtypes(dtype: torch.dtype, op: str) -> None:
    gen = torch.Generator().manual_seed(7)
    for n in SIZES:
        for nsrc in (1, 2, 3, 5):
            lo, hi = (0, 4) if dtype == torch.uint8 or op == "PRODUCT" else (-9, 10)
            srcs = [torch.randint(lo, hi, (n,), generator=gen).to(dtype) for _ in range(nsrc)]
            assert torch.equal(_run(srcs, op), _reference(srcs, op)), (dtype, op, n, nsrc)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize("op", ["BAND", "BOR", "BXOR"])
def test_bitwise_every_bit(dtype: torch.dtype, op: str) -> None:
    gen = torch.Generator().manual_seed(11)
    info = torch.iinfo(dtype)
    for n in SIZES:
        for nsrc in (1, 2, 3, 5):  # the full range of the dtype: sign bits and high bits too
            srcs = [torch.randint(info.min, info.max, (n,), generator=gen, dtype=torch.int64).to(dtype)
                    for _ in range(nsrc)]
            assert torch.equal(_run(srcs, op), _reference(srcs, op)), (dtype, op, n, nsrc)


@pytest.mark.parametrize("op", ["MIN", "MAX", "BAND", "BOR", "BXOR"])
def test_bool(op: str) -> None:
    srcs = [torch.tensor([True, False, True, False]), torch.tensor([True, True, False, False])]
    want = {"MIN": srcs[0] & srcs[1], "MAX": srcs[0] | srcs[1], "BAND": srcs[0] & srcs[1],
            "BOR": srcs[0] | srcs[1], "BXOR": srcs[0] ^ srcs[1]}[op]
    got = _run(srcs, op)
    assert torch.equal(got, want) and got.view(torch.uint8).max() <= 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_floats_accumulate_in_float32_and_round_once(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    for n in SIZES:
        srcs = [torch.randn(n, generator=gen).to(dtype) for _ in range(4)]
        got = _run(srcs, "SUM")
        want = _reference(srcs, "SUM")  # float32 sum, one round-to-nearest-even
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (dtype, n)
    # Many small addends: rounding after every step would lose them; one final rounding keeps them.
    big = torch.full((8,), 256.0, dtype=dtype)
    small = [torch.full((8,), 0.5, dtype=dtype) for _ in range(8)]
    assert _run([big, *small], "SUM").tolist() == [260.0] * 8


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_avg_scale_is_applied_once_before_rounding(dtype: torch.dtype) -> None:
    srcs = [torch.tensor([1.0, 3.0, -7.0, 1000.0], dtype=dtype) for _ in range(3)]
    got = _run(srcs, "SUM", scale=1 / 3)
    assert torch.equal(got, _reference(srcs, "SUM", 1 / 3))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("op", ["SUM", "MIN", "MAX", "PRODUCT"])
def test_nan_and_inf_follow_torch(dtype: torch.dtype, op: str) -> None:
    nan, inf = float("nan"), float("inf")
    a = torch.tensor([nan, 1.0, inf, -inf, inf, 2.0, nan], dtype=dtype)
    b = torch.tensor([1.0, nan, 1.0, inf, inf, -inf, nan], dtype=dtype)
    for srcs in ([a, b], [b, a], [a, b, a]):
        got, want = _run(srcs, op), _reference(srcs, op)
        assert torch.equal(torch.isnan(got), torch.isnan(want)), (op, got, want)
        finite = ~torch.isnan(want)
        assert torch.equal(got[finite], want[finite]), (op, got, want)


def test_float16_overflow_is_inf() -> None:
    srcs = [torch.full((3,), 60000.0, dtype=torch.float16)] * 2
    assert torch.isinf(_run(srcs, "SUM")).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_16bit_value_converts_as_torch_does(dtype: torch.dtype) -> None:
    """All 65536 bit patterns (subnormals, infs, NaNs) through the kernels' vector widening and
    narrowing (8 and more at a time), alone and scaled, and summed with a subnormal."""
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
    tiny = torch.full_like(every, torch.finfo(dtype).smallest_normal / 4)  # a subnormal
    for srcs, scale in [([every], 1.0), ([every], 0.5), ([every, tiny], 1.0), ([tiny, every], 3.0)]:
        got, want = _run(srcs, "SUM", scale), _reference(srcs, "SUM", scale)
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan), (dtype, scale)
        assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16)), (dtype, scale)
