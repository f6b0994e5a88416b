"""The diagnosis of a hang or failure, read from every rank's flight-recorder dump.

For each group (the world, each new_group, each torch.distributed group), the operations are
lined up by sequence number, which is the same on every rank for the same call. The first
number that not every member finished is where the job stopped; there:

- ranks whose record ends before it **never reached it**: each is named with its host, its last
  operation (and the Python line that issued it), and where its main thread is now (the first
  frame of its own code, and the call it is blocked in);
- ranks that reached it with **different** operations (kind, dtype, shape, op or root) issued
  something else there: the ranks of each variant are named, the smallest camp as the odd one
  out, with the Python line each issued it from;
- ranks that reached it and wait are counted with how long they have waited;
- a rank that wrote no dump at all is named as dead or unresponsive.

Each group's first failure, as the engine words it, follows. The analysis reads only the
dumps (no torch, no engine), so it runs anywhere they are copied to.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import dump as _dump, stragglers as _stragglers


@dataclass
class Rank:
    """One rank's dump, as read."""

    rank: int
    host: str
    reason: str
    time_ns: int
    entries: list[dict[str, Any]]
    main_stack: list[dict[str, Any]]
    groups: list[dict[str, Any]]


@dataclass
class Finding:
    """What the diagnosis found for one group."""

    group: str
    members: list[int]
    seq: int | None = None                 # first operation not every member finished (None: all did)
    behind: list[int] = field(default_factory=list)     # members that never reached it
    variants: dict[str, list[int]] = field(default_factory=dict)  # what each camp issued there
    odd: list[int] = field(default_factory=list)        # the smallest camp when they differ
    lines: list[str] = field(default_factory=list)


def load(directory: str | os.PathLike[str]) -> tuple[dict[int, Rank], int]:
    """Every rank's dump in `directory` and the world size they name."""
    ranks: dict[int, Rank] = {}
    world = 0
    for path in sorted(Path(directory).glob(_dump.PREFIX + "*")):
        suffix = path.name[len(_dump.PREFIX):]
        if not suffix.isdigit():
            continue
        d = _dump.read(path)
        meta = d.get("torchring", {})
        world = max(world, int(meta.get("world", 0)))
        stacks = meta.get("stacks", {})
        main = stacks.get(meta.get("main_thread"), next(iter(stacks.values()), []))
        ranks[int(suffix)] = Rank(int(suffix), meta.get("host", "?"), meta.get("reason", "?"),
                                  int(meta.get("time_ns", 0)), d["entries"], main, meta.get("groups", []))
    return ranks, max(world, max(ranks, default=-1) + 1)


def where(frames: list[dict[str, Any]]) -> str:
    """'train.py:41 in step' for an operation's or a stack's first frame of the user's own code."""
    own = next((f for f in frames if not f.get("library")), None)
    return f"{os.path.basename(own['filename'])}:{own['line']} in {own['name']}" if own else "(no Python frame)"


def now_at(rank: Rank) -> str:
    """Where the rank's main thread was at the dump: in its own code (not in any collective), or
    inside a library call made from its own line."""
    own = where(rank.main_stack)
    inner = rank.main_stack[0] if rank.main_stack else None
    if inner is None:
        return "at no Python frame"
    if not inner.get("library"):
        return f"in its own code at {own}, not in a collective"
    return f"at {own}, inside {os.path.basename(inner['filename'])}:{inner['line']} {inner['name']}"


def _signature(e: dict[str, Any]) -> str:
    t = e.get("torchring", {})
    return f"{t.get('kind', e['profiling_name'])} {t.get('describe', '')}".strip()


def _operation(e: dict[str, Any]) -> str:
    t = e.get("torchring", {})
    return f"#{t.get('seq', e['collective_seq_id'] - 1)} {_signature(e)} at {where(e.get('frames', []))}"


def _names(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def group_finding(name: str, members: list[int], ranks: dict[int, Rank]) -> Finding:
    """The diagnosis of group `name` from the dumps of its `members` that exist."""
    finding = Finding(name, members)
    per_rank = {r: {e["torchring"]["seq"]: e for e in ranks[r].entries
                    if e["process_group"][0] == name and not e["is_p2p"]} for r in members if r in ranks}
    if not per_rank:
        return finding
    firsts = []
    for ops in per_rank.values():
        open_ops = [s for s, e in ops.items() if e["state"] != "completed" or e["torchring"].get("failed")]
        firsts.append(min(open_ops) if open_ops else max(ops, default=-1) + 1)
    seq = min(firsts)
    if all(seq not in ops for ops in per_rank.values()) and all(max(ops, default=-1) < seq for ops in per_rank.values()):
        return finding  # every member finished everything it issued: nothing stuck here
    finding.seq = seq
    reached = {r: ops[seq] for r, ops in per_rank.items() if seq in ops}
    finding.behind = sorted(r for r in per_rank if r not in reached)
    for r, e in sorted(reached.items()):
        finding.variants.setdefault(_signature(e), []).append(r)
    label = f"{name} (world ranks {members})" if name != "world" else f"world ({len(members)} ranks)"
    finding.lines.append(f"{label}: operation #{seq} is the first that not every rank finished.")
    if len(finding.variants) > 1:
        camps = sorted(finding.variants.values(), key=lambda rs: (len(rs), rs))
        parts = [f"{_names(rs)} issued {sig} at {where(reached[rs[0]].get('frames', []))}" for sig, rs in
                 sorted(finding.variants.items(), key=lambda kv: kv[1])]
        finding.lines.append("  they differ: " + "; ".join(parts) + ".")
        if len(camps[0]) < len(camps[1]):  # a strict minority is the odd one out
            finding.odd = camps[0]
            finding.lines.append(f"  {_names(finding.odd)} issued something the others did not there (it "
                                 "skipped or added a collective before, or called it with another tensor).")
        else:
            finding.lines.append("  no camp is smaller than the others: one of them skipped or added a "
                                 "collective before this one, or called it with another tensor.")
    for r in finding.behind:
        rank, ops = ranks[r], per_rank[r]
        last = ops[max(ops)] if ops else None
        done = f"its last operation was {_operation(last)} ({last['state']})" if last else "it issued none here"
        finding.lines.append(f"  rank {r} (host {rank.host}) never reached it: {done}; it is now {now_at(rank)}.")
    waiting = sorted(r for r, e in reached.items() if e["state"] != "completed")
    if waiting and len(finding.variants) == 1:
        e = reached[waiting[0]]
        since = min(reached[r]["time_created_ns"] or 0 for r in waiting)
        newest = max(ranks[r].time_ns for r in waiting)
        waited = f" for {(newest - since) / 1e9:.1f} s" if since else ""
        finding.lines.append(f"  {_names(waiting)} reached {_operation(e)} and waited{waited}.")
    return finding


def diagnose(directory: str | os.PathLike[str]) -> tuple[list[str], list[Finding]]:
    """The lines `python -m torchring.trace DIR` prints, and the findings behind them."""
    ranks, world = load(directory)
    if not ranks:
        return [f"no torchring flight-recorder dumps ({_dump.PREFIX}<rank>) in {directory}"], []
    lines = [f"torchring trace: {len(ranks)} of {world} ranks wrote a dump in {directory}"]
    missing = [r for r in range(world) if r not in ranks]
    if missing:
        lines.append(f"  {_names(missing)} wrote no dump: dead, or unresponsive to SIGUSR1 (look at "
                     "that host and process first).")
    groups: dict[str, list[int]] = {}
    failures: dict[str, tuple[int, str]] = {}
    for r in sorted(ranks):
        for g in ranks[r].groups:
            groups.setdefault(g["name"], list(g["ranks"]))
            if g.get("failure") and g["name"] not in failures:
                failures[g["name"]] = (r, g["failure"])
    findings = [group_finding(name, members, ranks) for name, members in groups.items()]
    stuck = [f for f in findings if f.seq is not None]
    for f in stuck:
        lines.extend(f.lines)
    if not stuck:
        lines.append("  every group's operations finished on every rank that wrote a dump.")
    for name, (r, text) in failures.items():
        lines.append(f"  first failure seen in {name} (rank {r}): {text}")
    lines.extend(straggler_lines(ranks))
    return lines, findings


def straggler_lines(ranks: dict[int, Rank], top: int = 3, at_least_s: float = 0.01) -> list[str]:
    """Who made the others wait, from each dump's waits per peer (every group's, by world rank)."""
    records = []
    for rank in ranks.values():
        waited: dict[int, float] = {}
        own = sum(g.get("own_link_s", 0.0) for g in rank.groups)
        for g in rank.groups:
            members = list(g["ranks"])
            for i, seconds in enumerate(g.get("waited", [])):
                if i < len(members):
                    waited[members[i]] = waited.get(members[i], 0.0) + seconds
        records.append({"rank": rank.rank, "host": rank.host, "waited_s": waited, "own_link_s": own})
    lines = _stragglers.report(records, top=top, at_least_s=at_least_s)
    return [] if len(lines) < 2 else ["  " + line for line in lines]
