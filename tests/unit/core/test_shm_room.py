"""The /dev/shm room check (torchring/_core/shm_room.py): a container's 64 MiB /dev/shm for
several ranks gets one note with the sizes and the fix; enough room, one rank, or the arena off
get none."""

from __future__ import annotations

from torchring._core import shm_room


def test_a_containers_default_shm_for_several_ranks_gets_a_note_with_the_fix() -> None:
    note = shm_room.advice(4, 2048, (64.0, 60.0))
    assert note is not None and note.startswith("/dev/shm has 60 MiB free of 64 MiB for 4 ranks on this host")
    assert "TORCHRING_SHM_ARENA_MB=2048 per rank" in note and "docker run --shm-size=2g" in note
    assert "medium: Memory" in note


def test_enough_room_one_rank_or_no_arena_say_nothing() -> None:
    assert shm_room.advice(4, 2048, (8192.0, 8000.0)) is None
    assert shm_room.advice(1, 2048, (64.0, 60.0)) is None
    assert shm_room.advice(4, 0, (64.0, 60.0)) is None
    assert shm_room.advice(4, 2048, None) is None
    assert shm_room.advice(2, 16, (64.0, 40.0)) is None  # small arenas fit


def test_the_room_of_a_real_file_system_is_read() -> None:
    total, free = shm_room.room_mb("/")
    assert total > 0 and 0 <= free <= total
    assert shm_room.room_mb("/no/such/dir") is None
