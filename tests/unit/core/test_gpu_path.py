"""The GPU-path choice, every branch, on CPU: choose_path and choose_device are pure, and
setup() runs here against a fake torch.cuda, a fake engine and a dict store, so the logic
that only a GPU host would otherwise reach runs in every test run."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from torchring._core import gpu_path as _gpu_path
from torchring import cuda
from torchring._core.gpu_path import choose_device, choose_path
from torchring._core.settings import Settings

TWO_GPUS = ["hostA|uuid-0", "hostA|uuid-1"]
SHARED = ["hostA|uuid-0", "hostA|uuid-0"]


@pytest.fixture(autouse=True)
def _restore_path_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """setup() sets module state; put this process's back after each test."""
    for name in ("_path", "_reason", "_comm", "_device", "_timeout"):
        monkeypatch.setattr(_gpu_path, name, getattr(_gpu_path, name))


@pytest.mark.parametrize("wanted", ["off", "auto", "nccl", "staged"])
def test_off_or_no_cuda_device_means_none(wanted: str) -> None:
    path, reason = choose_path(wanted, cuda_available=False, nccl_built=True, gpus=[], device=None)
    assert path == "none"
    assert reason == ("TORCHRING_CUDA_PATH=off" if wanted == "off" else "no CUDA device")


def test_off_wins_over_an_available_device() -> None:
    assert choose_path("off", True, True, TWO_GPUS, 0) == ("none", "TORCHRING_CUDA_PATH=off")


def test_staged_when_asked() -> None:
    assert choose_path("staged", True, True, TWO_GPUS, 1) == ("staged", "TORCHRING_CUDA_PATH=staged")


def test_auto_without_nccl_in_the_engine_is_staged() -> None:
    path, reason = choose_path("auto", True, False, TWO_GPUS, 1)
    assert path == "staged" and "without NCCL" in reason


def test_auto_with_ranks_sharing_a_gpu_is_staged() -> None:
    path, reason = choose_path("auto", True, True, SHARED, 0)
    assert path == "staged" and "share one GPU" in reason


def test_auto_with_one_gpu_per_rank_is_nccl() -> None:
    assert choose_path("auto", True, True, TWO_GPUS, 1) == ("nccl", "one GPU per rank, cuda:1")
    assert choose_path("auto", True, True, ["hostA|uuid-0"], 0)[0] == "nccl"
    # The same device uuid on two hosts is two GPUs.
    assert choose_path("auto", True, True, ["hostA|uuid-0", "hostB|uuid-0"], 0)[0] == "nccl"


def test_nccl_when_asked_and_possible() -> None:
    assert choose_path("nccl", True, True, TWO_GPUS, 0)[0] == "nccl"


@pytest.mark.parametrize("nccl_built,gpus,why", [(False, TWO_GPUS, "without NCCL"),
                                                 (True, SHARED, "share one GPU")])
def test_nccl_when_asked_but_impossible_raises(nccl_built: bool, gpus: list[str], why: str) -> None:
    with pytest.raises(RuntimeError) as caught:
        choose_path("nccl", True, nccl_built, gpus, 0, rank=3)
    message = str(caught.value)
    assert message.startswith("rank 3: TORCHRING_CUDA_PATH=nccl, but ") and why in message


def test_an_unknown_wish_is_refused() -> None:
    with pytest.raises(ValueError, match="TORCHRING_CUDA_PATH='gpu'"):
        choose_path("gpu", True, True, TWO_GPUS, 0)


def test_device_choice() -> None:
    assert choose_device(setting=2, current=1, count=4, local_rank=0) == 2   # TORCHRING_DEVICE wins
    assert choose_device(None, current=3, count=4, local_rank=1) == 3       # set_device() before init
    assert choose_device(None, current=0, count=4, local_rank=1) == 1       # else the local rank
    assert choose_device(None, current=0, count=2, local_rank=5) == 1       # modulo the devices
    with pytest.raises(ValueError) as caught:
        choose_device(setting=4, current=0, count=4, local_rank=0)
    assert str(caught.value).startswith("TORCHRING_DEVICE=4: expected a CUDA device index in [0, 3]")


# ------------------------------------------------------------------ setup() with fakes
class _Store:
    def __init__(self, preset: dict[str, Any]) -> None:
        self.data = dict(preset)

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        return self.data[key]


class _Engine:
    """The engine's NCCL surface: a unique id and a communicator that records its life."""

    def __init__(self) -> None:
        self.made: list[tuple] = []
        self.events: list[str] = []

    def nccl_unique_id(self) -> bytes:
        return b"id-from-this-rank"

    def NcclComm(self, *args: Any) -> Any:  # noqa: N802  (the engine's class name)
        self.made.append(args)
        events = self.events
        return SimpleNamespace(drain=lambda timeout: events.append(f"drain {timeout:g}"),
                               close=lambda: events.append("close"))


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A host with 2 GPUs whose uuids are uuid-0 and uuid-1; returns the set_device calls."""
    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(uuid=f"uuid-{i}"))
    yield calls
    _gpu_path.teardown()


def test_setup_world_2_one_gpu_each_joins_nccl(fake_cuda: list[int],
                                               caplog: pytest.LogCaptureFixture) -> None:
    engine = _Engine()
    store = _Store({"gpu/0": b"hostA|uuid-0", "nccl_id": b"rank-0-id"})
    with caplog.at_level(logging.INFO, logger="torchring"):
        _gpu_path.setup(engine, store, rank=1, world=2, local_rank=1, host="hostA",
                        settings=Settings(timeout=12.0))
    assert fake_cuda == [1]
    assert store.data["gpu/1"] == b"hostA|uuid-1"
    assert (cuda.path(), cuda.reason(), cuda.device()) == ("nccl", "one GPU per rank, cuda:1",
                                                           torch.device("cuda", 1))
    assert engine.made == [(1, 2, 1, b"rank-0-id", 12.0)]  # rank 0's id, not this rank's
    assert not caplog.records, "only rank 0 says which path the job takes"
    _gpu_path.teardown()
    assert engine.events == ["drain 12", "close"] and cuda.path() == "none"


def test_setup_rank_0_publishes_the_id_and_logs_the_choice(fake_cuda: list[int],
                                                           caplog: pytest.LogCaptureFixture) -> None:
    engine = _Engine()
    store = _Store({"gpu/1": b"hostB|uuid-0"})
    with caplog.at_level(logging.INFO, logger="torchring"):
        _gpu_path.setup(engine, store, 0, 2, 0, "hostA", Settings())
    assert store.data["nccl_id"] == b"id-from-this-rank"
    assert engine.made == [(0, 2, 0, b"id-from-this-rank", 300.0)]
    assert [r.getMessage() for r in caplog.records] == [
        "CUDA tensors take the nccl path (one GPU per rank, cuda:0)"]


def test_setup_ranks_sharing_a_gpu_stage_and_make_no_nccl_comm(fake_cuda: list[int]) -> None:
    engine = _Engine()
    store = _Store({"gpu/0": b"hostA|uuid-1"})
    _gpu_path.setup(engine, store, 1, 2, 1, "hostA", Settings())
    assert cuda.path() == "staged" and engine.made == []


def test_setup_device_setting_and_off(fake_cuda: list[int]) -> None:
    engine = _Engine()
    _gpu_path.setup(engine, None, 0, 1, 0, "hostA", Settings(device=1, cuda_path="staged"))
    assert fake_cuda == [1] and cuda.device() == torch.device("cuda", 1) and cuda.path() == "staged"
    _gpu_path.setup(engine, None, 0, 1, 0, "hostA", Settings(cuda_path="off"))
    assert fake_cuda == [1], "TORCHRING_CUDA_PATH=off touches no CUDA device"
    assert (cuda.path(), cuda.device()) == ("none", None)


def test_a_cuda_tensor_is_refused_without_a_cuda_path() -> None:
    _gpu_path.setup(_Engine(), None, 0, 1, 0, "h", Settings(cuda_path="off"))
    with pytest.raises(ValueError, match=r"no CUDA path \(TORCHRING_CUDA_PATH=off\)"):
        _gpu_path.check(SimpleNamespace(device="cuda:0"), "rank 0: torchring.allreduce")
