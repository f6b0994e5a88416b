"""Deterministic per-rank inputs, single-process references, and a result collector.

Every rank can build every other rank's input, so each rank checks its own result against a
reference computed locally with plain torch ops (``torch.stack(...).sum(0)`` and friends).
Inputs are small integers, distinct per rank and per element, chosen so that every dtype and op
is exact: |x| <= 15 for SUM/MIN/MAX (sum of 4 ranks fits int8), x in {-1, 1, 2} ({1, 2} for
unsigned) for PRODUCT, AVG inputs are multiples of the world size so the mean is an integer, and
BAND/BOR/BXOR inputs are hashed bit patterns that fill every bit of the dtype (negatives included).
"""

from __future__ import annotations

import pytest
import torch

FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INT_DTYPES = [torch.int8, torch.uint8, torch.int32, torch.int64]
DTYPES = FLOAT_DTYPES + INT_DTYPES
OPS = ["SUM", "AVG", "MIN", "MAX", "PRODUCT"]
BITWISE = ["BAND", "BOR", "BXOR"]


def valid_ops(dtype: torch.dtype) -> list[str]:
    """Ops torchring supports for ``dtype``: bool MIN/MAX and the bitwise ops, AVG only for
    floats, the bitwise ops only for integers and bool."""
    if dtype == torch.bool:
        return ["MIN", "MAX"] + BITWISE
    if dtype.is_floating_point:
        return OPS
    return [op for op in OPS if op != "AVG"] + BITWISE


def rank_input(rank: int, world: int, numel: int, dtype: torch.dtype, op: str = "SUM",
               shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """Rank ``rank``'s input: small integers, distinct per rank and element, exact for ``op``."""
    i = torch.arange(numel, dtype=torch.int64)
    # Mixing in higher bits of the index gives a long period, so a shifted chunk cannot match.
    h = i * 7 + (i >> 5) * 11 + (i >> 10) * 5 + rank * 13
    if dtype == torch.bool:
        x = (h % (rank + 2)) == 0
    elif op in BITWISE:  # every bit of the dtype: .to() keeps the low bits of the int64
        x = (h * 2654435761 + rank * 40503) % (1 << 40) - (1 << 39)
        x = x.to(dtype) if dtype != torch.int64 else x * 4099 + (h << 52)
    elif op == "PRODUCT":
        choices = torch.tensor([1, 2, -1] if dtype != torch.uint8 else [1, 2, 2])
        x = choices[(i // (rank + 1) + i // 7 + rank) % 3]
    else:
        x = h % 31 if dtype == torch.uint8 else h % 31 - 15
        if op == "AVG":
            x = x * world
    return x.to(dtype).reshape(shape if shape is not None else (numel,))


def reference(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """Reduce the ranks' inputs in one process, in float64 (exact here), cast back; the bitwise
    ops in the inputs' own dtype."""
    dtype = inputs[0].dtype
    if op in BITWISE:
        fold = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
        out = inputs[0].clone()
        for t in inputs[1:]:
            out = fold(out, t)
        return out
    x = torch.stack([t.to(torch.float64) for t in inputs])
    if op == "SUM":
        out = x.sum(0)
    elif op == "AVG":
        out = x.sum(0) / len(inputs)
    elif op == "MIN":
        out = x.amin(0)
    elif op == "MAX":
        out = x.amax(0)
    elif op == "PRODUCT":
        out = x.prod(0)
    else:
        raise ValueError(f"unknown op {op!r}")
    return out.to(dtype)


def expected_allreduce(world: int, numel: int, dtype: torch.dtype, op: str,
                       shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """The allreduce result every rank should see for :func:`rank_input` data."""
    return reference([rank_input(r, world, numel, dtype, op, shape) for r in range(world)], op)


class Checker:
    """Collects mismatches instead of stopping at the first, so one job reports every bad case."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.failures: list[str] = []

    def fail(self, what: str, why: str) -> None:
        self.failures.append(f"rank {self.rank}: {what}: {why}")

    def equal(self, what: str, got: torch.Tensor, want: torch.Tensor, exact: bool = True) -> None:
        """Record a failure unless ``got`` matches ``want`` in dtype, shape and values."""
        if not isinstance(got, torch.Tensor):
            return self.fail(what, f"expected a Tensor, got {type(got).__name__}")
        if got.dtype != want.dtype or got.shape != want.shape:
            return self.fail(what, f"got {got.dtype}{list(got.shape)}, "
                                   f"expected {want.dtype}{list(want.shape)}")
        if exact:
            if not torch.equal(got, want):
                bad = (got != want).flatten().nonzero().flatten()
                j = int(bad[0])
                self.fail(what, f"{bad.numel()} of {want.numel()} elements wrong, first at flat index "
                                f"{j}: got {got.flatten()[j].item()}, expected {want.flatten()[j].item()}")
        else:
            try:
                torch.testing.assert_close(got, want)
            except AssertionError as e:
                self.fail(what, str(e).replace("\n", " "))

    def true(self, what: str, cond: bool, why: str = "condition is false") -> None:
        if not cond:
            self.fail(what, why)


def check_transport(chk: Checker) -> None:
    """If torchring reports its transport, it must be the one TORCHRING_TRANSPORT/_HOSTNAME asked for."""
    import os

    import torchring

    reported = getattr(torchring, "transport", None)
    if reported is None or torchring.size() == 1:
        return
    got = reported()
    asked = os.environ.get("TORCHRING_TRANSPORT", "auto")
    if "TORCHRING_HOSTNAME" in os.environ:
        chk.true("transport() with fake hosts", "tcp" in got, f"got {got!r}")
    elif asked in ("shm", "tcp"):
        chk.true(f"transport() with TORCHRING_TRANSPORT={asked}", got == asked, f"got {got!r}")


def assert_no_failures(results: list[list[str]]) -> None:
    """Fail the test with every rank's recorded mismatches (the first 40)."""
    failures = [f for per_rank in results for f in per_rank]
    if failures:
        pytest.fail(f"{len(failures)} mismatches:\n" + "\n".join(failures[:40]), pytrace=False)
