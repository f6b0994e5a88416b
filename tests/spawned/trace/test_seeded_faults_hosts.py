"""Seeded faults across test hosts (tests/support/_hosts.py: 3 hosts, one rank each, ranks
started in their hosts without a launcher): the ranks' dumps name the culprit rank, its host,
the operation and the Python line, as on one host. The test plays the launcher's part where a
launcher would: it stops the ranks left running with SIGTERM, on which each dumps."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from _host_jobs import job_env, log_tails, start_ranks, wait_all
from test_seeded_faults import JOB, line_of

from torchring.trace import diagnose


def _job(mode: str) -> tuple[list[str], dict[int, diagnose.Rank], list[str]]:
    """The job in `mode` on three hosts: (the diagnosis, the dumps read, the host names)."""
    from _hosts import hosts  # here: it skips the test where hosts cannot be made

    with hosts(3) as hs:
        dumps = Path(hs[0].shared) / "dumps"
        env = job_env(hs, TORCHRING_TIMEOUT="4", TORCHRING_TRACE_DIR=str(dumps))
        procs, logs = start_ranks(hs, [sys.executable, str(JOB), mode, hs[0].shared], env)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and [p.poll() for p in procs].count(None) > (1 if mode == "lock" else 0):
            time.sleep(0.2)
        if mode == "lock":  # rank 1 is still on its lock: stop it as a launcher would
            hs[1].signal_all(signal.SIGTERM)
        codes = wait_all(procs, timeout=30)
        assert codes is not None and all(c != 0 for c in codes), f"{codes}\n{log_tails(logs)}"
        lines, _ = diagnose.diagnose(dumps)
        ranks, _ = diagnose.load(dumps)
        return lines, ranks, [h.name for h in hs]


def test_a_rank_blocked_on_another_host_is_named_with_its_host_and_line() -> None:
    lines, ranks, names = _job("lock")
    said = "\n".join(lines)
    assert (f"rank 1 (host {names[1]}) never reached it: its last operation was #6 allreduce float32[256] "
            f"SUM at {line_of('allreduce')} in main (completed); it is now in its own code at "
            f"{line_of('lock')} in main, not in a collective.") in said, said
    assert f"ranks 0, 2 reached #7 broadcast float32[256] root=0 at {line_of('broadcast')} in main" in said, said
    assert [ranks[r].host for r in range(3)] == names and ranks[1].reason == "SIGTERM"


def test_a_rank_that_issues_another_shape_across_hosts_is_named() -> None:
    lines, ranks, names = _job("shape")
    said = "\n".join(lines)
    assert (f"ranks 0, 2 issued broadcast float32[256] root=0 at {line_of('broadcast')} in main; "
            f"rank 1 issued allreduce float32[3] SUM at {line_of('shape')} in main.") in said, said
    assert "rank 1 issued something the others did not there" in said, said
    assert sorted(ranks) == [0, 1, 2] and all(ranks[r].reason == "failure" for r in range(3))
