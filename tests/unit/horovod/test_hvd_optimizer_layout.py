"""hvd.DistributedOptimizer's bucket layout in one process: the fusion-threshold caps, Horovod's
`groups=` turned into a fixed Reducer assignment (a group is never split, whole groups share a
bucket up to the cap, backward order), and the Reducer honouring a fixed assignment."""

from __future__ import annotations

import pytest
import torch

from torchring.horovod import _grad_sync
from torchring.horovod._grad_sync import bucket_caps, group_assignment
from torchring._wrap.reducer import Reducer


def _params(*numels: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.zeros(n, dtype=dtype, requires_grad=True) for n in numels]


def test_caps_follow_the_fusion_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HOROVOD_FUSION_THRESHOLD", raising=False)
    assert bucket_caps() == (1 << 20, 25 << 20)   # Horovod's 128 MiB default is above wrap's caps
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", str(4 << 20))
    assert bucket_caps() == (1 << 20, 4 << 20)
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1000")
    assert bucket_caps() == (1000, 1000)
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "0")
    assert bucket_caps() == (0, 0)


def test_int_groups_split_consecutively_and_run_in_backward_order() -> None:
    params = _params(1, 1, 1, 1, 1, 1, 1)          # 7 params, 3 groups: [0,1,2] [3,4] [5,6]
    layout = group_assignment(params, 3, 0, 0)      # cap 0: no two groups share a bucket
    assert layout == [[6, 5], [4, 3], [2, 1, 0]]


def test_listed_groups_stay_whole_and_others_are_alone() -> None:
    params = _params(1, 1, 1, 1, 1)
    layout = group_assignment(params, [[params[0], params[3]], [params[1]]], 0, 0)
    # groups: {0,3}, {1}, {2}, {4}; ready order follows each group's first-registered parameter
    assert layout == [[4], [2], [1], [3, 0]]


def test_groups_share_buckets_up_to_the_cap_but_never_split() -> None:
    params = _params(10, 10, 10, 10, 10, 10)        # 40 bytes each
    layout = group_assignment(params, [[params[0], params[1], params[2]]], 50, 50)
    # units in order: [5] [4] [3] [2,1,0]; a bucket closes once it holds >= 50 bytes
    assert layout == [[5, 4], [3, 2, 1, 0]]
    # a group larger than the cap stays one bucket
    assert group_assignment(params, 1, 8, 8) == [[5, 4, 3, 2, 1, 0]]
    # fewer parameters than groups: empty groups vanish
    assert group_assignment(params[:2], 5, 0, 0) == [[1], [0]]


def test_a_group_with_two_dtypes_becomes_one_bucket_per_dtype() -> None:
    a, b = _params(4)[0], _params(4, dtype=torch.float64)[0]
    c = _params(4)[0]
    layout = group_assignment([a, b, c], [[a, b, c]], 1 << 20, 1 << 20)
    assert sorted(map(sorted, layout)) == [[0, 2], [1]]


def test_reducer_keeps_a_fixed_assignment() -> None:
    params = _params(3, 2, 4, 1)
    names = ["a", "b", "c", "d"]
    assignment = [[3, 0], [2], [1]]
    sent: list[torch.Tensor] = []

    class Done:
        def wait(self) -> None:
            pass

    def allreduce_async(t: torch.Tensor, op: object) -> Done:
        sent.append(t.clone())
        return Done()

    reducer = Reducer(params, names, first_bucket_cap_bytes=1, bucket_cap_bytes=1,
                      allocate=lambda n, dtype, device: torch.empty(n, dtype=dtype, device=device),
                      allreduce_async=allreduce_async, rank=0, assignment=assignment)
    assert reducer.layout() == [["d", "a"], ["c"], ["b"]]
    assert reducer.rebuilt  # no ready-order rebuild for a fixed layout
    assert reducer.rebuild_by_ready_order() is False
    assert reducer.layout() == [["d", "a"], ["c"], ["b"]]
    # one sync on a one-rank "world": buckets launch in assignment order, sized by it
    for i, p in enumerate(params):
        p.grad = torch.full(p.shape, float(i + 1))
    for i in (1, 2, 0, 3):
        reducer.mark_ready(i)
    reducer.finalize()
    assert [t.numel() for t in sent[:-1]] == [1 + 3, 4, 2]
    assert [p.grad.tolist() for p in params] == [[1.0] * 3, [2.0] * 2, [3.0] * 4, [4.0]]
    # rebuild() by order drops the assignment and goes back to the caps
    reducer.rebuild(["b", "a"])
    assert reducer.layout() == [["b"], ["a"], ["d"], ["c"]]


def test_reducer_rejects_a_bucket_of_two_dtypes() -> None:
    params = _params(2) + _params(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="mixes dtypes"):
        Reducer(params, ["a", "b"], allocate=lambda n, dtype, device: torch.empty(n, dtype=dtype),
                rank=0, assignment=[[0, 1]])


def test_module_docstring_mentions_zero_fill() -> None:
    # the zero-fill decision is documented where the behaviour lives
    assert "zero gradient" in (_grad_sync.__doc__ or "")
