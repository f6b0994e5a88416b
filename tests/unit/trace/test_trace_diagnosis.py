"""The flight-recorder dumps and their diagnosis, from made-up engine snapshots (no ranks run):
torch's format and field values, the diagnosis of each kind of stop, the Chrome trace, and
torch's analyzer reading what torchring writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from torchring._core.settings import Settings
from torchring.trace import chrome, diagnose, dump

T0 = 1_000_000_000


def op(seq: int, kind: str = "allreduce", state: str = "completed", shape: tuple[int, ...] = (4,),
       frame: int = 1, p2p: bool = False, peer: int = -1) -> dict[str, Any]:
    """One entry as engine.trace_snapshot() gives it."""
    describe = f"float32[{', '.join(map(str, shape))}]" + (" SUM" if kind == "allreduce" else "")
    begin = T0 + seq * 1000
    return {"id": seq, "seq": seq, "kind": kind, "p2p": p2p, "peer": peer, "tag": 0, "dtype": "float32",
            "shape": list(shape), "count": 1 if not shape else __import__("math").prod(shape),
            "what": f"{kind} #{seq} {describe}", "describe": describe, "op": 0, "root": -1, "state": state,
            "enqueued_ns": begin, "started_ns": begin + 10 if state != "scheduled" else 0,
            "finished_ns": begin + 500 if state in ("completed", "failed") else 0, "frame": frame}


def write_rank(directory: Path, rank: int, world: int, ops: list[dict[str, Any]], stack: list[dict[str, Any]],
               failure: str = "") -> None:
    """Rank `rank`'s dump of a world group holding `ops`; its main thread at `stack`."""
    group = {"name": "world", "desc": "torchring world", "ranks": list(range(world)), "capacity": 2000,
             "failure": failure, "entries": ops}
    frames = {1: ("/job/train.py", 30, "step"), 2: ("/job/train.py", 35, "step")}
    built = dump.build(([group], frames, T0 + 10**6), rank=rank, world=world, host=f"h{rank}", reason="failure",
                       timeout_s=4.0)
    built["torchring"]["stacks"] = {"MainThread (1)": stack}
    built["torchring"]["main_thread"] = "MainThread (1)"
    dump.write(built, directory, rank)


OWN = [{"filename": "/job/train.py", "line": 41, "name": "step", "library": False}]
WAITING = [{"filename": "/site/torchring/collectives/basic.py", "line": 99, "name": "wait", "library": True},
           {"filename": "/job/train.py", "line": 35, "name": "step", "library": False}]


def test_the_dump_has_torchs_fields_and_values() -> None:
    group = {"name": "group1", "desc": "torchring.new_group", "ranks": [2, 5], "capacity": 8, "failure": "",
             "entries": [op(0, "allgather", shape=(3, 2)), op(1, "allreduce", "failed"),
                         op(0, "send", "started", p2p=True, peer=0), op(2, "reduce_scatter", "scheduled", (8,))]}
    built = dump.build(([group], {1: ("/a/t.py", 7, "f")}, T0 + 10**6), rank=5, world=6, host="h", reason="request",
                       timeout_s=2.5)
    assert built["version"] == "2.10" and built["comm_lib_version"] == "torchring"
    assert built["pg_config"] == {"group1": {"name": "group1", "desc": "torchring.new_group", "ranks": "[2, 5]"}}
    assert built["pg_status"]["group1"] == {"last_enqueued_collective": 3, "last_started_collective": 2,
                                            "last_completed_collective": 1}
    gather, failed, send, scatter = built["entries"]
    assert (gather["profiling_name"], gather["collective_seq_id"], gather["input_sizes"], gather["output_sizes"]) == \
        ("gloo:all_gather", 1, [[3, 2]], [[6, 2]])
    assert (failed["state"], failed["torchring"]["failed"], failed["retired"]) == ("started", True, True)
    assert (send["profiling_name"], send["is_p2p"], send["p2p_seq_id"], send["collective_seq_id"]) == \
        ("gloo:send 1->0", True, 1, 0)
    assert scatter["output_sizes"] == [[4]] and scatter["state"] == "scheduled"
    assert gather["frames"] == [{"filename": "/a/t.py", "line": 7, "name": "f"}] and gather["timeout_ms"] == 2500
    assert gather["input_dtypes"] == ["Float"] and gather["process_group"] == ("group1", "torchring.new_group")
    assert gather["time_created_ns"] < gather["time_discovered_started_ns"] < gather["time_discovered_completed_ns"]


def test_a_rank_that_never_reached_the_operation_is_named_where_it_is(tmp_path: Path) -> None:
    for r in (0, 2):
        write_rank(tmp_path, r, 3, [op(0), op(1, "broadcast", "failed", frame=2)], WAITING, failure="timed out")
    write_rank(tmp_path, 1, 3, [op(0)], OWN)
    lines, findings = diagnose.diagnose(tmp_path)
    assert (findings[0].seq, findings[0].behind, findings[0].odd) == (1, [1], [])
    assert lines[1:] == [
        "world (3 ranks): operation #1 is the first that not every rank finished.",
        "  rank 1 (host h1) never reached it: its last operation was #0 allreduce float32[4] SUM at train.py:30 "
        "in step (completed); it is now in its own code at train.py:41 in step, not in a collective.",
        "  ranks 0, 2 reached #1 broadcast float32[4] at train.py:35 in step and waited for 0.0 s.",
        "  first failure seen in world (rank 0): timed out"]


def test_differing_operations_name_the_smaller_camp(tmp_path: Path) -> None:
    for r in (0, 1, 3):
        write_rank(tmp_path, r, 4, [op(0), op(1, "broadcast", "failed", frame=2)], WAITING)
    write_rank(tmp_path, 2, 4, [op(0), op(1, "allreduce", "failed", shape=(3,))], WAITING)
    lines, findings = diagnose.diagnose(tmp_path)
    assert findings[0].odd == [2] and findings[0].behind == []
    assert ("  they differ: ranks 0, 1, 3 issued broadcast float32[4] at train.py:35 in step; rank 2 issued "
            "allreduce float32[3] SUM at train.py:30 in step.") in lines
    assert any(line.startswith("  rank 2 issued something the others did not there") for line in lines)


def test_equal_camps_are_not_blamed_and_a_missing_rank_is_named(tmp_path: Path) -> None:
    write_rank(tmp_path, 0, 3, [op(0), op(1, "broadcast", "failed")], WAITING)
    write_rank(tmp_path, 1, 3, [op(0), op(1, "allreduce", "failed")], WAITING)
    lines, findings = diagnose.diagnose(tmp_path)
    assert findings[0].odd == []
    assert "  rank 2 wrote no dump: dead, or unresponsive to SIGUSR1 (look at that host and process first)." in lines
    assert any(line.startswith("  no camp is smaller than the others") for line in lines)


def test_a_healthy_job_says_so(tmp_path: Path) -> None:
    for r in range(2):
        write_rank(tmp_path, r, 2, [op(0), op(1)], OWN)
    lines, findings = diagnose.diagnose(tmp_path)
    assert [f.seq for f in findings] == [None]
    assert lines[-1] == "  every group's operations finished on every rank that wrote a dump."


def test_an_empty_directory_says_what_it_looked_for(tmp_path: Path) -> None:
    lines, _ = diagnose.diagnose(tmp_path)
    assert lines == [f"no torchring flight-recorder dumps (torchring_trace_rank_<rank>) in {tmp_path}"]


def test_the_chrome_trace_has_a_row_per_rank(tmp_path: Path) -> None:
    for r in range(2):
        write_rank(tmp_path, r, 2, [op(0), op(1, "broadcast", "started", frame=2)], OWN)
    out = chrome.write(tmp_path, tmp_path / "trace.json")
    events = json.loads(out.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0 (h0)", 1: "rank 1 (h1)"}
    ops = [e for e in events if e["ph"] == "X" and e["pid"] == 1]
    assert [(e["name"], e["args"]["state"], e["args"]["issued at"]) for e in ops] == [
        ("allreduce #0 float32[4] SUM", "completed", "train.py:30 in step"),
        ("broadcast #1 float32[4]", "started", "train.py:35 in step")]
    assert ops[0]["dur"] == pytest.approx(0.49) and ops[1]["dur"] > 0


def test_torchs_analyzer_reads_the_dumps_and_names_the_culprit(tmp_path: Path) -> None:
    for r in (0, 1):
        write_rank(tmp_path, r, 3, [op(0), op(1, "broadcast", "failed", frame=2)], WAITING)
    write_rank(tmp_path, 2, 3, [op(0), op(1, "allreduce", "failed", shape=(3,))], WAITING)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert "Culprit rank 2; Error type: COLLECTIVE_TYPE_MISMATCH" in proc.stdout + proc.stderr, proc.stderr


def test_the_settings_name_the_recorders_size_and_directory(tmp_path: Path) -> None:
    s = Settings.from_env({"TORCHRING_TRACE": "0", "TORCHRING_TRACE_DIR": str(tmp_path)})
    assert (s.trace, s.trace_directory("j")) == (0, tmp_path)
    default = Settings.from_env({})
    assert default.trace == 512 and default.trace_frames and default.trace_directory("run/7").parts[-2:] == ("torchring-trace", "run_7")
    with pytest.raises(ValueError, match=r"TORCHRING_TRACE='-1': expected an integer number of operations"):
        Settings.from_env({"TORCHRING_TRACE": "-1"})


def test_the_command_line_prints_the_diagnosis_and_writes_the_chrome_trace(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from torchring.trace.__main__ import main  # here: the module is the command line

    assert main([str(tmp_path)]) == 1
    assert "no torchring flight-recorder dumps" in capsys.readouterr().out
    for r in range(2):
        write_rank(tmp_path, r, 2, [op(0), op(1, "broadcast", "failed", frame=2)] if r == 0 else [op(0)], OWN)
    assert main([str(tmp_path), "--chrome", str(tmp_path / "t.json")]) == 0
    out = capsys.readouterr().out
    assert "world (2 ranks): operation #1 is the first that not every rank finished." in out
    assert f"Chrome trace: {tmp_path / 't.json'}" in out and json.loads((tmp_path / "t.json").read_text())
