"""The rank status table and the straggler report, from made-up status files (no ranks run):
which rank is named first and in which phase, dead and unresponsive ranks, the progress bar,
torchring-run's registry of running jobs and its end-of-job report."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys

from pathlib import Path
from typing import Any

from torchring.launch import status as launch_status
from torchring.trace import status, stragglers

NOW = 2_000_000_000_000_000_000


def rank_status(rank: int, *, world: int = 3, waited: dict[int, float] | None = None, data: float = 1.0,
                compute: float = 5.0, comm: float = 1.0, age_s: float = 0.2, state: str = "running",
                pid: int | None = None, host: str | None = None, current: dict[str, Any] | None = None,
                epoch: tuple[int, int, int] = (0, 0, 0)) -> dict[str, Any]:
    """One rank's status as trace/status.py measure() writes it."""
    return {"rank": rank, "world": world, "host": host or socket.gethostname(), "pid": pid or os.getpid(),
            "time_ns": NOW - int(age_s * 1e9), "state": state, "interval_s": 1.0, "steps": 40 + rank,
            "batches": 40, "samples": 640, "data_s": data, "epoch": epoch[0], "epoch_batch": epoch[1],
            "epoch_length": epoch[2], "wall_s": data + compute + comm, "comm_s": comm, "ops": 120,
            "samples_per_s": 32.0, "comm_share": 0.25, "current": current,
            "last": {"what": "allreduce #120 float32[1024] SUM", "group": "world", "seq": 120, "state": "completed",
                     "line": "train.py:30 in step", "ago_s": 0.1},
            "waited_s": {str(p): s for p, s in (waited or {}).items()}, "where": "train.py:28 in step",
            "phases": {"data": data, "compute": compute, "communication": comm}}


def write_all(directory: Path, statuses: list[dict[str, Any]]) -> None:
    for s in statuses:
        status.write(directory, s)


def test_a_rank_slow_at_loading_data_is_first_and_its_phase_is_data_loading() -> None:
    records = [
        {"rank": 0, "host": "a", "waited_s": {2: 6.0, 1: 0.1}, "phases": {"data": 2.0, "compute": 8.0}},
        {"rank": 1, "host": "a", "waited_s": {2: 5.5}, "phases": {"data": 2.1, "compute": 8.1}},
        {"rank": 2, "host": "b", "waited_s": {0: 0.2}, "phases": {"data": 8.2, "compute": 7.9}},
    ]
    lines = stragglers.report(records)
    assert lines[1].startswith("  rank 2 (host b): 11.49"), lines  # 0.1 s rank 1 passed on, 0.2 s rank 2 did
    assert "late in data loading: 8.20 s, the others' median 2.05 s" in lines[1], lines


def test_a_wait_passed_along_a_chain_of_ranks_is_blamed_on_the_late_one() -> None:
    # across hosts: rank 1 waited for rank 2 (late), and rank 0, exchanging with rank 1, for rank 1
    records = [
        {"rank": 0, "host": "a", "waited_s": {1: 2.5}, "phases": {"data": 1.3, "compute": 2.1}},
        {"rank": 1, "host": "b", "waited_s": {2: 2.4, 0: 0.02}, "phases": {"data": 1.3, "compute": 2.1}},
        {"rank": 2, "host": "c", "waited_s": {}, "phases": {"data": 3.7, "compute": 2.1}},
        {"rank": 3, "host": "d", "waited_s": {}, "phases": {"data": 1.3, "compute": 2.1}},
    ]
    blamed = stragglers.blame(records)
    assert abs(sum(blamed[2].values()) - 4.8) < 1e-9 and abs(sum(blamed[1].values()) - 0.08) < 1e-9, blamed
    assert abs(blamed[2][0] - 2.4) < 1e-9 and abs(blamed[2][1] - 2.4) < 1e-9, blamed
    lines = stragglers.report(records)
    assert lines[1].startswith("  rank 2 (host c): 4.") and "late in data loading" in lines[1], lines
    # two ranks waiting on each other pass on no more than each waited: the passing ends
    both = [{"rank": 0, "host": "a", "waited_s": {1: 1.0}}, {"rank": 1, "host": "a", "waited_s": {0: 1.0}}]
    assert sum(sum(by.values()) for by in stragglers.blame(both).values()) <= 2.0


def test_a_rank_slow_in_compute_is_named_in_compute() -> None:
    records = [
        {"rank": 0, "host": "a", "waited_s": {1: 3.0}, "phases": {"data": 1.0, "compute": 5.0}},
        {"rank": 1, "host": "a", "waited_s": {}, "phases": {"data": 1.0, "compute": 8.0}},
        {"rank": 2, "host": "a", "waited_s": {1: 3.1}, "phases": {"data": 1.1, "compute": 5.1}},
    ]
    lines = stragglers.report(records)
    assert lines[1].startswith("  rank 1 (host a): 6.100 s") and "late in compute" in lines[1], lines


def test_a_rank_behind_a_slow_link_is_named_with_no_phase_of_its_own() -> None:
    records = [
        {"rank": 0, "host": "a", "waited_s": {2: 4.0}, "phases": {"data": 1.0, "compute": 5.0}},
        {"rank": 1, "host": "a", "waited_s": {2: 4.0}, "phases": {"data": 1.0, "compute": 5.0}},
        {"rank": 2, "host": "b", "waited_s": {}, "phases": {"data": 1.0, "compute": 5.0}},
    ]
    lines = stragglers.report(records)
    assert lines[1].startswith("  rank 2 (host b)") and "its link or host" in lines[1], lines


def test_a_ring_behind_a_slow_link_is_a_cycle_of_waits_that_own_link_time_breaks() -> None:
    # Host c's link is slow and the ring runs 2 -> 0 -> 1 -> 2: every leader waits the whole job
    # for its left neighbour, so the waits alone form a cycle that names no one for sure.
    cycle = [
        {"rank": 0, "host": "a", "waited_s": {2: 2.88}, "phases": {"data": 0.1, "compute": 0.1}},
        {"rank": 1, "host": "b", "waited_s": {0: 2.88}, "phases": {"data": 0.1, "compute": 0.1}},
        {"rank": 2, "host": "c", "waited_s": {1: 2.88}, "phases": {"data": 0.1, "compute": 0.1}},
    ]
    totals = sorted((sum(by.values()) for by in stragglers.blame(cycle).values()), reverse=True)
    assert totals[0] - totals[1] < 0.01, totals  # the first two tie: which comes first is an accident
    # Rank 2's bytes were held back by its own link during half of its waits: that half is no
    # peer's, and the report names rank 2, its host, and the evidence.
    cycle[2]["waited_s"] = {1: 1.45}
    cycle[2]["own_link_s"] = 1.43
    lines = stragglers.report(cycle)
    assert lines[1].startswith("  rank 2 (host c): 4."), lines
    assert ("its communication is slow (its own link held back bytes it had sent for 1.43 s), look at its "
            "link or host") in lines[1], lines


def test_without_phases_or_waits_the_report_says_what_it_knows() -> None:
    assert stragglers.report([{"rank": 0, "host": "a", "waited_s": {}}]) == ["no rank made another wait"]
    lines = stragglers.report([{"rank": 0, "host": "a", "waited_s": {1: 2.0}}, {"rank": 1, "host": "a", "waited_s": {}}])
    assert lines[1] == "  rank 1 (host a): 2.000 s (rank 0 2.000 s)", lines


def test_the_table_has_a_line_per_rank_and_names_the_dead_and_the_unresponsive(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    current = {"what": "allreduce #121 float32[1024] SUM", "group": "world", "seq": 121, "state": "started",
               "line": "train.py:30 in step", "age_s": 12.5}
    write_all(tmp_path, [rank_status(0, current=current, epoch=(2, 30, 100)),
                         rank_status(1, pid=gone.pid, epoch=(2, 31, 100)),
                         rank_status(2, age_s=9.0, epoch=(2, 29, 100))])
    lines = status.lines(tmp_path, 4, now_ns=NOW)
    assert lines[0].endswith(f"3 of 4 ranks report ({tmp_path})"), lines
    assert lines[1].startswith("  rank 0 (") and "step 40 · 32.0 samples/s · comm 25% / compute 75% · 120 ops" in lines[1]
    assert "in allreduce #121 float32[1024] SUM on world for 12.5 s from train.py:30 in step" in lines[1], lines
    assert f"DEAD (process {gone.pid} is gone)" in lines[2], lines
    assert "UNRESPONSIVE (no status for 9.0 s)" in lines[3], lines
    assert "last allreduce #120" in lines[3] and "now at" not in lines[3], lines
    assert lines[4].startswith("  ranks 3: no status yet"), lines
    assert lines[5] == "  epoch 2 [#########.....................] 29% (29/100 batches, rank 2 furthest behind)", lines
    assert all("\r" not in line and "\x1b" not in line for line in lines)


def test_an_idle_rank_says_where_its_main_thread_is(tmp_path: Path) -> None:
    write_all(tmp_path, [rank_status(0, world=1)])
    line = status.lines(tmp_path, now_ns=NOW)[1]
    assert "last allreduce #120 float32[1024] SUM on world 0.1 s ago · now at train.py:28 in step" in line


def test_the_launcher_finds_its_running_jobs_and_forgets_dead_ones(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(launch_status, "jobs_dir", lambda: tmp_path / "jobs")
    trace_dir = tmp_path / "trace"
    write_all(trace_dir, [rank_status(0, world=2, age_s=0.0)])
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / f"{os.getpid()}.json").write_text(json.dumps(
        {"pid": os.getpid(), "trace_dir": str(trace_dir), "world": 2, "command": ["train.py"]}))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / "jobs" / f"{gone.pid}.json").write_text(json.dumps({"pid": gone.pid, "trace_dir": "x", "world": 1}))
    out = io.StringIO()
    assert launch_status.query(None, out) == 0
    text = out.getvalue().splitlines()
    assert text[0] == f"torchring-run {os.getpid()}: train.py" and "1 of 2 ranks report" in text[1], text
    assert not (tmp_path / "jobs" / f"{gone.pid}.json").exists()
    assert launch_status.query(gone.pid, io.StringIO()) == 1


def test_the_end_report_speaks_only_of_a_notable_straggler(tmp_path: Path) -> None:
    quiet = tmp_path / "quiet"
    write_all(quiet, [rank_status(0, waited={1: 0.2}), rank_status(1, waited={0: 0.1}), rank_status(2)])
    assert launch_status.end_report(str(quiet)) == ""
    assert "rank 1" in launch_status.end_report(str(quiet), force=True)
    slow = tmp_path / "slow"
    write_all(slow, [rank_status(0, waited={2: 3.0}), rank_status(1, waited={2: 3.0}),
                     rank_status(2, data=4.5)])
    report = launch_status.end_report(str(slow)).splitlines()
    assert report[1].startswith("torchring-run:   rank 2 (") and "late in data loading: 4.50 s" in report[1], report
    link = tmp_path / "link"  # rank 2's link held back its bytes: the launcher's report says so too
    behind = rank_status(2)
    behind["own_link_s"] = 2.5
    write_all(link, [rank_status(0, waited={2: 3.0}), rank_status(1, waited={2: 3.0}), behind])
    report = launch_status.end_report(str(link)).splitlines()
    assert report[1].startswith("torchring-run:   rank 2 (") and "own link held back bytes it had sent for 2.50 s" in report[1], report


def test_a_status_file_is_replaced_whole(tmp_path: Path) -> None:
    first = rank_status(0)
    status.write(tmp_path, first)
    status.write(tmp_path, dict(first, steps=99))
    assert status.read(tmp_path)[0]["steps"] == 99
    assert [p.name for p in tmp_path.iterdir()] == ["status_rank_0.json"]
    (tmp_path / "status_rank_1.json").write_text("{not json")
    assert list(status.read(tmp_path)) == [0]



def test_after_an_elastic_re_form_the_table_shows_the_newest_world(tmp_path: Path) -> None:
    # World 4 shrank to 3: the process that was rank 3 is rank 1 now (pid 500), rank 1's old
    # process is gone; an earlier world's file is left for rank 3 and for pid 500 as rank 3.
    write_all(tmp_path, [rank_status(0, world=3, pid=400, age_s=0.3), rank_status(1, world=3, pid=500, age_s=0.2),
                         rank_status(2, world=3, pid=600, age_s=0.4),
                         rank_status(3, world=4, pid=500, age_s=5.0)])
    kept = status.read(tmp_path)
    assert sorted(kept) == [0, 1, 2] and kept[1]["pid"] == 500, kept
    lines = status.lines(tmp_path, now_ns=NOW)
    assert lines[0].endswith(f"3 of 3 ranks report ({tmp_path})") and len(lines) == 4, lines
    # A world that never changed keeps a rank whose file is old: it is the one to look at.
    assert sorted(status.current_world({0: rank_status(0), 1: rank_status(1, age_s=60.0)})) == [0, 1]
