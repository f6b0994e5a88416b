"""The staging-store rule (csrc/core/stores.h) as a pure function, and the streaming copy, in process.

StoreChooser starts with cached stores, probes streaming stores every few segments, switches
when a probe beats the running average by 20 %, and backs off its probes (doubling, up to one
in 1024 segments) while the probes lose. Fed timings here, it must follow a host that moves
the ranks' CPUs apart and back, and never stream a copy too small to time."""

from __future__ import annotations

import pytest
import torch

from torchring._core import build as _build

ENGINE = _build.load()
SEGMENT = 1 << 20
NEAR = (45e-6, 85e-6)   # (cached, streaming) seconds per 1 MiB segment, CPUs close (measured)
FAR = (550e-6, 66e-6)   # the same, CPUs far apart (measured: benchmarks/probes/staged_probe.c)


def _choices(phases: list[tuple[tuple[float, float], int]], nbytes: int = SEGMENT) -> list[bool]:
    cached = [times[0] for times, count in phases for _ in range(count)]
    streaming = [times[1] for times, count in phases for _ in range(count)]
    return ENGINE._store_choices(cached, streaming, nbytes)


def test_close_cpus_keep_cached_stores_and_probe_ever_less() -> None:
    picks = _choices([(NEAR, 5000)])
    probes = [i for i, streamed in enumerate(picks) if streamed]
    assert picks[:16] == [False] * 16 and picks[16] is True, "the first probe comes after 16 segments"
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] == 1025, gaps  # doubling, then one in 1024 (+ the probe)
    assert sum(picks) <= 10


def test_far_cpus_switch_to_streaming_at_the_first_probe() -> None:
    picks = _choices([(FAR, 3000)])
    assert picks.index(True) == 16
    assert all(picks[16:17]) and sum(picks[17:]) >= len(picks[17:]) - 10, "streaming stays"


def test_follows_the_host_moving_the_cpus_apart_and_back() -> None:
    picks = _choices([(NEAR, 3000), (FAR, 3000), (NEAR, 3000)])
    near1, far, near2 = picks[1000:3000], picks[3000 + 1100:6000], picks[6000 + 1100:]
    assert sum(near1) <= 3, "cached while close"
    assert sum(far) >= len(far) - 3, "streaming within one probe interval of moving apart"
    assert sum(near2) <= 3, "cached again within one probe interval of moving back"


def test_one_slow_probe_does_not_switch_and_noise_does_not_flap() -> None:
    # Cached times that wander by +-10 %, streaming always 1.5x: never a switch.
    cached = [45e-6 * (1 + 0.1 * ((i * 7919) % 21 - 10) / 10) for i in range(4000)]
    picks = ENGINE._store_choices(cached, [67e-6] * 4000, SEGMENT)
    assert sum(picks) <= 10


def test_small_copies_never_stream() -> None:
    assert not any(_choices([(FAR, 500)], nbytes=32 << 10))


def test_choices_need_one_time_per_mode_and_copy() -> None:
    with pytest.raises(ValueError, match="one cached and one streaming time per copy"):
        ENGINE._store_choices([1.0, 2.0], [1.0], SEGMENT)


@pytest.mark.parametrize("nbytes", [0, 1, 15, 16, 63, 64, 65, 1000, 4096 + 17, 1 << 20])
@pytest.mark.parametrize("dst_skip", [0, 1, 8, 15, 48])
def test_stream_copy_is_exact_at_any_alignment_and_length(nbytes: int, dst_skip: int) -> None:
    src_storage = torch.randint(0, 256, (nbytes + 64,), dtype=torch.uint8)
    dst_storage = torch.zeros(nbytes + 64, dtype=torch.uint8)
    src, dst = src_storage[3:3 + nbytes], dst_storage[dst_skip:dst_skip + nbytes]
    ENGINE._stream_copy(dst, src)
    assert torch.equal(dst, src)
    assert not dst_storage[:dst_skip].any() and not dst_storage[dst_skip + nbytes:].any(), "wrote outside dst"
