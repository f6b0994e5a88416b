"""The relay of a -H job's files (torchring/launch/relay.py): a node sends its ranks' status
files and dumps as lines on its output, the launcher cuts them out of the output stream and
writes the files; a rank's text around them is kept; names a rank does not write are refused."""

from __future__ import annotations

import io
import os
from pathlib import Path

from torchring.launch import relay


def test_a_relay_line_in_a_ranks_unfinished_line_is_cut_out_and_its_file_written(tmp_path: Path) -> None:
    receiver = relay.Receiver(str(tmp_path / "launcher"))
    line = relay.line_of("status_rank_3.json", b'{"rank": 3}')
    shown = receiver.take(b"[trh1:3]: epoch 1 " + line + b"done\n" + line + b"next\n")
    assert shown == b"[trh1:3]: epoch 1 done\nnext\n"
    assert (tmp_path / "launcher" / "status_rank_3.json").read_bytes() == b'{"rank": 3}'
    assert receiver.received == ["status_rank_3.json", "status_rank_3.json"]
    assert receiver.take(b"plain\n") == b"plain\n"


def test_names_a_rank_does_not_write_and_bad_content_are_refused(tmp_path: Path) -> None:
    receiver = relay.Receiver(str(tmp_path / "in"))
    for name in ("../evil", "status_rank_1.json/../../x", "notes.txt", "torchring_trace_rank_x"):
        assert receiver.take(relay.line_of(name, b"x")) == b""
    assert receiver.take(relay.MARK + b"torchring_trace_rank_2 !!notbase64\n") == b""
    assert receiver.received == [] and not (tmp_path / "evil").exists()
    assert not (tmp_path / "in").exists() or list((tmp_path / "in").iterdir()) == []


class _Pipe(io.BytesIO):
    """An output with a real file descriptor behind its fileno(), as a node's stdout has."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self._file = open(path, "wb", buffering=0)

    def fileno(self) -> int:
        return self._file.fileno()

    def write(self, data: bytes) -> int:  # type: ignore[override]
        return self._file.write(data)


def test_the_sender_sends_changed_statuses_then_everything_at_the_end(tmp_path: Path) -> None:
    ranks, out = tmp_path / "ranks", tmp_path / "out"
    ranks.mkdir()
    old = ranks / "status_rank_0.json"
    old.write_text("{}")
    os.utime(old, (1, 1))  # from before the node started: another run's
    sender = relay.Sender(str(ranks), 0.0, _Pipe(out))
    (ranks / "status_rank_1.json").write_text('{"steps": 1}')
    sender.send("status_rank_*.json", whole_lines=True)
    sender.send("status_rank_*.json", whole_lines=True)  # unchanged: not again
    (ranks / "torchring_trace_rank_1").write_bytes(bytes(range(256)) * 40)  # over one atomic write
    sender.finish()
    receiver = relay.Receiver(str(tmp_path / "launcher"))
    assert receiver.take(out.read_bytes()) == b""
    assert receiver.received == ["status_rank_1.json", "torchring_trace_rank_1"]
    assert (tmp_path / "launcher" / "torchring_trace_rank_1").read_bytes() == bytes(range(256)) * 40


def test_a_successful_runs_own_trace_directory_goes_unless_it_holds_a_dump(tmp_path: Path, monkeypatch) -> None:
    import tempfile

    from torchring.launch import trace_report

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    plain = trace_report.choose_directory({})
    (Path(plain) / "status_rank_0.json").write_text("{}")
    trace_report.clean_up(plain, chosen_by_user=False)
    assert not Path(plain).exists()
    kept = trace_report.choose_directory({})
    (Path(kept) / "torchring_trace_rank_0").write_bytes(b"x")  # torchring.dump_trace() during the run
    trace_report.clean_up(kept, chosen_by_user=False)
    assert (Path(kept) / "torchring_trace_rank_0").exists()
    mine = tmp_path / "my-traces"
    mine.mkdir()
    (mine / "status_rank_0.json").write_text("{}")
    trace_report.clean_up(str(mine), chosen_by_user=True)
    assert (mine / "status_rank_0.json").exists()
