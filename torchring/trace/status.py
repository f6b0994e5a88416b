"""A rank's status, written about once a second, and the table a launcher prints from them.

When ``TORCHRING_STATUS_S`` is above 0 (torchring-run sets 1), the ``torchring-trace`` thread
(recorder.py) writes ``status_rank_<rank>.json`` to the job's trace directory every that many
seconds, and once more at exit. ``measure`` builds it from

- the engine's progress meter (``engine.trace_progress()``, engine/progress_meter.h): operations so
  far, the operation in flight (and the Python line that issued it), the one that finished last,
  the time with an operation in flight, and the seconds this rank waited for each peer;
- the counters of torchring's loops (progress.py): steps, samples, time waiting for data;
- where the main thread is now: its innermost frame outside torchring, torch and Python's library.

The rates (samples/s, the share of time in communication) are over the last interval. A
reader needs nothing but the files: ``lines`` makes the table (one line per rank, a progress
bar, the ranks that stopped answering), and ``records`` hands the straggler report
(stragglers.py) each rank's waits and phases: data loading (the loader's waits), communication
(an operation in flight) and compute (the rest: forward, backward, optimizer).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from . import dump as _dump, progress as _progress

__all__ = ["PREFIX", "alive", "phases", "measure", "write", "read", "current_world", "lines", "records", "Rates"]

PREFIX = "status_rank_"


class Rates:
    """The previous reading, for the rates over the last interval."""

    def __init__(self) -> None:
        self.time_ns = 0
        self.samples = 0
        self.comm_s = 0.0


def _line_of(frame: Any) -> str | None:
    if not frame:
        return None
    file, line, function = frame
    return f"{os.path.basename(file)}:{line} in {function}"


def _where() -> str | None:
    """The main thread's innermost frame of the program's own code, and the call it is in."""
    main = threading.main_thread()
    frames = _dump.thread_stacks(only=main.ident).get(f"{main.name} ({main.ident})", [])
    own = next((f for f in frames if not f["library"]), None)
    if own is None:
        return None
    here = f"{os.path.basename(own['filename'])}:{own['line']} in {own['name']}"
    inner = frames[0]
    return here if inner is own else f"{here} (in {inner['name']})"


def phases(engine: Any) -> dict[str, float]:
    """This rank's seconds so far in data loading, communication (an operation in flight) and
    compute (the rest of its time)."""
    wall_s = (time.time_ns() - _progress.counters.started_ns) * 1e-9
    return _split(_progress.counters.data_ns * 1e-9, engine.trace_progress()["in_flight_s"], wall_s)


def _split(data_s: float, comm_s: float, wall_s: float) -> dict[str, float]:
    return {"data": data_s, "communication": comm_s, "compute": max(0.0, wall_s - data_s - comm_s)}


def measure(engine: Any, rank: int, world: int, host: str, interval_s: float, rates: Rates,
            state: str = "running") -> dict[str, Any]:
    """This rank's status now; `rates` carries the previous reading across calls."""
    now = time.time_ns()
    counts = _progress.counters.as_dict()
    meter = engine.trace_progress()
    wall_s = (now - _progress.counters.started_ns) * 1e-9
    comm_s = meter["in_flight_s"]
    elapsed = (now - rates.time_ns) * 1e-9 if rates.time_ns else 0.0
    status = {
        "rank": rank, "world": world, "host": host, "pid": os.getpid(), "time_ns": now, "state": state,
        "interval_s": interval_s, **counts, "wall_s": wall_s, "comm_s": comm_s, "ops": meter["ops"],
        "samples_per_s": (counts["samples"] - rates.samples) / elapsed if elapsed > 0 else None,
        "comm_share": min(1.0, max(0.0, (comm_s - rates.comm_s) / elapsed)) if elapsed > 0 else None,
        "current": _op(meter["current"], "age_s"), "last": _op(meter["last"], "ago_s"),
        "waited_s": {str(peer): s for peer, s in meter["waited_s"].items()},
        "own_link_s": meter.get("own_link_s", 0.0),
        "where": _where() if state != "exited" else None,
        "phases": _split(counts["data_s"], comm_s, wall_s),
    }
    rates.time_ns, rates.samples, rates.comm_s = now, counts["samples"], comm_s
    return status


def _op(entry: dict[str, Any] | None, age: str) -> dict[str, Any] | None:
    if entry is None:
        return None
    return {"what": entry["what"], "group": entry["group"], "seq": entry["seq"],
            "state": entry["state"], "line": _line_of(entry["line"]), age: entry[age]}


def write(directory: str | os.PathLike[str], status: dict[str, Any]) -> Path:
    """Writes `status` as its rank's file in `directory`, whole or not at all (a reader never sees half)."""
    path = Path(directory) / f"{PREFIX}{status['rank']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(status))
    os.replace(tmp, path)
    return path


def read(directory: str | os.PathLike[str]) -> dict[int, dict[str, Any]]:
    """Every rank's latest status in `directory`, by rank (a damaged file is left out), of the
    newest world where an elastic job re-formed (current_world)."""
    found: dict[int, dict[str, Any]] = {}
    for path in Path(directory).glob(f"{PREFIX}*.json"):
        try:
            status = json.loads(path.read_text())
            found[int(status["rank"])] = status
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return current_world(found)


def current_world(statuses: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """`statuses` less those of an earlier world of an elastic job that re-formed: a rank past
    the newest status's world size, and a process's file under a rank it held before (the
    process has written a newer one under its new rank). A job whose world never changed
    keeps every file (its dead ranks among them)."""
    if len({s.get("world") for s in statuses.values()}) <= 1:
        return statuses
    newest = max(statuses.values(), key=lambda s: s.get("time_ns", 0))
    latest: dict[tuple[Any, Any], int] = {}
    for s in statuses.values():
        key = (s.get("host"), s.get("pid"))
        latest[key] = max(latest.get(key, 0), s.get("time_ns", 0))
    return {r: s for r, s in statuses.items()
            if r < newest.get("world", 0) and s.get("time_ns", 0) == latest[(s.get("host"), s.get("pid"))]}


def alive(pid: int) -> bool:
    """Whether process `pid` of this host still runs (one of another user counts; a zombie,
    killed and not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _condition(s: dict[str, Any], now_ns: int, this_host: str) -> str | None:
    """"dead", "unresponsive ..." or "exited"; None while the rank answers."""
    if s.get("state", "running") != "running":
        return s["state"]  # "exited", "stopped by SIGTERM"
    if s.get("host") == this_host and not alive(int(s["pid"])):
        return f"DEAD (process {s['pid']} is gone)"
    age = (now_ns - s["time_ns"]) * 1e-9
    if age > max(3.0, 3 * float(s.get("interval_s") or 1.0)):
        return f"UNRESPONSIVE (no status for {age:.1f} s)"
    return None


def rank_line(s: dict[str, Any], now_ns: int, this_host: str) -> str:
    """One rank's line of the table."""
    parts = [f"rank {s['rank']} ({s['host']}, pid {s['pid']})"]
    condition = _condition(s, now_ns, this_host)
    if condition:
        parts.append(condition)
    if s.get("steps"):  # counted by wrap, torchring.horovod, torchring.data or trace.step()
        parts.append(f"step {s['steps']}")
    if s.get("samples_per_s") is not None and s.get("samples"):
        parts.append(f"{s['samples_per_s']:.1f} samples/s")
    if s.get("comm_share") is not None:
        parts.append(f"comm {100 * s['comm_share']:.0f}% / compute {100 * (1 - s['comm_share']):.0f}%")
    parts.append(f"{s['ops']} ops")
    current, last = s.get("current"), s.get("last")
    if current:
        parts.append(f"in {current['what']} on {current['group']} for {current['age_s']:.1f} s"
                     + (f" from {current['line']}" if current.get("line") else ""))
    elif last:
        ago = f" {last['ago_s']:.1f} s ago" if s.get("state", "running") == "running" else ""
        parts.append(f"last {last['what']} on {last['group']}{ago}")
    if not current and s.get("where") and condition is None:
        parts.append(f"now at {s['where']}")
    return "  " + " · ".join(parts)


def progress_bar(statuses: dict[int, dict[str, Any]], width: int = 30) -> str | None:
    """The epoch's progress of the rank furthest behind, as a bar of plain characters."""
    known = [s for s in statuses.values() if s.get("epoch_length")]
    if not known:
        return None
    place = [(s["epoch"], s["epoch_batch"]) for s in known]
    slowest = min(known, key=lambda s: (s["epoch"], s["epoch_batch"]))
    done = min(1.0, slowest["epoch_batch"] / slowest["epoch_length"])
    filled = int(round(done * width))
    behind = f", rank {slowest['rank']} furthest behind" if len(set(place)) > 1 else ""
    return (f"  epoch {slowest['epoch']} [{'#' * filled}{'.' * (width - filled)}] {100 * done:.0f}% "
            f"({slowest['epoch_batch']}/{slowest['epoch_length']} batches{behind})")


def lines(directory: str | os.PathLike[str], world: int | None = None, now_ns: int | None = None) -> list[str]:
    """The status table of the ranks writing to `directory`: a header, a line per rank, the
    ranks never heard from, the progress bar."""
    statuses = read(directory)
    now_ns = now_ns or time.time_ns()
    world = world or max((s["world"] for s in statuses.values()), default=0)
    this_host = socket.gethostname()
    out = [f"torchring status at {time.strftime('%H:%M:%S')}: {len(statuses)} of {world} ranks report ({directory})"]
    out.extend(rank_line(statuses[r], now_ns, this_host) for r in sorted(statuses))
    silent = [r for r in range(world) if r not in statuses]
    if silent:
        out.append(f"  ranks {', '.join(map(str, silent))}: no status yet (starting, or on another host: "
                   "run torchring-run --status there)")
    bar = progress_bar(statuses)
    if bar:
        out.append(bar)
    return out


def records(statuses: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """The straggler report's input (stragglers.report) from the ranks' statuses."""
    return [{"rank": s["rank"], "host": s["host"], "phases": s.get("phases"), "own_link_s": s.get("own_link_s", 0.0),
             "waited_s": {int(p): v for p, v in s.get("waited_s", {}).items()}} for s in statuses.values()]

