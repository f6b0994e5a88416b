"""The dumps as a Chrome trace (chrome://tracing, Perfetto): one row per rank and group.

Each operation is a complete event ("ph": "X") from the time it started on that rank to the
time it finished (or to the dump, while it still ran), named as torchring's messages name it;
its args hold the sequence number, state and the Python line that issued it. Ranks are the
trace's processes (sorted by rank), groups its threads, so one rank's row shows its groups
under it, as the Horovod timeline shows its tensors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from . import diagnose as _diagnose


def events(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The Chrome-trace events of every rank's dump in `directory`."""
    ranks, _ = _diagnose.load(directory)
    out: list[dict[str, Any]] = []
    starts = [e["torchring"]["started_ns"] or e["time_created_ns"] for r in ranks.values() for e in r.entries
              if e.get("time_created_ns")]
    origin = min(starts, default=0)
    for r, rank in sorted(ranks.items()):
        out.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r} ({rank.host})"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": r, "args": {"sort_index": r}})
        threads: dict[str, int] = {}
        for e in rank.entries:
            group = e["process_group"][0]
            tid = threads.setdefault(group, len(threads))
            t = e["torchring"]
            begin = t["started_ns"] or e["time_created_ns"]
            if not begin:
                continue
            end = t["finished_ns"] or rank.time_ns
            out.append({"ph": "X", "pid": r, "tid": tid, "name": t["what"], "cat": t["kind"],
                        "ts": (begin - origin) / 1e3, "dur": max(0.0, (end - begin) / 1e3),
                        "args": {"state": "failed" if t["failed"] else e["state"],
                                 "issued at": _diagnose.where(e.get("frames", [])),
                                 "queued us": ((begin - e["time_created_ns"]) / 1e3) if e["time_created_ns"] else None}})
        for group, tid in threads.items():
            out.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": group}})
    return out


def write(directory: str | os.PathLike[str], path: str | os.PathLike[str]) -> Path:
    """Writes the Chrome trace of `directory`'s dumps to `path`."""
    target = Path(path)
    target.write_text(json.dumps({"traceEvents": events(directory), "displayTimeUnit": "ms"}))
    return target
