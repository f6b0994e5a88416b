"""benchmarks/gpu_suite.py's running of its steps, with stand-in steps that pass, fail, hang or
print: the time budget, the stop after a failed required step, the retry without the peers,
the files it leaves (the GPU machine gives it one chance, so these decisions are checked here)."""

from __future__ import annotations

import os
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu_suite  # noqa: E402
from _gpu_steps import STEPS, Step  # noqa: E402


def _py(code: str) -> tuple[str, ...]:
    return ("-c", code)


def _run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, steps: list[Step], *extra: str) -> tuple[int, str]:
    monkeypatch.setattr(gpu_suite, "STEPS", steps)
    monkeypatch.setattr(sys, "argv", ["gpu_suite.py", str(tmp_path / "out"), "--wheels", str(tmp_path / "none"),
                                      *extra])
    rc = gpu_suite.main()
    return rc, (tmp_path / "out" / "summary.md").read_text()


def test_steps_run_in_order_and_their_files_come_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    steps = [Step("first", "writes", _py("open(r'{work}/a.json', 'w').write('1'); print('first ran')"), 30, 1),
             Step("second", "prints", _py("print('second ran')"), 30, 1)]
    rc, summary = _run(monkeypatch, tmp_path, steps)
    assert rc == 0
    assert summary.index("| first | 0 |") < summary.index("| second | 0 |")
    log = (tmp_path / "out" / "gpu_suite.log").read_text()
    assert log.index("first ran") < log.index("second ran")
    with tarfile.open(tmp_path / "out" / "results.tar.gz") as tar:
        assert "results/a.json" in tar.getnames()


def test_a_failed_required_step_stops_the_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    steps = [Step("build", "fails", _py("raise SystemExit(3)"), 30, 1, required=True),
             Step("after", "would only fail again", _py("print('ran anyway')"), 30, 1)]
    rc, summary = _run(monkeypatch, tmp_path, steps)
    assert rc == 1
    assert "| build | 3 |" in summary and "| after | not run | 0 | build failed |" in summary
    assert "ran anyway" not in (tmp_path / "out" / "gpu_suite.log").read_text()


def test_a_step_past_its_limit_is_killed_and_the_budget_skips_the_rest(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    steps = [Step("hangs", "sleeps", _py("import time; time.sleep(60)"), 2, 1),
             Step("late", "needs more than is left", _py("print('late')"), 30, 20)]
    rc, summary = _run(monkeypatch, tmp_path, steps, "--budget-s", "8")
    assert rc == 1
    assert "| hangs | 124 |" in summary
    assert "| late | skipped |" in summary and "it needs 20" in summary


def test_a_failing_step_runs_again_without_its_peers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    steps = [Step("cpu", "peers break it", _py("import sys; sys.exit(0 if 'alone' in sys.argv else 1)"), 30, 1,
                  fallback=_py("import sys; sys.exit(0 if 'alone' in sys.argv else 1)") + ("alone",),
                  fallback_why="a peer failed")]
    rc, summary = _run(monkeypatch, tmp_path, steps)
    assert "| cpu | 1 |" in summary and "| cpu (fallback) | 0 |" in summary
    assert rc == 1  # the first failure still counts: the peer's failure is a finding


def test_dry_run_checks_each_command_then_runs_the_cpu_forms(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    parse_only = "import os, sys; sys.exit(0 if os.environ.get('TORCHRING_BENCH_PARSE_ONLY') == '1' else 9)"
    steps = [Step("gpu", "needs a GPU", _py(parse_only), 30, 1),
             Step("cpu", "has a small form", _py(parse_only), 30, 1, dry=_py("print('small form')"))]
    rc, summary = _run(monkeypatch, tmp_path, steps, "--dry-run")
    assert rc == 0
    assert "| gpu (parse) | 0 |" in summary and "| cpu (parse) | 0 |" in summary and "| cpu (dry) | 0 |" in summary


def test_the_real_steps_name_distinct_steps_and_the_build_is_required() -> None:
    names = [s.name for s in STEPS]
    assert len(names) == len(set(names))
    assert names[:3] == ["machine", "build", "tests"]
    assert next(s for s in STEPS if s.name == "build").required
