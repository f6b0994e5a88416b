"""The staging-store rule (csrc/core/stores.h) as a pure function, and the streaming copy, in process.

StoreChooser starts with cached stores, probes streaming stores every few segments (three
segments a probe, judged by the last: the first two warm the two staging buffers the other mode
left cold), switches when a probe beats the running average by 20 %, and backs off its probes
(doubling, up to one in 1024 segments) while the probes lose. Fed timings here, it must follow
a host that moves the ranks' CPUs apart and back, not stay with streaming stores because cached
ones are slow only while their buffers are cold, and never stream a copy too small to time."""

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


def _probe_starts(picks: list[bool]) -> list[int]:
    """Where each run of the other mode (streaming, from cached) begins."""
    return [i for i, streamed in enumerate(picks) if streamed and (i == 0 or not picks[i - 1])]


def test_close_cpus_keep_cached_stores_and_probe_ever_less() -> None:
    picks = _choices([(NEAR, 5000)])
    starts = _probe_starts(picks)
    assert picks[:16] == [False] * 16 and picks[16:19] == [True] * 3 and picks[19] is False, \
        "the first probe: three segments after 16"
    assert all(picks[s:s + 3] == [True] * 3 and not picks[s + 3] for s in starts), "every probe is three segments"
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps == sorted(gaps) and gaps[-1] == 1027, gaps  # doubling, then one in 1024 (+ the probe)
    assert sum(picks) <= 30


def test_far_cpus_switch_to_streaming_at_the_first_probe() -> None:
    picks = _choices([(FAR, 3000)])
    assert picks.index(True) == 16
    assert all(picks[16:19]) and sum(picks[19:]) >= len(picks[19:]) - 30, "streaming stays"


def test_cached_stores_that_are_slow_only_while_cold_win_back() -> None:
    # Close CPUs after a far spell: cached stores take 45 us once warm, but 160 us into a buffer
    # the streaming stores left cold; streaming takes 85 us. A cached probe judged on a cold
    # segment would lose every time and leave the job streaming at twice the time.
    n = 6000
    cached = [FAR[0]] * 1000 + [NEAR[0]] * (n - 1000)
    streaming = [FAR[1]] * 1000 + [NEAR[1]] * (n - 1000)
    cold = [FAR[0]] * 1000 + [160e-6] * (n - 1000)
    picks = ENGINE._store_choices(cached, streaming, SEGMENT, cold)
    assert sum(picks[200:1000]) >= 800 - 30, "streaming while far apart"
    assert sum(picks[1000 + 1100:]) <= 30, "cached again within one probe interval of moving back"


def test_follows_the_host_moving_the_cpus_apart_and_back() -> None:
    picks = _choices([(NEAR, 3000), (FAR, 3000), (NEAR, 3000)])
    near1, far, near2 = picks[1000:3000], picks[3000 + 1100:6000], picks[6000 + 1100:]
    assert sum(near1) <= 6, "cached while close (two probes of three segments at most)"
    assert sum(far) >= len(far) - 6, "streaming within one probe interval of moving apart"
    assert sum(near2) <= 6, "cached again within one probe interval of moving back"


def test_one_slow_probe_does_not_switch_and_noise_does_not_flap() -> None:
    # Cached times that wander by +-10 %, streaming always 1.5x: never a switch.
    cached = [45e-6 * (1 + 0.1 * ((i * 7919) % 21 - 10) / 10) for i in range(4000)]
    picks = ENGINE._store_choices(cached, [67e-6] * 4000, SEGMENT)
    assert sum(picks) <= 30


def test_small_copies_never_stream() -> None:
    assert not any(_choices([(FAR, 500)], nbytes=32 << 10))


def test_choices_need_one_time_per_mode_and_copy() -> None:
    with pytest.raises(ValueError, match="one cached and one streaming time per copy"):
        ENGINE._store_choices([1.0, 2.0], [1.0], SEGMENT)
    with pytest.raises(ValueError, match="one cold cached time"):
        ENGINE._store_choices([1.0, 2.0], [1.0, 2.0], SEGMENT, [1.0])


@pytest.mark.parametrize("nbytes", [0, 1, 15, 16, 63, 64, 65, 1000, 4096 + 17, 1 << 20])
@pytest.mark.parametrize("dst_skip", [0, 1, 8, 15, 48])
def test_stream_copy_is_exact_at_any_alignment_and_length(nbytes: int, dst_skip: int) -> None:
    src_storage = torch.randint(0, 256, (nbytes + 64,), dtype=torch.uint8)
    dst_storage = torch.zeros(nbytes + 64, dtype=torch.uint8)
    src, dst = src_storage[3:3 + nbytes], dst_storage[dst_skip:dst_skip + nbytes]
    ENGINE._stream_copy(dst, src)
    assert torch.equal(dst, src)
    assert not dst_storage[:dst_skip].any() and not dst_storage[dst_skip + nbytes:].any(), "wrote outside dst"
