"""torchring._core.types: the enums and dtypes shared with the engine, checked against it at load,
and the one dtype spelling of every message."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from torchring._core import types as _types

# What the engine declares (issue #11): op kinds, and dtypes in the engine's enum order.
ENGINE_OP_KINDS = {"ALLREDUCE": 0, "BROADCAST": 1, "ALLGATHER": 2, "REDUCE_SCATTER": 3, "BARRIER": 4,
                   "REDUCE": 5, "GATHER": 6, "SCATTER": 7, "ALLTOALL": 8, "ALLREDUCE_MANY": 9,
                   "SEND": 10, "RECV": 11}
ENGINE_REDUCE_OPS = {"SUM": 0, "AVG": 1, "MIN": 2, "MAX": 3, "PRODUCT": 4}
ENGINE_DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64", "bool",
                 "int16"]


def _engine(**attrs: object) -> SimpleNamespace:
    full = dict(REDUCE_OPS=ENGINE_REDUCE_OPS, OP_KINDS=ENGINE_OP_KINDS, DTYPES=ENGINE_DTYPES)
    full.update(attrs)
    return SimpleNamespace(**{k: v for k, v in full.items() if v is not None})


def test_describe_spells_dtype_and_shape() -> None:
    assert _types.describe(torch.zeros(1000)) == "float32[1000]"
    assert _types.describe(torch.zeros(10, 100, dtype=torch.bfloat16)) == "bfloat16[10, 100]"
    assert _types.describe(torch.tensor(3, dtype=torch.int64)) == "int64[]"


def test_an_engine_that_agrees_passes() -> None:
    _types.check_engine(_engine())
    _types.check_engine(_engine(OP_KINDS={k.lower(): v for k, v in ENGINE_OP_KINDS.items()}))


def test_an_older_engine_without_the_attributes_is_not_checked() -> None:
    _types.check_engine(SimpleNamespace())
    _types.check_engine(_engine(DTYPES=None))


@pytest.mark.parametrize("attr,theirs", [
    ("REDUCE_OPS", {**ENGINE_REDUCE_OPS, "PRODUCT": 5}),
    ("REDUCE_OPS", {**ENGINE_REDUCE_OPS, "BAND": 5}),
    ("OP_KINDS", {k: v for k, v in ENGINE_OP_KINDS.items() if k != "BARRIER"}),
    ("OP_KINDS", {**ENGINE_OP_KINDS, "ALLGATHER": 3, "REDUCE_SCATTER": 2}),
    ("DTYPES", ENGINE_DTYPES[:-1]),
    ("DTYPES", ["float64", "float32", *ENGINE_DTYPES[2:]]),
])
def test_any_difference_fails_the_load(attr: str, theirs: object) -> None:
    with pytest.raises(ImportError) as caught:
        _types.check_engine(_engine(**{attr: theirs}))
    assert attr in str(caught.value) and "rebuild" in str(caught.value)


def test_handle_waits_once_and_reports_the_engine_sequence_number() -> None:
    class Work:
        seq = 41
        waits = 0

        def wait(self, timeout: float) -> torch.Tensor:
            Work.waits += 1
            return torch.ones(2)

        def is_completed(self) -> bool:
            return Work.waits > 0

    handle = _types.Handle(Work(), lambda out: out * 3)
    assert repr(handle) == "<torchring.Handle #41 pending>"
    assert handle.wait().tolist() == [3.0, 3.0]
    assert handle.synchronize().tolist() == [3.0, 3.0]  # a CPU work has no synchronize()
    assert Work.waits == 1 and handle.is_completed()
    assert repr(handle) == "<torchring.Handle #41 completed>"
