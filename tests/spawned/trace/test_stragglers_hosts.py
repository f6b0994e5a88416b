"""Stragglers across test hosts (tests/support/_hosts.py, one rank each, no launcher): a host
whose link is slower (tc on its interface) and a rank whose data loader is 3x slower are each
ranked first by torchring.stragglers(), with their host, and the report tells the two apart:
the slow loader is late in data loading, the slow link has no phase of its own to blame and
its own link held its bytes back (the ring's leaders otherwise wait for each other in a cycle)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from _host_jobs import job_env, log_tails, start_ranks, wait_all

ROOT = Path(__file__).resolve().parents[3]
JOB = ROOT / "tests" / "support" / "_straggler_job.py"


def _report(mode: str, slow_link: str | None = None) -> tuple[list[str], list[str]]:
    """stragglers() of the job in `mode` on three hosts (host 2's link at `slow_link`), and the host names."""
    from _hosts import hosts  # here: it skips the test where hosts cannot be made

    with hosts(3) as hs:
        if slow_link:
            hs[2].shape(slow_link)
        env = job_env(hs, TORCHRING_TIMEOUT="60")
        procs, logs = start_ranks(hs, [sys.executable, str(JOB), mode, hs[0].shared], env)
        codes = wait_all(procs, timeout=240)
        assert codes == [0, 0, 0], f"{codes}\n{log_tails(logs)}"
        return json.loads((Path(hs[0].shared) / "result0.json").read_text())["report"], [h.name for h in hs]


def test_a_host_with_a_slower_link_is_ranked_first_and_no_phase_of_its_own_is_blamed() -> None:
    report, names = _report("link", slow_link="40mbit")
    assert report[1].startswith(f"  rank 2 (host {names[2]}): "), report
    assert "its communication is slow (its own link held back bytes it had sent for " in report[1], report


def test_a_rank_whose_loader_is_3x_slower_on_another_host_is_ranked_first_late_in_data_loading() -> None:
    report, names = _report("loader")
    assert report[1].startswith(f"  rank 2 (host {names[2]}): "), report
    assert "late in data loading" in report[1], report
