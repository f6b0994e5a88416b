"""The API's pure functions: a group's ranks and hosts, reduce_scatter's rows, alltoall's splits,
gather's per-rank views and allreduce_many's dtype groups."""

from __future__ import annotations

import pytest
import torch

from torchring._core import group_wiring as _groups
from torchring.collectives.basic import rows_of
from torchring.collectives.exchange import split_counts
from torchring.collectives.rooted import by_dtype, split_rows


def test_ranks_are_sorted_world_ranks() -> None:
    assert _groups.normalize_ranks([3, 0, 2], 4, 1) == (0, 2, 3)
    assert _groups.normalize_ranks(range(2), 2, 0) == (0, 1)
    assert _groups.normalize_ranks([], 3, 0) == ()


@pytest.mark.parametrize("ranks, error, words", [
    ([0, 2, 0], ValueError, "rank 0 is listed more than once"),
    ([1, 4], ValueError, r"rank 4 is not in \[0, 4\)"),
    ([-1], ValueError, r"rank -1 is not in \[0, 4\)"),
    ([0, True], TypeError, "True"),
    ([0, 1.0], TypeError, "1.0"),
    ("01", TypeError, "list of world ranks"),
    (3, TypeError, "list of world ranks"),
])
def test_bad_ranks_are_named(ranks: object, error: type, words: str) -> None:
    with pytest.raises(error, match=words) as info:
        _groups.normalize_ranks(ranks, 4, 2)
    assert str(info.value).startswith("rank 2: torchring.new_group")


@pytest.mark.parametrize("hosts, members, want", [
    ([[0, 1], [2, 3]], (1, 3), [[0], [1]]),
    ([[0, 1], [2, 3]], (0, 1), [[0, 1]]),
    ([[0, 3], [1, 2]], (1, 2, 3), [[0, 1], [2]]),  # hosts ordered by their smallest group rank
    ([[0], [1], [2], [3]], (0, 2, 3), [[0], [1], [2]]),
    ([[0, 1, 2, 3, 4]], (4,), [[0]]),
    ([[0, 2, 4], [1, 3, 5]], (1, 2, 4, 5), [[0, 3], [1, 2]]),  # world 1, 5 -> 0, 3; 2, 4 -> 1, 2
])
def test_group_hosts_renumber_the_worlds_hosts(hosts: list, members: tuple, want: list) -> None:
    assert _groups.group_hosts(hosts, members) == want


def test_long_rank_lists_are_shortened_in_messages() -> None:
    assert _groups.ranks_text((0, 2)) == "[0, 2]"
    text = _groups.ranks_text(tuple(range(100)))
    assert "(100 ranks)" in text and text.startswith("[0, 1,") and "99" in text and "50" not in text


@pytest.mark.parametrize("rows", [0, 1, 2, 5, 7, 12, 13])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_rows_of_matches_tensor_split(rows: int, size: int) -> None:
    # torch.tensor_split gives the first rows % size parts one element more, as Horovod does
    parts = torch.tensor_split(torch.arange(rows), size)
    for rank, part in enumerate(parts):
        first, n = rows_of(rows, size, rank)
        assert n == part.numel()
        assert part.tolist() == list(range(first, first + n))


def test_split_counts_equal_blocks() -> None:
    assert split_counts(None, 12, 3, "w") == [4, 4, 4]
    assert split_counts(None, 0, 4, "w") == [0, 0, 0, 0]
    # Not divisible: blocks that miss rows, which the engine fails on every rank (tests/engine).
    assert split_counts(None, 10, 4, "w") == [2, 2, 2, 2]


def test_split_counts_leave_sums_and_signs_to_the_engine() -> None:
    assert split_counts([4, -1, 0], 3, 3, "w") == [4, -1, 0]
    assert split_counts([1, 1, 1], 4, 3, "w") == [1, 1, 1]


def test_split_counts_take_lists_tuples_and_integer_tensors() -> None:
    assert split_counts([3, 0, 2], 5, 3, "w") == [3, 0, 2]
    assert split_counts((1, 1), 2, 2, "w") == [1, 1]
    assert split_counts(torch.tensor([2, 5], dtype=torch.int32), 7, 2, "w") == [2, 5]
    assert split_counts(torch.tensor([0, 4]), 4, 2, "w") == [0, 4]


@pytest.mark.parametrize("splits, rows, error, words", [
    ([1, 2], 3, ValueError, r"splits \[1, 2\] has 2 entries; expected 3"),
    ([1, 1.5, 1], 3, TypeError, "1.5"),
    ([1, True, 1], 3, TypeError, "True"),
    (torch.tensor([1.0, 1.0, 1.0]), 3, TypeError, r"float32\[3\]"),
    (torch.tensor([[1, 1, 1]]), 3, TypeError, r"int64\[1, 3\]"),
    ("111", 3, TypeError, "str"),
])
def test_bad_splits_are_named(splits: object, rows: int, error: type, words: str) -> None:
    with pytest.raises(error, match=words) as info:
        split_counts(splits, rows, 3, "rank 1: torchring.alltoall")
    assert str(info.value).startswith("rank 1: torchring.alltoall")


def test_split_rows_are_views_of_each_ranks_rows() -> None:
    out = torch.arange(12).reshape(6, 2)
    parts = split_rows(out, (2, 2), 3)
    assert [p.tolist() for p in parts] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]]]
    assert all(p.data_ptr() == out[2 * r].data_ptr() for r, p in enumerate(parts))
    scalars = split_rows(torch.tensor([7, 8, 9]), (), 3)
    assert [s.dim() for s in scalars] == [0, 0, 0] and [s.item() for s in scalars] == [7, 8, 9]
    empty = split_rows(torch.empty(0, 3), (0, 3), 2)
    assert [tuple(e.shape) for e in empty] == [(0, 3), (0, 3)]


def test_by_dtype_keeps_first_appearance_order() -> None:
    ts = [torch.zeros(1, dtype=d) for d in
          (torch.float16, torch.int64, torch.float16, torch.float32, torch.int64)]
    assert by_dtype(ts) == [[0, 2], [1, 4], [3]]
    assert by_dtype([]) == []
