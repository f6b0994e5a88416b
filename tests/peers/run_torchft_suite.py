"""Runs torchft's own test files, unmodified, with torchring's process group in place of gloo
(issue #28's torchft acceptance), and prints what passed.

    python tests/peers/run_torchft_suite.py                          # every file below
    python tests/peers/run_torchft_suite.py --file manager_integ_test.py -k ddp_recovery
    python tests/peers/run_torchft_suite.py --json /tmp/torchft.json  # the results for a test

torchft ships its tests inside its wheel (``torchft/*_test.py``); they are run where pip put
them, nothing of torchft's is copied. pytest loads the plugin torchft_in_place_of_gloo.py
(beside this file) first, which makes ``torchft.process_group.ProcessGroupGloo`` torchring's
ProcessGroupTorchring, so the Manager, DDP, LocalSGD/DiLoCo, the parameter server and the
checkpoint transport in those tests run on torchring; the plugin prints how many torchring
groups were formed. Of process_group_test.py only the gloo tests are selected (the others are
torchft's NCCL, subprocess-based and dummy groups, which torchring does not replace).

The exit status is 0 when every test that ran passed or is a known difference (KNOWN, with the
reason). A test that fails now and then with torchft's own gloo group too (FLAKY: a race of the
test's threads) and fails with the words named there is run once more, and that run counts.
torchft's tests need ``parameterized`` (the `test` extra installs both).

This file is a tool, not a test: pytest does not collect it (its name does not start with test_).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import _junit  # beside this file

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# torchft's test files that use ProcessGroupGloo, and the -k expression that selects its tests.
FILES = {
    "process_group_test.py": "gloo and not baby",  # ProcessGroupTest's gloo tests, NormalGlooMultiPgTest
    "manager_integ_test.py": "",                   # the Manager's DDP healing, quorum, allreduce
    "local_sgd_integ_test.py": "",                 # LocalSGD and DiLoCo with failures
    "ddp_test.py": "",
    "parameter_server_test.py": "",
    "lighthouse_test.py": "",
    "checkpointing/pg_transport_test.py": "gloo",  # healing a replica through the process group
}

# Tests whose failure is a known, explained difference from gloo (not a torchring defect).
KNOWN = {
    "test_gloo_timeout": "the test matches gloo's own words for a rendezvous timeout ('timeout after "
                         "10ms' or 'Socket Timeout'); torchring's configure() raises within the same 10 ms "
                         "with 'rendezvous timed out after 0.01 s waiting for rank 1 to join'",
    "test_pg_transport_gloo": "a send completes when the peer's recv took it (as MPI_Ssend), so a send "
                              "to a rank that never receives waits the whole 10 s Work.wait instead of "
                              "returning at once as gloo's buffered send does; the test's pool allows 10 s "
                              "in all",
}

# torchft tests that fail now and then with torchft's own ProcessGroupGloo as well: a race between
# the test's threads, not a property of the process group. A failure with these words is run once
# more, and the second run's outcome counts (the report says so).
FLAKY = {
    "test_streaming_diloco_upscale": (
        "Timeout expired",
        "replica 0 joins after the barrier at step 2; when replicas 1 and 2 form step 3's quorum "
        "before its first request reaches the lighthouse, they finish at step 4 and it waits alone "
        "for a quorum of min_replicas=2 until the 10 s timeout. On a 2-core machine the 12 cases "
        "failed so in 6 of 19 runs with gloo and 1 of 15 with torchring"),
}


def flaky_reason(test: str, why: str) -> Optional[str]:
    """Why a failure of `test` with message `why` is torchft's own race (FLAKY), or None."""
    words, reason = FLAKY.get(re.sub(r"_\d+$", "", test), ("", ""))
    return reason if words and words in why else None


def torchft_dir() -> Path:
    """Where the installed torchft package (and so its test files) lives."""
    import torchft  # a tool's optional dependency: only needed when the runner runs

    return Path(torchft.__file__).resolve().parent


def run_file(directory: Path, name: str, select: str, out: Path, timeout: float) -> tuple[int, str]:
    """Runs one torchft test file under pytest with the plugin; (exit status, the plugin's count line)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    cmd = [sys.executable, "-m", "pytest", "-p", "torchft_in_place_of_gloo", "-p", "no:cacheprovider",
           "-q", "-s", str(directory / name), f"--junitxml={out}", "--rootdir", str(directory)]
    if select:
        cmd += ["-k", select]
    try:
        done = subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return 124, f"timed out after {timeout:.0f} s: {(e.stdout or '')[-2000:]}"
    counts = [line for line in done.stdout.splitlines() if line.startswith("torchring process groups formed")]
    return done.returncode, (counts[-1] if counts else done.stdout[-2000:] + done.stderr[-2000:])


def stable_name(name: str) -> str:
    """A parameterized test's name without the case index before its description
    ("test_collective_5_allreduce" -> "test_collective_allreduce"): torchft numbers some cases
    in the order of a set, which changes from one interpreter to the next. A trailing index
    (the case has no description: "..._commit_failure_07") stays, so cases stay apart."""
    return re.sub(r"_\d+_(?=[A-Za-z])", "_", name)


def read_report(path: Path) -> dict[str, tuple[str, str]]:
    """stable test name -> (pass/FAIL/skip, first line of the failure or skip reason)."""
    results: dict[str, tuple[str, str]] = {}
    if not path.exists():
        return results
    for name, status, why in _junit.outcomes(path):
        key = stable_name(name) if stable_name(name) not in results else name  # never merge two cases
        results[key] = (status, why.splitlines()[0][:200] if why else "")
    return results


def rerun_flaky(directory: Path, name: str, results: dict[str, tuple[str, str]], tmp: Path,
                timeout: float) -> dict[str, str]:
    """Runs the FLAKY failures of `results` once more and puts the second outcome in `results`;
    returns a note for each test run again."""
    again = {test: (why, reason) for test, (outcome, why) in results.items()
             if outcome == "FAIL" and (reason := flaky_reason(test, why))}
    if not again:
        return {}
    report = tmp / (name.replace("/", "_") + ".again.xml")
    run_file(directory, name, " or ".join(sorted(again)), report, timeout)
    second = read_report(report)
    notes = {}
    for test, (why, reason) in again.items():
        results[test] = second.get(test, ("FAIL", "no report from the second run"))
        notes[test] = (f"run twice: the first failed ({why}), torchft's own race ({reason}); "
                       f"the second: {results[test][0]} {results[test][1]}").rstrip()
    return notes


def main(argv: list[str] | None = None) -> int:
    """Runs the files, prints a table per file and the totals; 0 when nothing unexplained failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", action="append", help="a test file of torchft (default: all of FILES)")
    parser.add_argument("-k", default=None, help="pytest -k expression (replaces the file's own)")
    parser.add_argument("--json", type=Path, help="write {file: {test: [status, why]}} here")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per file")
    args = parser.parse_args(argv)
    directory = torchft_dir()
    files = args.file or list(FILES)
    everything: dict[str, dict[str, tuple[str, str]]] = {}
    unexplained = []
    with tempfile.TemporaryDirectory(prefix="torchft-suite-") as tmp:
        for name in files:
            select = args.k if args.k is not None else FILES.get(name, "")
            report = Path(tmp) / (name.replace("/", "_") + ".xml")
            status, counts = run_file(directory, name, select, report, args.timeout)
            results = read_report(report)
            reruns = rerun_flaky(directory, name, results, Path(tmp), args.timeout)
            everything[name] = results
            print(f"== {name}" + (f" (-k '{select}')" if select else "") + f": {counts}")
            for test, (outcome, why) in sorted(results.items()):
                note = f"known ({KNOWN[test]}): {why}" if outcome == "FAIL" and test in KNOWN else why
                note = reruns.get(test, note if outcome != "pass" else "")
                print(f"  {outcome:>4}  {test}" + (f"  {note}" if note else ""))
                if outcome == "FAIL" and test not in KNOWN:
                    unexplained.append(f"{name}::{test}")
            if not results:
                unexplained.append(f"{name}: no report (exit status {status})")
    totals = {s: sum(1 for r in everything.values() for o, _ in r.values() if o == s) for s in ("pass", "FAIL", "skip")}
    print(f"\ntorchft's tests on torchring: {totals['pass']} passed, {totals['FAIL']} failed "
          f"({totals['FAIL'] - len([u for u in unexplained if '::' in u])} known), {totals['skip']} skipped")
    if args.json:
        args.json.write_text(json.dumps(everything, indent=1))
    for item in unexplained:
        print(f"UNEXPLAINED: {item}")
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
