"""A rank's flight-recorder dump: the engine's snapshot in the format of torch's Flight Recorder.

torch's analyzer (``python -m torch.distributed.flight_recorder.fr_trace DIR``) reads one pickle
per rank, named ``<prefix><rank>``, holding ``version``, ``pg_config`` (each group's name,
description and world ranks), ``pg_status`` and ``entries``: one dict per operation with its
group, ``collective_seq_id`` (or ``p2p_seq_id``), ``profiling_name``, sizes, dtypes, ``state`` and
times. torchring writes exactly those fields, numbering sequence ids from 1 as torch does. The
analyzer accepts only the communication libraries it knows in ``profiling_name``, so the name
says "gloo:all_reduce" (the CPU library torchring stands in for) and ``comm_lib_version`` says
"torchring". Then torchring adds what its own diagnosis reads: each entry's ``torchring``
dict (the operation as torchring's messages word it, whether it failed) and the dump's
``torchring`` dict (rank, host, pid, why it was written, every thread's Python stack, each
group's first failure). An operation that failed is left ``started`` in torch's terms (it never
completed); torchring's own field says it failed.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

FORMAT_VERSION = "2.10"  # the Flight Recorder format these dumps follow (torch 2.13 reads it)
PREFIX = "torchring_trace_rank_"

# torchring's operation names -> torch's profiling names (types.py COLLECTIVES and P2P there).
_TORCH_NAMES = {
    "allreduce": "all_reduce", "broadcast": "broadcast", "allgather": "all_gather",
    "reduce_scatter": "reduce_scatter", "barrier": "barrier", "reduce": "reduce", "gather": "gather",
    "scatter": "scatter", "alltoall": "all_to_all", "allreduce_many": "allreduce_coalesced",
    "send": "send", "recv": "recv",
}
# torchring's dtype names -> c10's ScalarType names, as torch's dumps spell them.
_SCALAR_NAMES = {
    "float32": "Float", "float64": "Double", "float16": "Half", "bfloat16": "BFloat16", "int8": "Char",
    "uint8": "Byte", "int32": "Int", "int64": "Long", "bool": "Bool", "int16": "Short",
}


def path_of(directory: str | os.PathLike[str], rank: int) -> Path:
    """Where rank `rank` writes its dump in `directory`."""
    return Path(directory) / f"{PREFIX}{rank}"


_LIBRARIES = tuple(str(Path(p).resolve()) + os.sep for p in (
    Path(__file__).parents[1], Path(threading.__file__).parent))


def thread_stacks(only: int | None = None) -> dict[str, list[dict[str, Any]]]:
    """Every thread's Python stack (`only`: that thread's), innermost frame first: {"MainThread
    (ident)": [frames]}; a frame in torchring, torch or Python's own library (or a frozen module)
    says so ("library": True)."""
    libraries = _LIBRARIES + ((str(Path(sys.modules["torch"].__file__).parent) + os.sep,)
                              if "torch" in sys.modules else ())
    names = {t.ident: t.name for t in threading.enumerate()}
    stacks = {}
    for ident, frame in sys._current_frames().items():
        if only is not None and ident != only:
            continue
        frames = [{"filename": f.filename, "line": f.lineno or 0, "name": f.name,
                   "library": f.filename.startswith(libraries) or f.filename.startswith("<")}
                  for f in reversed(traceback.extract_stack(frame))]
        stacks[f"{names.get(ident, 'thread')} ({ident})"] = frames
    return stacks


def build(snapshot: tuple[list[dict[str, Any]], dict[int, tuple[str, int, str]], int], *, rank: int,
          world: int, host: str, reason: str, timeout_s: float) -> dict[str, Any]:
    """The dump of this rank from the engine's `snapshot` (engine.trace_snapshot())."""
    groups, frames, steady_now = snapshot
    wall_now = time.time_ns()

    def wall(ns: int) -> int | None:
        return wall_now - (steady_now - ns) if ns else None

    pg_config, pg_status, entries = {}, {}, []
    for pg_id, group in enumerate(groups):
        members = list(group["ranks"])
        me = members.index(rank) if rank in members else -1
        name = group["name"] or f"unnamed-{pg_id}"
        pg_config[name] = {"name": name, "desc": group["desc"], "ranks": str(list(group["ranks"]))}
        status = {"last_enqueued_collective": -1, "last_started_collective": -1, "last_completed_collective": -1}
        for e in group["entries"]:
            seq = e["seq"] + 1
            if not e["p2p"]:
                status["last_enqueued_collective"] = seq
                if e["state"] != "scheduled":
                    status["last_started_collective"] = seq
                if e["state"] == "completed":
                    status["last_completed_collective"] = seq
            entries.append(_entry(e, len(entries), pg_id, (name, group["desc"]), (me, len(members)), frames, wall,
                                  timeout_s))
        pg_status[name] = status
    return {
        "version": FORMAT_VERSION,
        "comm_lib_version": "torchring",
        "pg_config": pg_config,
        "pg_status": pg_status,
        "entries": entries,
        "torchring": {
            "rank": rank, "world": world, "host": host, "pid": os.getpid(), "reason": reason,
            "time_ns": wall_now, "stacks": thread_stacks(),
            "main_thread": f"{threading.main_thread().name} ({threading.main_thread().ident})",
            "groups": [{"name": g["name"], "desc": g["desc"], "ranks": list(g["ranks"]),
                        "failure": g["failure"], "capacity": g["capacity"], "waited": list(g.get("waited", [])),
                        "own_link_s": g.get("own_link_s", 0.0)}
                       for g in groups],
        },
    }


def _entry(e: dict[str, Any], record_id: int, pg_id: int, group: tuple[str, str], place: tuple[int, int],
           frames: dict[int, tuple[str, int, str]], wall: Any, timeout_s: float) -> dict[str, Any]:
    me, size = place
    sizes = [list(e["shape"])] if e["dtype"] is not None else []
    out_sizes = sizes
    if sizes and e["kind"] == "allgather":  # dim 0 from every rank (the analyzer assumes equal rows)
        out_sizes = [[(sizes[0][0] if sizes[0] else 1) * size, *sizes[0][1:]]]
    elif sizes and e["kind"] == "reduce_scatter":
        out_sizes = [[e["count"] // max(size, 1)]]
    dtypes = [_SCALAR_NAMES.get(e["dtype"], e["dtype"])] if e["dtype"] is not None else []
    name = _TORCH_NAMES.get(e["kind"], e["kind"])
    if e["kind"] == "send":
        name += f" {me}->{e['peer']}"
    elif e["kind"] == "recv":
        name += f" {me}<-{e['peer']}"
    frame = frames.get(e["frame"])
    seq = e["seq"] + 1
    state = {"failed": "started"}.get(e["state"], e["state"])
    return {
        "record_id": record_id,
        "pg_id": pg_id,
        "process_group": group,
        "collective_seq_id": 0 if e["p2p"] else seq,
        "p2p_seq_id": seq if e["p2p"] else 0,
        "op_id": seq,
        "profiling_name": "gloo:" + name,
        "time_created_ns": wall(e["enqueued_ns"]),
        "time_discovered_started_ns": wall(e["started_ns"]),
        "time_discovered_completed_ns": wall(e["finished_ns"]) if e["state"] == "completed" else None,
        "duration_ms": (e["finished_ns"] - e["started_ns"]) / 1e6 if e["finished_ns"] and e["started_ns"] else None,
        "state": state,
        "retired": e["state"] in ("completed", "failed"),
        "timeout_ms": int(timeout_s * 1000),
        "input_sizes": sizes, "input_dtypes": dtypes, "output_sizes": out_sizes, "output_dtypes": dtypes,
        "is_p2p": bool(e["p2p"]),
        "frames": [{"filename": frame[0], "line": frame[1], "name": frame[2]}] if frame else [],
        "thread_id": "", "thread_name": "",
        "torchring": {"what": e["what"], "describe": e["describe"], "kind": e["kind"],
                      "failed": e["state"] == "failed", "peer": e["peer"], "tag": e["tag"], "seq": e["seq"],
                      "enqueued_ns": wall(e["enqueued_ns"]), "started_ns": wall(e["started_ns"]),
                      "finished_ns": wall(e["finished_ns"])},
    }


def write(dump: dict[str, Any], directory: str | os.PathLike[str], rank: int) -> Path:
    """Writes `dump` as rank `rank`'s file in `directory` (whole or not at all) and returns its path."""
    path = path_of(directory, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    with open(partial, "wb") as f:
        pickle.dump(dump, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(partial, path)
    return path


def read(path: str | os.PathLike[str]) -> dict[str, Any]:
    """One rank's dump as written (a torch Flight Recorder pickle)."""
    with open(path, "rb") as f:
        return pickle.load(f)


def default_host() -> str:
    """This host's name, as dumps record it when the caller has none."""
    return socket.gethostname()
