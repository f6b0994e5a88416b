"""Bucket layout (buckets.assign) and bucket buffers (buckets.build) in one process.

The expected groupings are worked out by hand from the rule in buckets.py: walk the parameters
in the given order, one open bucket per (device, dtype); a bucket closes once it holds at least
its cap, the first bucket of each kind at the first cap; buckets are ordered by their first
parameter's position in the order.
"""

from __future__ import annotations

import torch

from torchring._wrap import buckets

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)  # devices are only compared here
F32, F16 = torch.float32, torch.float16


def _alloc(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full((numel,), 7, dtype=dtype, device=device)  # not zero: build must clear it


def test_a_bucket_closes_once_it_holds_its_cap() -> None:
    sizes = [(4, CPU, F32)] * 6
    got = buckets.assign(sizes, [5, 4, 3, 2, 1, 0], first_cap=4, cap=10)
    # 4 >= 4 closes the first; 4+4 < 10, 4+4+4 >= 10 closes the second; the rest stays open.
    assert got == [[5], [4, 3, 2], [1, 0]]


def test_a_parameter_larger_than_the_cap_gets_a_bucket_of_its_own() -> None:
    sizes = [(2, CPU, F32), (100, CPU, F32), (2, CPU, F32), (2, CPU, F32)]
    assert buckets.assign(sizes, [0, 1, 2, 3], first_cap=1, cap=50) == [[0], [1], [2, 3]]


def test_the_first_cap_applies_to_the_first_bucket_of_each_kind() -> None:
    sizes = [(8, CPU, F32), (8, CPU, F16), (8, CPU, F32), (8, CPU, F16), (8, CPU, F32)]
    got = buckets.assign(sizes, [0, 1, 2, 3, 4], first_cap=8, cap=16)
    # float32: [0] (first cap 8), then [2, 4] (16); float16: [1] (first cap), then [3] open.
    assert got == [[0], [1], [2, 4], [3]]


def test_devices_and_dtypes_never_share_a_bucket() -> None:
    sizes = [(4, CPU, F32), (4, GPU, F32), (4, CPU, F16), (4, GPU, F32), (4, CPU, F32)]
    got = buckets.assign(sizes, [4, 3, 2, 1, 0], first_cap=100, cap=100)
    assert got == [[4, 0], [3, 1], [2]]
    for group in got:
        assert len({sizes[i][1:] for i in group}) == 1, group


def test_buckets_follow_the_order_of_their_first_parameter() -> None:
    sizes = [(4, CPU, F32), (4, CPU, F16), (4, CPU, F32), (4, CPU, F16)]
    order = [3, 0, 2, 1]
    got = buckets.assign(sizes, order, first_cap=8, cap=8)
    assert got == [[3, 1], [0, 2]]
    assert buckets.assign([], [], first_cap=1, cap=1) == []


def test_build_lays_gradients_out_as_views_of_one_flat_buffer() -> None:
    weight = torch.zeros(2, 3, 4, 4).to(memory_format=torch.channels_last).requires_grad_()
    bias = torch.zeros(2, requires_grad=True)
    weight.grad = torch.arange(96.0).reshape(2, 3, 4, 4)  # contiguous, unlike the parameter
    (bucket,) = buckets.build([weight, bias], ["w", "b"], [1, 0], first_cap=1 << 20, cap=1 << 20,
                              compression=None, allocate=_alloc)
    assert bucket.names == ["b", "w"] and bucket.slots == [1, 0] and bucket.pending == 2
    assert bucket.buffer.numel() == 98 and bucket.nbytes == 98 * 4 and bucket.wire is None
    view_b, view_w = bucket.views
    assert view_w.stride() == weight.stride(), "the gradient keeps the parameter's memory format"
    assert weight.grad.data_ptr() == view_w.data_ptr(), ".grad moved into the bucket"
    assert torch.equal(weight.grad, torch.arange(96.0).reshape(2, 3, 4, 4)), "values kept"
    assert bias.grad is None and torch.equal(view_b, torch.zeros(2)), "the rest of the buffer is zeroed"
    assert view_w.data_ptr() == bucket.buffer.data_ptr() + 2 * 4


def test_build_adds_a_16_bit_wire_buffer_for_wider_float_buckets_only() -> None:
    params = [torch.zeros(3, requires_grad=True), torch.zeros(3, dtype=F16, requires_grad=True),
              torch.zeros(3, dtype=torch.float64, requires_grad=True)]
    built = buckets.build(params, ["s", "h", "d"], [0, 1, 2], first_cap=1, cap=1, compression=F16,
                          allocate=_alloc)
    wires = {b.names[0]: None if b.wire is None else b.wire.dtype for b in built}
    assert wires == {"s": F16, "h": None, "d": F16}
    assert [b.nbytes for b in built] == [6, 6, 6]


def test_adopt_grad_copies_a_gradient_that_lives_elsewhere() -> None:
    p = torch.zeros(2, 2, requires_grad=True)
    buffer = torch.zeros(4)
    view = buckets.grad_view(buffer, 0, p)
    buckets.adopt_grad(p, view)
    assert p.grad is None, "nothing to adopt"
    p.grad = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    buckets.adopt_grad(p, view)
    assert p.grad.data_ptr() == buffer.data_ptr() and buffer.tolist() == [1.0, 2.0, 3.0, 4.0]
    strided = torch.zeros(4, 4)[:, ::2].requires_grad_()  # a non-dense parameter
    assert buckets.grad_view(torch.zeros(9), 1, strided).is_contiguous()
