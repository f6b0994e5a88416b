"""collectives/_checks.py's dtype rule, shared by the collectives, torchring.horovod and wrap:
one list of the dtypes torchring moves, each front end's own words around it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchring._wrap import model
from torchring.collectives import _checks
from torchring.horovod.ops_reduce import check_tensor as hvd_check_tensor

EVERY_DTYPE = "float32, float64, float16, bfloat16, int8, uint8, int32, int64, bool, int16"


def test_the_engine_dtypes_pass_and_the_advice_names_them_all() -> None:
    assert _checks.dtype_advice(torch.bool) is None and _checks.dtype_advice(torch.int16) is None
    assert _checks.dtype_advice(torch.complex64) == f"use one of {EVERY_DTYPE}"


def test_horovod_words_the_rule_its_own_way() -> None:
    with pytest.raises(ValueError) as caught:
        hvd_check_tensor(torch.zeros(2, dtype=torch.complex64), "allreduce")
    assert str(caught.value) == f"hvd.allreduce: tensor dtype complex64 is not supported; use one of {EVERY_DTYPE}"


def test_wrap_words_the_rule_its_own_way() -> None:
    module = nn.Module()
    module.register_buffer("table", torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(TypeError) as caught:
        model._check_module(module, 3)
    assert str(caught.value) == ("rank 3: torchring.wrap: 'table' has dtype complex64, which torchring "
                                 f"cannot communicate; use one of {EVERY_DTYPE}")
