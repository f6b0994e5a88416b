"""torchring.data: sampler parity with torch, auto-epoch, exact evaluation, iterable sharding,
loader defaults and seeding."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset
from torch.utils.data.distributed import DistributedSampler as TorchSampler

import torchring.data as trd
from _dist import session, spawn


@pytest.mark.parametrize("shuffle,drop_last", list(itertools.product([True, False], [True, False])))
def test_sampler_matches_torch(shuffle: bool, drop_last: bool) -> None:
    for n, world, seed in itertools.product([1, 2, 7, 10, 33], [1, 2, 3, 4], [0, 7]):
        if drop_last and n < world:
            continue
        for rank in range(world):
            ours = trd.DistributedSampler(range(n), world, rank, shuffle, seed, drop_last)
            theirs = TorchSampler(range(n), world, rank, shuffle, seed, drop_last)
            assert len(ours) == len(theirs)
            for epoch in range(3):  # ours advances by itself, torch's needs set_epoch
                theirs.set_epoch(epoch)
                assert list(ours) == list(theirs), (n, world, rank, seed, epoch)


def test_auto_epoch_and_set_epoch() -> None:
    s = trd.DistributedSampler(range(50), 2, 0, seed=3)
    first, second = list(s), list(s)
    assert first != second and s.epoch == 1
    s.set_epoch(0)
    assert list(s) == first and s.epoch == 0   # set_epoch wins over the automatic advance
    theirs = TorchSampler(range(50), 2, 0, seed=3)
    theirs.set_epoch(5)
    s.set_epoch(5)
    s.set_epoch(5)   # repeated set_epoch is idempotent
    assert list(s) == list(theirs)
    fixed = trd.DistributedSampler(range(50), 2, 0, seed=3, auto_epoch=False)
    assert list(fixed) == list(fixed) == first


def test_set_epoch_matches_torch_after_manual_calls() -> None:
    ours = trd.DistributedSampler(range(20), 3, 1, seed=11)
    theirs = TorchSampler(range(20), 3, 1, seed=11)
    for epoch in (4, 9, 2):
        ours.set_epoch(epoch)
        theirs.set_epoch(epoch)
        assert list(ours) == list(theirs)


def test_exact_mode_gives_every_sample_once() -> None:
    for n, world in itertools.product([1, 5, 10, 11], [1, 2, 3, 4]):
        seen = []
        counts = []
        for rank in range(world):
            s = trd.DistributedSampler(range(n), world, rank, shuffle=True, exact=True)
            idx = list(s)
            assert len(idx) == len(s)
            seen += idx
            counts.append(len(idx))
        assert sorted(seen) == list(range(n))
        assert max(counts) - min(counts) <= 1


def test_sampler_errors() -> None:
    with pytest.raises(RuntimeError, match="init"):
        trd.DistributedSampler(range(10))
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        trd.DistributedSampler(range(10), 2, 2)
    with pytest.raises(ValueError, match="0 samples"):
        trd.DistributedSampler(range(3), 4, 0, drop_last=True)
    with pytest.raises(ValueError, match="empty"):
        trd.DistributedSampler([], 1, 0)
    with pytest.raises(ValueError, match="exact"):
        trd.DistributedSampler(range(4), 2, 0, exact=True, drop_last=True)


class _Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize("workers", [0, 2])
def test_iterable_sharding_across_ranks_and_workers(workers: int) -> None:
    n, world = 23, 3
    per_rank = []
    for rank in range(world):
        ds = trd.ShardedIterableDataset(_Stream(n), world, rank, even=True)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
        per_rank.append([int(x) for x in loader])
    flat = sum(per_rank, [])
    assert len(flat) == len(set(flat)), "an item reached two shards"
    assert len({len(p) for p in per_rank}) == 1, "ranks got different counts with even=True"
    assert len(flat) == (n // world) * world
    # What a rank reads does not depend on its number of loader workers.
    alone = [sorted(trd.ShardedIterableDataset(_Stream(n), world, r, even=True)) for r in range(world)]
    assert [sorted(p) for p in per_rank] == alone
    uneven = [list(trd.ShardedIterableDataset(_Stream(n), world, r, even=False)) for r in range(world)]
    assert sorted(sum(uneven, [])) == list(range(n))


class _Noisy(Dataset):
    """Each item draws from torch, random and numpy: shows how workers were seeded."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        import numpy as np
        return torch.tensor([i, torch.randint(0, 2**30, ()).item(), random.randrange(2**30),
                             int(np.random.randint(0, 2**30))])


def _seeded_draws(rank: int) -> list[list[int]]:
    import torchring.data as data

    with session():
        torch.manual_seed(0)  # the same global seed everywhere, as users do for model init
        loader = data.DataLoader(_Noisy(), batch_size=2, shuffle=False, num_workers=2, seed=5)
        assert loader.num_workers == 2 and loader.persistent_workers
        return torch.cat(list(loader)).tolist()


def test_worker_seeds_differ_per_rank_and_repeat_per_run() -> None:
    first = spawn(2, _seeded_draws)
    again = spawn(2, _seeded_draws)
    assert first == again, "seeding is not reproducible run to run"
    draws = [row[1:] for rank in first for row in rank]
    assert len({tuple(d) for d in draws}) == len(draws), "two workers or ranks drew the same numbers"


def _exact_eval(rank: int) -> dict:
    import torchring.data as data

    with session():
        ds = list(range(10))
        sampler = data.DistributedSampler(ds, shuffle=True, exact=True)
        mine = torch.tensor([[3 * i, i % 2] for i in sampler])
        ordered = data.gather_ordered(mine, sampler)
        metrics = data.all_reduce_metrics({"n": len(sampler), "odd": int(mine[:, 1].sum())})
        padded = data.DistributedSampler(ds, shuffle=False)
        with_pad = data.gather_ordered(torch.tensor([[3 * i] for i in padded]), padded)
        return {"ordered": ordered.tolist(), "metrics": metrics, "padded": with_pad.tolist()}


def test_exact_evaluation_gathers_every_sample_once() -> None:
    for result in spawn(3, _exact_eval):
        assert result["ordered"] == [[3 * i, i % 2] for i in range(10)]
        assert result["metrics"] == {"n": 10.0, "odd": 5.0}
        assert result["padded"] == [[3 * i] for i in range(10)]


def _loader_defaults(rank: int) -> dict:
    import torchring.data as data

    with session():
        loader = data.DataLoader(list(range(10)), batch_size=2)
        try:
            data.DataLoader(list(range(5)), batch_size=4, drop_last=True)
            error = ""
        except ValueError as exc:
            error = str(exc)
        batches = [b.tolist() for b in loader]
        return {"workers": loader.num_workers, "expected": data.default_num_workers(),
                "persistent": loader.persistent_workers, "prefetch": loader.prefetch_factor,
                "batches": batches, "error": error,
                "prefetched": [b.tolist() for b in data.DevicePrefetcher(loader)]}


def test_loader_defaults_and_errors() -> None:
    results = spawn(2, _loader_defaults)
    seen, seen_next = [], []
    for rank, r in enumerate(results):
        assert r["workers"] == r["expected"] >= 1 and r["persistent"] and r["prefetch"] == 2
        assert len(r["batches"]) == 3   # 5 samples per rank, batch 2
        seen_next += sum(r["prefetched"], [])
        assert "0 batches" in r["error"] and f"rank {rank}" in r["error"]
        seen += sum(r["batches"], [])
    assert sorted(seen) == list(range(10))
    # The prefetcher's pass is the loader's next epoch: all samples again, in another order.
    assert sorted(seen_next) == list(range(10))
    assert [r["prefetched"] for r in results] != [r["batches"] for r in results]


def test_dataloader_making_two_iterators_does_not_skip_an_epoch() -> None:
    # With batch_size=None and workers, torch's DataLoader calls iter(sampler) twice when an
    # epoch starts; the epoch must still be 0 the first time, as with torch's sampler.
    ds = list(range(20))
    ours = trd.DistributedSampler(ds, 2, 1, seed=4)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, sampler=ours, num_workers=1)
    theirs = TorchSampler(ds, 2, 1, seed=4)
    for epoch in range(2):
        theirs.set_epoch(epoch)
        assert [int(x) for x in loader] == list(theirs), f"epoch {epoch}"
