"""The straggler report: who made the others wait, how much, and in which phase it was late.

Its input is one record per rank: ``{"rank", "host", "waited_s": {peer: seconds}}`` (what the
engine timed this rank waiting for each peer) and, where the rank's status knows them,
``"phases": {"data": s, "compute": s, "communication": s}``, and ``"own_link_s"``: how long it
waited while its own link held back bytes it had sent (core/waits.h). ``torchring.stragglers()`` (a
collective), the launcher's end-of-job report and the dumps' diagnosis all build their lines here.

The rank that made the others wait most comes first. The engine charges a wait to the peer
waited for, which across hosts is the next rank in the schedule, not always the late one: with
rank 2 late, rank 1 waits for rank 2 and rank 0, which then exchanges with rank 1, waits for
rank 1. ``blame`` therefore passes waits on: a rank that made others wait while it was waiting
itself did not cause that part, so up to its own waiting is moved from it to the ranks it waited
for, in proportion to how long it waited for each, keeping who waited (a wait passed back to
the rank that waited is dropped). Each rank passes on at most what it waited, so the passing
ends; it is read from totals over the whole run, not matched in time, so it is an estimate. Its phase is read by comparing its own time in each phase with the
median of the other ranks': the phase where it spent the most more than they did, data loading
or compute (forward, backward, optimizer: the time that is neither), is where it was late, when
that excess explains at least half of the longest wait it caused (``lateness``); otherwise no
phase of its own explains it, and the report says its communication (link or host) was slow —
a rank behind a slower link arrives on time and still makes the others wait.
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["made_wait", "blame", "report", "phase_of"]

_PHASES = {"data": "data loading", "compute": "compute (forward/backward/optimizer)"}


def made_wait(records: list[dict[str, Any]]) -> dict[int, dict[int, float]]:
    """{peer: {waiter: seconds}}: how long each rank waited for each other rank."""
    made: dict[int, dict[int, float]] = {}
    for rec in records:
        for peer, seconds in rec.get("waited_s", {}).items():
            peer = int(peer)
            if peer != rec["rank"] and seconds > 0:
                by = made.setdefault(peer, {})
                by[rec["rank"]] = by.get(rec["rank"], 0.0) + seconds
    return made


def blame(records: list[dict[str, Any]]) -> dict[int, dict[int, float]]:
    """{peer: {waiter: seconds}} as made_wait, with the waits each rank passed on moved to the
    ranks it waited for (see the module's docstring)."""
    blamed = made_wait(records)
    waited = {rec["rank"]: {int(p): s for p, s in rec.get("waited_s", {}).items() if int(p) != rec["rank"] and s > 0}
              for rec in records}
    left = {r: sum(w.values()) for r, w in waited.items()}  # what each rank may still pass on
    for _ in range(len(records)):
        moved = False
        for middle in sorted(blamed):
            incoming = sum(blamed[middle].values())
            own = left.get(middle, 0.0)
            if incoming <= 0 or own <= 1e-9:
                continue
            passed = min(incoming, own)
            left[middle] = own - passed
            scale = passed / incoming
            for waiter in list(blamed[middle]):
                share = blamed[middle][waiter] * scale
                blamed[middle][waiter] -= share
                for peer, seconds in waited[middle].items():
                    if peer != waiter:
                        into = blamed.setdefault(peer, {})
                        into[waiter] = into.get(waiter, 0.0) + share * seconds / own
            moved = True
        if not moved:
            break
    return {peer: {w: s for w, s in by.items() if s > 1e-9} for peer, by in blamed.items()}


def phase_of(culprit: dict[str, Any], others: list[dict[str, Any]], lateness: float) -> str | None:
    """Where `culprit` was late: "data loading: 4.20 s, the others' median 1.40 s", or a note that
    no phase of its own explains it; None when the ranks carry no phases."""
    mine = culprit.get("phases")
    theirs = [o["phases"] for o in others if o.get("phases")]
    if not mine or not theirs:
        return None
    best, excess, median = None, 0.0, 0.0
    for phase in _PHASES:
        m = statistics.median(t.get(phase, 0.0) for t in theirs)
        if mine.get(phase, 0.0) - m > excess:
            best, excess, median = phase, mine.get(phase, 0.0) - m, m
    if best is not None and excess >= 0.5 * lateness:
        return f"late in {_PHASES[best]}: {mine[best]:.2f} s, the others' median {median:.2f} s"
    own = culprit.get("own_link_s", 0.0)
    held = f" (its own link held back bytes it had sent for {own:.2f} s)" if own > 0.05 * lateness else ""
    return ("no phase of its own explains it (its data loading and compute match the others'): "
            f"its communication is slow{held}, look at its link or host")


def report(records: list[dict[str, Any]], top: int = 5, at_least_s: float = 0.0,
           blamed: dict[int, dict[int, float]] | None = None) -> list[str]:
    """The report's lines, the rank that made the others wait most first (ranks below
    `at_least_s` in total are left out); ["no rank made another wait"] when none did."""
    made = blame(records) if blamed is None else blamed
    by_rank = {rec["rank"]: rec for rec in records}
    ranked = [(peer, by) for peer, by in sorted(made.items(), key=lambda kv: -sum(kv[1].values()))
              if sum(by.values()) > 0 and sum(by.values()) >= at_least_s][:top]
    if not ranked:
        return ["no rank made another wait"]
    lines = ["who made the others wait (seconds other ranks waited for each, since the start):"]
    for peer, by in ranked:
        host = by_rank.get(peer, {}).get("host", "?")
        waiters = ", ".join(f"rank {r} {s:.3f} s" for r, s in sorted(by.items(), key=lambda kv: -kv[1])[:4])
        more = f" and {len(by) - 4} more" if len(by) > 4 else ""
        line = f"  rank {peer} (host {host}): {sum(by.values()):.3f} s ({waiters}{more})"
        if peer in by_rank:
            phase = phase_of(by_rank[peer], [r for k, r in by_rank.items() if k != peer], max(by.values()))
            if phase:
                line += f"; {phase}"
        lines.append(line)
    return lines
