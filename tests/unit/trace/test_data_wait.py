"""The data phase of loops built on torch's own DataLoader (torchring/trace/data_wait.py): every
batch's wait and samples reach the rank's counters, single- and multi-process loaders alike, the
end of an epoch counts nothing, torchring.data's loader is not counted twice, and
TORCHRING_DATA_WAIT=0 leaves torch's DataLoader untouched."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from torch.utils.data import DataLoader

from _straggler_job import SlowSamples as Slow
from torchring.trace import data_wait, progress


@pytest.fixture
def counters(monkeypatch: pytest.MonkeyPatch) -> Iterator[progress.Counters]:
    """Fresh counters, and torch's DataLoader as it was afterwards."""
    fresh = progress.Counters(started_ns=time.time_ns())
    monkeypatch.setattr(progress, "counters", fresh)
    was = data_wait.installed()
    yield fresh
    if not was:
        data_wait.uninstall()


@pytest.mark.parametrize("workers", [0, 1])
def test_every_batch_of_a_plain_loader_counts_its_wait_and_samples(counters: Any, workers: int) -> None:
    assert data_wait.install()
    loader = DataLoader(Slow(10, 0.02), batch_size=4, num_workers=workers)
    seen = [x for x, _ in loader]
    assert [len(x) for x in seen] == [4, 4, 2]
    assert counters.batches == 3 and counters.samples == 10 and counters.epoch_batch == 3
    # Each batch waited for its samples' sleeps: 10 of 20 ms in all (a worker may have loaded
    # part of the next batch while the loop looked at this one, never all of the first).
    assert counters.data_ns >= (0.08 if workers == 0 else 0.07) * 1e9, counters.data_ns
    assert sum(x.sum().item() for x in seen) == 16 * sum(i % 7 for i in range(10))  # the batches themselves untouched


def test_install_is_idempotent_and_uninstall_puts_torch_back(counters: Any) -> None:
    from torch.utils.data import dataloader

    original = dataloader._BaseDataLoaderIter.__next__
    if data_wait.installed():
        original = original.__wrapped__
    data_wait.uninstall()
    assert dataloader._BaseDataLoaderIter.__next__ is original
    assert data_wait.install() and data_wait.install()
    assert dataloader._BaseDataLoaderIter.__next__.__wrapped__ is original
    list(DataLoader(Slow(3, 0), batch_size=1))
    assert counters.batches == 3  # once each, however often install() ran
    data_wait.uninstall()
    assert dataloader._BaseDataLoaderIter.__next__ is original
    list(DataLoader(Slow(3, 0), batch_size=1))
    assert counters.batches == 3


def test_torchring_data_counts_its_epoch_and_each_batch_once(counters: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import torchring.data

    data_wait.uninstall()
    data = Slow(12, 0)
    loader = torchring.data.DataLoader(data, batch_size=4, num_workers=0,
                                       sampler=torchring.data.DistributedSampler(data, num_replicas=1, rank=0))
    for epoch in (1, 2):
        assert sum(1 for _ in loader) == 3
        assert (counters.epoch, counters.epoch_batch, counters.epoch_length) == (epoch, 3, 3)
    assert counters.batches == 6 and counters.samples == 24 and data_wait.installed()


def test_data_wait_off_leaves_torchs_loader_alone(counters: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import torchring.data

    data_wait.uninstall()
    monkeypatch.setenv("TORCHRING_DATA_WAIT", "0")
    data = Slow(8, 0)
    sampler = torchring.data.DistributedSampler(data, num_replicas=1, rank=0)
    assert sum(1 for _ in torchring.data.DataLoader(data, batch_size=4, num_workers=0, sampler=sampler)) == 2
    assert not data_wait.installed() and counters.batches == 0 and counters.epoch == 1
