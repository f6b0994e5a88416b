"""Shared memory's placement and spin rules (csrc/transport/shm/group.cpp) as pure functions, in process.

Staging shifts: where each local rank stages a staged allreduce in its staging buffers, given
every rank's tensor offset in its page. A store and a load whose addresses agree in their low
12 bits alias (the CPU takes the load for one of the stored address), so every shift must be
far from every tensor offset and from the other shifts; every rank computes the same shifts.

Spin: a waiting rank spins long only when spinning cannot take the CPU the awaited rank needs:
the ranks' CPU sets are pairwise disjoint (mpirun --bind-to core), or together they hold at
least one CPU per rank."""

from __future__ import annotations

import itertools

import pytest

from torchring._core import build as _build

ENGINE = _build.load()
PAGE = 4096


def _gap(a: int, b: int) -> int:
    d = abs(a - b) % PAGE
    return min(d, PAGE - d)


@pytest.mark.parametrize("offsets", [[64, 64], [0, 2048], [256, 2432], [64, 64, 64], [0, 1024, 2048, 3072],
                                     [4032, 64, 128, 192, 256, 320, 384, 448]])
def test_staging_shifts_keep_every_stream_apart(offsets: list[int]) -> None:
    shifts = ENGINE._staging_shifts(offsets)
    assert len(shifts) == len(offsets)
    assert all(s % 64 == 0 and 0 <= s < PAGE for s in shifts)
    points = len(set(offsets)) + len(shifts)
    # The best any placement can do on a circle of 4096 bytes in steps of 64 with this many
    # points is PAGE / points; the greedy rule must keep at least half of that.
    floor = PAGE // points // 2 // 64 * 64
    for s in shifts:
        assert min(_gap(s, t) for t in offsets) >= floor, (offsets, shifts)
    for a, b in itertools.combinations(shifts, 2):
        assert _gap(a, b) >= floor, (offsets, shifts)
    assert ENGINE._staging_shifts(offsets) == shifts  # the same on every rank


def test_two_ranks_at_torchs_usual_offset_stage_half_a_page_away() -> None:
    # torch puts large tensors at offset 64 of a page on every rank.
    shifts = ENGINE._staging_shifts([64, 64])
    assert min(_gap(s, 64) for s in shifts) >= 1024
    assert _gap(shifts[0], shifts[1]) >= 1024


@pytest.mark.parametrize("cpu_sets,spin", [
    ([[0, 1], [0, 1]], True),          # unbound, a CPU per rank
    ([[0], [1]], True),                # mpirun --bind-to core: disjoint
    ([[0], [1], [2]], True),
    ([[0], [0]], False),               # both on one core: spinning starves the other
    ([[0, 1], [0, 1], [0, 1]], False),  # three ranks on two CPUs
    ([[0], [0, 1]], True),             # the scheduler can put the second rank on CPU 1
    ([[64], [65]], True),              # CPUs past the first mask word
    ([[1000], [1000]], False),
])
def test_spin_only_when_the_cpu_sets_leave_a_cpu_per_rank(cpu_sets: list[list[int]], spin: bool) -> None:
    assert ENGINE._cpu_sets_suffice(cpu_sets) is spin


def test_a_cpu_outside_the_mask_is_refused() -> None:
    with pytest.raises(ValueError, match="CPU 1024 is outside 0-1023"):
        ENGINE._cpu_sets_suffice([[1024]])
