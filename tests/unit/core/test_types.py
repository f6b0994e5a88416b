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
ENGINE_REDUCE_OPS = {"SUM": 0, "AVG": 1, "MIN": 2, "MAX": 3, "PRODUCT": 4, "BAND": 5, "BOR": 6, "BXOR": 7}
ENGINE_DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64", "bool",
                 "int16"]
# The engine's OpSpec rows (csrc/core/common.cpp), as bindings.cpp publishes them.
_FIELDS = ("reduces", "rooted", "scalable", "in_place", "nccl", "ragged")
_KINDS_WITH = {
    "reduces": {"ALLREDUCE", "REDUCE_SCATTER", "REDUCE", "ALLREDUCE_MANY"},
    "rooted": {"BROADCAST", "REDUCE", "GATHER", "SCATTER"},
    "scalable": {"ALLREDUCE", "REDUCE_SCATTER", "ALLREDUCE_MANY"},
    "in_place": {"ALLREDUCE", "BROADCAST", "REDUCE", "SCATTER", "ALLREDUCE_MANY", "RECV"},
    "nccl": {"ALLREDUCE", "BROADCAST", "ALLGATHER", "REDUCE_SCATTER"},
    "ragged": {"ALLGATHER", "ALLTOALL"},
}
ENGINE_OP_SPECS = {k: {f: k in _KINDS_WITH[f] for f in _FIELDS} for k in ENGINE_OP_KINDS}


def _engine(**attrs: object) -> SimpleNamespace:
    full = dict(REDUCE_OPS=ENGINE_REDUCE_OPS, OP_KINDS=ENGINE_OP_KINDS, OP_SPECS=ENGINE_OP_SPECS,
                DTYPES=ENGINE_DTYPES)
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
    ("REDUCE_OPS", {**ENGINE_REDUCE_OPS, "BAND": 7}),
    ("REDUCE_OPS", {k: v for k, v in ENGINE_REDUCE_OPS.items() if k != "BXOR"}),
    ("OP_KINDS", {k: v for k, v in ENGINE_OP_KINDS.items() if k != "BARRIER"}),
    ("OP_KINDS", {**ENGINE_OP_KINDS, "ALLGATHER": 3, "REDUCE_SCATTER": 2}),
    ("OP_SPECS", {**ENGINE_OP_SPECS, "ALLTOALL": {**ENGINE_OP_SPECS["ALLTOALL"], "nccl": True}}),
    ("OP_SPECS", {k: {f: v for f, v in row.items() if f != "ragged"} for k, row in ENGINE_OP_SPECS.items()}),
    ("DTYPES", ENGINE_DTYPES[:-1]),
    ("DTYPES", ["float64", "float32", *ENGINE_DTYPES[2:]]),
])
def test_any_difference_fails_the_load(attr: str, theirs: object) -> None:
    with pytest.raises(ImportError) as caught:
        _types.check_engine(_engine(**{attr: theirs}))
    assert attr in str(caught.value) and "rebuild" in str(caught.value)


@pytest.mark.parametrize("field", _FIELDS)
def test_op_kind_properties_read_the_table(field: str) -> None:
    assert {k.name for k in _types.OpKind if getattr(k, field)} == _KINDS_WITH[field]


@pytest.mark.parametrize("kind,dtype,op,scaled,refusal", [
    (_types.OpKind.ALLREDUCE, torch.bool, _types.ReduceOp.SUM, False, "bool"),
    (_types.OpKind.REDUCE, torch.bool, _types.ReduceOp.AVG, False, "bool"),  # bool's rule first
    (_types.OpKind.ALLREDUCE, torch.bool, _types.ReduceOp.MAX, False, None),
    (_types.OpKind.ALLREDUCE, torch.bool, _types.ReduceOp.BXOR, False, None),
    (_types.OpKind.REDUCE, torch.int8, _types.ReduceOp.BAND, False, None),
    (_types.OpKind.ALLREDUCE, torch.bfloat16, _types.ReduceOp.BOR, False, "bitwise"),
    (_types.OpKind.REDUCE_SCATTER, torch.float64, _types.ReduceOp.BXOR, False, "bitwise"),
    (_types.OpKind.REDUCE_SCATTER, torch.int64, _types.ReduceOp.AVG, False, "avg"),
    (_types.OpKind.ALLREDUCE_MANY, torch.bfloat16, _types.ReduceOp.AVG, False, None),
    (_types.OpKind.ALLREDUCE, torch.int32, _types.ReduceOp.SUM, True, "scale"),
    (_types.OpKind.ALLREDUCE, torch.bool, None, True, "scale"),  # op None: only the factors' rule
    (_types.OpKind.ALLREDUCE, torch.float16, _types.ReduceOp.PRODUCT, True, None),
    (_types.OpKind.BROADCAST, torch.bool, _types.ReduceOp.AVG, True, None),  # no reduction, no rule
])
def test_reduction_refusal_names_the_broken_rule(kind, dtype, op, scaled, refusal) -> None:
    assert _types.reduction_refusal(kind, dtype, op, scaled) == refusal


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
