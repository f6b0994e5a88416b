"""torchring-run's output prefixer (torchring.launch.output.prefix_chunk) as a pure function: a
prefix before each line and each carriage-return redraw, never before nothing, whatever way
the bytes are cut into chunks; and the threads each rank gets (torchring.launch.threads)."""

from __future__ import annotations

import pytest

from torchring._core import env as _env
from torchring.launch import output as _output, threads as _threads

P = b"[0]: "


def _whole(chunks: list[bytes], at_start: bool = True) -> bytes:
    """The prefixed text of `chunks` fed one after the other, carrying the state."""
    out = b""
    for chunk in chunks:
        text, at_start = _output.prefix_chunk(chunk, P, at_start)
        out += text
    return out


def test_each_line_gets_the_prefix() -> None:
    assert _whole([b"one\ntwo\n"]) == b"[0]: one\n[0]: two\n"


def test_each_redraw_gets_the_prefix_after_its_carriage_return() -> None:
    bar = b"\r 10%|#  |\r 20%|## |\r 30%|###|\n"
    assert _whole([bar]) == b"\r[0]:  10%|#  |\r[0]:  20%|## |\r[0]:  30%|###|\n"


def test_no_prefix_before_nothing() -> None:
    # tqdm's first write starts with \r, a cleared bar ends with one, and \r\n ends lines
    assert _whole([b"\r\n\n"]) == b"\r\n\n"
    assert _whole([b"\rdone\r\n"]) == b"\r[0]: done\r\n"
    assert _whole([b""]) == b""


def test_a_line_cut_across_chunks_keeps_one_prefix() -> None:
    text = b"epoch 1: loss 0.5\r 50%|#####\rdone\nnext"
    want = _whole([text])
    for cut in range(len(text) + 1):
        assert _whole([text[:cut], text[cut:]]) == want, f"cut at byte {cut}"
    assert want == b"[0]: epoch 1: loss 0.5\r[0]:  50%|#####\r[0]: done\n[0]: next"


def test_the_state_says_whether_the_next_byte_starts_a_line() -> None:
    assert _output.prefix_chunk(b"abc", P, True) == (b"[0]: abc", False)
    assert _output.prefix_chunk(b"abc", P, False) == (b"abc", False)
    assert _output.prefix_chunk(b"abc\r", P, False) == (b"abc\r", True)


def test_multibyte_text_passes_through_untouched() -> None:
    text = "é 50%|█████\n".encode()
    assert _whole([text[:2], text[2:]]) == P + text


def test_default_label_is_the_global_rank() -> None:
    assert _output.rank_label({"RANK": "3", "LOCAL_RANK": "1"}) == "[3]: "


@pytest.mark.parametrize("ranks,cpus,want", [(2, 2, 1), (2, 16, 8), (3, 16, 5), (4, 2, 1), (1, 7, 7)])
def test_threads_share_the_usable_cpus(ranks: int, cpus: int, want: int) -> None:
    assert _threads.threads_per_rank(ranks, cpus) == want


def test_threads_leave_a_users_value_alone() -> None:
    env = {"OMP_NUM_THREADS": "3"}
    assert _threads.set_rank_threads(env, 2) is None and env == {"OMP_NUM_THREADS": "3"}
    env = {}
    line = _threads.set_rank_threads(env, 2)
    want = str(_threads.threads_per_rank(2, _env.available_cpus()))
    assert env["OMP_NUM_THREADS"] == want and line and f"OMP_NUM_THREADS={want}" in line
