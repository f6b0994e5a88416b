"""torchring.elastic.ElasticSampler (hvd.elastic's too) in one process: the world's size and rank
are patched, so each "rank" is a sampler built with that rank, and the ranks' indices are checked
together."""

from __future__ import annotations

import random

import pytest

from torchring._core import context
from torchring.elastic.sampler import ElasticSampler


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch):
    """world(size, rank): makes torchring's size()/rank() answer as that rank of that world."""
    where = {"size": 1, "rank": 0}
    monkeypatch.setattr(context, "size", lambda: where["size"])
    monkeypatch.setattr(context, "rank", lambda: where["rank"])

    def set_to(size: int, rank: int) -> None:
        where.update(size=size, rank=rank)
    return set_to


def _samplers(world, n: int, size: int, state: dict | None = None, **kw) -> list[ElasticSampler]:
    out = []
    for rank in range(size):
        world(size, rank)
        s = ElasticSampler(list(range(n)), **kw)
        if state is not None:
            s.load_state_dict(state)
        out.append(s)
    return out


def test_an_epoch_is_split_without_overlap_and_padded_evenly(world) -> None:
    ranks = [list(s) for s in _samplers(world, 12, 3, seed=5)]
    assert sorted(i for r in ranks for i in r) == list(range(12))
    expected = list(range(12))
    random.Random(5).shuffle(expected)  # epoch 0: one shuffle seeded with seed + epoch
    assert [expected[r::3] for r in range(3)] == ranks

    ranks = [list(s) for s in _samplers(world, 10, 4, shuffle=False)]
    assert [len(r) for r in ranks] == [3, 3, 3, 3]
    assert set(i for r in ranks for i in r) == set(range(10))
    assert ranks[0] == [0, 4, 8] and ranks[3] == [3, 7, 1]  # padded from the front


def test_set_epoch_reshuffles_and_clears_what_was_processed(world) -> None:
    (s,) = _samplers(world, 16, 1, seed=3)
    first = list(s)
    s.record_batch(0, 4)
    s.record_indices([first[5]])
    s.set_epoch(1)
    assert s.processed_num == 0 and not s.processed_indices
    second = list(s)
    assert sorted(second) == list(range(16)) and second != first
    s.set_epoch(0)
    assert list(s) == first  # the same epoch gives the same order


def test_a_restart_on_another_world_resplits_only_the_unprocessed_rest(world) -> None:
    n, batch = 24, 2
    two = _samplers(world, n, 2, seed=1)
    order = [i for pair in zip(*(list(s) for s in two)) for i in pair]  # the epoch's order
    for s in two:  # both ranks train three batches
        for b in range(3):
            s.record_batch(b, batch)
    assert two[0].processed_num == 3 * batch * 2
    saved = two[0].state_dict()

    three = _samplers(world, n, 3, state=saved, seed=1)
    rest = [list(s) for s in three]
    assert all(len(r) == len(three[0]) == 4 for r in rest)
    assert sorted(i for r in rest for i in r) == sorted(order[12:])
    assert not set(order[:12]) & set(i for r in rest for i in r)


def test_recorded_indices_are_left_out_after_a_reset(world) -> None:
    (s,) = _samplers(world, 8, 1, shuffle=False)
    s.record_indices([1, 6])
    s.reset()
    assert list(s) == [0, 2, 3, 4, 5, 7] and len(s) == 6
    state = s.state_dict()
    assert state == {"epoch": 0, "processed_num": 0, "processed_indices": [1, 6]}
    (t,) = _samplers(world, 8, 1, state=state, shuffle=False)
    assert list(t) == [0, 2, 3, 4, 5, 7]


def test_horovods_state_dict_and_a_nearly_done_epoch(world) -> None:
    ranks = _samplers(world, 9, 4, state={"epoch": 2, "processed_num": 8}, shuffle=False)
    assert [list(s) for s in ranks] == [[8]] * 4  # one sample left, repeated to fill 4 ranks
    ranks = _samplers(world, 9, 4, state={"epoch": 0, "processed_num": 9}, shuffle=False)
    assert [list(s) for s in ranks] == [[]] * 4 and len(ranks[0]) == 0
