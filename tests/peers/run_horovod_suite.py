"""Runs Horovod's own PyTorch test files, unmodified, against torchring.horovod (issue #13's
acceptance), and prints what passed on which rank.

    python tests/peers/run_horovod_suite.py --horovod-src /path/to/horovod -np 2
    python tests/peers/run_horovod_suite.py --horovod-src DIR -np 4 -k "allreduce and not grad"
    python tests/peers/run_horovod_suite.py --horovod-src DIR -np 2 --all    # the three acceptance files
    python tests/peers/run_horovod_suite.py --horovod-src DIR --file test/parallel/test_timeline.py

For each test file, one pytest session per rank runs under `torchring-run -np N`, as Horovod's
CI runs them under horovodrun (a file of test/single/ with one rank: Horovod runs those
standalone). `import horovod.torch` resolves to torchring.horovod through a small alias
package written into a temporary directory and put first on PYTHONPATH; nothing is
installed, and nothing of Horovod's is copied (the files are read where they are). Each rank
writes a JUnit XML report; the table shows pass/FAIL/skip per rank, marks the tests horovod.md
§4.2 rates as acceptance tests (AT), and the exit status is 0 only when every AT test that ran
passed on every rank (the known torch >= 2.9 exceptions aside). Horovod's test helpers need
`mock` and `cloudpickle` besides pytest, numpy and packaging.

This file is a tool, not a test: pytest does not collect it (its name does not start with test_).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import _junit  # beside this file

ROOT = Path(__file__).resolve().parents[2]

# horovod.md §4.2 and §4.3: the tests rated AT (CPU, 2-4 ranks, public API), per file.
AT = {
    "test_torch.py": frozenset("""
        test_horovod_allreduce test_horovod_allreduce_average test_horovod_allreduce_min
        test_horovod_allreduce_max test_horovod_allreduce_product test_horovod_allreduce_inplace
        test_horovod_allreduce_async_fused test_horovod_allreduce_prescale
        test_horovod_allreduce_postscale test_horovod_allreduce_process_sets
        test_horovod_allreduce_error test_horovod_allreduce_type_error
        test_horovod_allreduce_duplicate_name_error test_horovod_allreduce_grad
        test_horovod_allreduce_grad_average test_horovod_allreduce_grad_process_sets
        test_horovod_grouped_allreduce test_horovod_grouped_allreduce_average
        test_horovod_grouped_allreduce_inplace test_horovod_grouped_allreduce_process_sets
        test_horovod_grouped_allreduce_grad test_horovod_grouped_allreduce_grad_average
        test_horovod_grouped_allreduce_grad_process_sets
        test_horovod_allgather test_horovod_allgather_variable_size test_horovod_allgather_async_fused
        test_horovod_allgather_process_sets test_horovod_allgather_error test_horovod_allgather_type_error
        test_horovod_allgather_duplicate_name_error test_horovod_allgather_grad
        test_horovod_allgather_grad_process_sets test_horovod_grouped_allgather
        test_horovod_grouped_allgather_process_sets test_horovod_grouped_allgather_grad
        test_horovod_broadcast test_horovod_broadcast_inplace test_horovod_broadcast_process_sets
        test_horovod_broadcast_error test_horovod_broadcast_type_error test_horovod_broadcast_rank_error
        test_horovod_broadcast_duplicate_name_error test_horovod_broadcast_grad
        test_horovod_broadcast_grad_process_sets
        test_horovod_alltoall test_horovod_alltoall_equal_split test_horovod_alltoall_process_sets
        test_horovod_alltoall_type_error test_horovod_alltoall_equal_split_length_error
        test_horovod_alltoall_splits_error test_horovod_alltoall_splits_type_error
        test_horovod_alltoall_rank_error test_horovod_alltoall_grad test_horovod_alltoall_equal_split_grad
        test_horovod_alltoall_grad_process_sets
        test_broadcast_state test_broadcast_state_options test_broadcast_state_no_grad
        test_broadcast_object test_broadcast_object_process_sets test_allgather_object
        test_compression_fp16 test_force_allreduce test_duplicate_names test_missing_named_parameters
        test_dynamic_requires_grad test_gradient_clipping test_synchronize_step_warning
        test_no_named_parameters test_horovod_join_allreduce test_horovod_join_allgather
        test_horovod_join_broadcast test_sparse_embeddings test_async_sparse_allreduce
        test_async_sparse_allreduce_process_sets test_optimizer_process_sets
        test_barrier_with_multiple_collectives
        test_horovod_reducescatter test_horovod_reducescatter_average test_horovod_reducescatter_prescale
        test_horovod_reducescatter_postscale test_horovod_reducescatter_async_fused
        test_horovod_reducescatter_process_sets test_horovod_reducescatter_scalar_error
        test_horovod_reducescatter_adasum test_horovod_reducescatter_error
        test_horovod_reducescatter_type_error test_horovod_reducescatter_duplicate_name_error
        test_horovod_reducescatter_grad test_horovod_reducescatter_grad_average
        test_horovod_reducescatter_grad_process_sets
        test_horovod_grouped_reducescatter test_horovod_grouped_reducescatter_average
        test_horovod_grouped_reducescatter_prescale test_horovod_grouped_reducescatter_postscale
        test_horovod_grouped_reducescatter_scalar_error test_horovod_grouped_reducescatter_process_sets
        test_horovod_grouped_reducescatter_grad
        """.split()),
    "test_timeline.py": frozenset({"test_timeline"}),
    "test_torch_elastic.py": frozenset({"test_elastic_state", "test_elastic_sampler"}),
}

# Issue #13: these build every torch.optim optimizer, and Muon (torch >= 2.9) rejects 1-D
# parameters whatever the module under test does (--hide-muon runs them without it).
KNOWN = {"test_broadcast_state": "torch>=2.9 Muon", "test_broadcast_state_options": "torch>=2.9 Muon",
         "test_force_allreduce": "torch>=2.9 Muon"}

ACCEPTANCE = ["test/parallel/test_torch.py", "test/parallel/test_timeline.py", "test/single/test_torch_elastic.py"]

# The alias package (and a pytest plugin beside it): path -> source. Written by this tool.
ALIAS = {
    "horovod/__init__.py": '''
        """Stand-in for Horovod made by torchring's run_horovod_suite.py: horovod.torch is torchring.horovod."""
        __version__ = "0.28.1"
        ''',
    "horovod/torch/__init__.py": '''
        """horovod.torch is torchring.horovod itself; its loaded submodules are aliased under this name."""
        import importlib
        import sys

        import torchring.horovod as _impl

        try:
            importlib.import_module("torchring.horovod.elastic")  # hvd.elastic, as horovod.torch has it
        except ImportError:
            pass
        for _name, _module in list(sys.modules.items()):
            if _name.startswith("torchring.horovod."):
                sys.modules["horovod.torch." + _name[len("torchring.horovod."):]] = _module
        sys.modules["horovod.torch.mpi_ops"] = _impl
        sys.modules[__name__] = _impl
        ''',
    "horovod/common/__init__.py": '''
        """Horovod's framework-neutral package: only what the test files import."""
        ''',
    "horovod/common/exceptions.py": '''
        """The exception types, from torchring.horovod."""
        from torchring.horovod import HorovodInternalError

        try:
            from torchring.horovod.elastic import HostsUpdatedInterrupt
        except ImportError:
            class HostsUpdatedInterrupt(RuntimeError):
                """Placeholder: torchring.horovod.elastic is not importable."""
        ''',
    "horovod/common/util.py": '''
        """env(): the test helper that sets environment variables for a with-block."""
        import contextlib
        import os


        @contextlib.contextmanager
        def env(**values):
            """Sets each variable whose value is not None; restores the previous values after."""
            values = {k: v for k, v in values.items() if v is not None}
            before = {k: os.environ.get(k) for k in values}
            os.environ.update(values)
            try:
                yield
            finally:
                for k, old in before.items():
                    if old is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = old
        ''',
    "horovod/runner/__init__.py": "",
    "horovod/runner/util/__init__.py": "",
    "horovod/runner/util/threads.py": '''
        """in_thread(): start a function in a (daemon) thread and return the thread."""
        import threading


        def in_thread(target, args=(), name=None, daemon=True, silent=False):
            """Runs target(*args) in a new thread; with silent, exceptions are swallowed."""
            def body():
                try:
                    target(*args)
                except BaseException:
                    if not silent:
                        raise
            thread = threading.Thread(target=body, name=name, daemon=daemon)
            thread.start()
            return thread
        ''',
    "hvd_suite_plugin.py": '''
        """A pytest plugin for the suite's ranks: each failure is written to stderr as it happens
        (a rank stopped later still leaves it in the log), and a test running longer than
        $HVD_SUITE_TEST_TIMEOUT seconds gets every thread's stack written to stderr, then fails
        with TimeoutError (so a hang in one test does not stall the whole file)."""
        import faulthandler
        import os
        import signal
        import sys

        import pytest

        LIMIT = float(os.environ.get("HVD_SUITE_TEST_TIMEOUT") or 0)


        def _expire(signum, frame):
            raise TimeoutError(f"the test did not finish within {LIMIT:g} s (--test-timeout); "
                               "every thread's stack is in the log")


        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_protocol(item, nextitem):
            if LIMIT <= 0:
                yield
                return
            faulthandler.dump_traceback_later(LIMIT, exit=False)  # from C: works whatever holds the GIL
            previous = signal.signal(signal.SIGALRM, _expire)
            signal.setitimer(signal.ITIMER_REAL, LIMIT + 1)
            try:
                yield
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
                faulthandler.cancel_dump_traceback_later()


        def pytest_configure(config):
            if os.environ.get("HVD_SUITE_HIDE_MUON") == "1":  # --hide-muon
                import torch
                if hasattr(torch.optim, "Muon"):  # the tests keep optimizers whose module is torch.optim*
                    torch.optim.Muon.__module__ = "hidden_by_run_horovod_suite"


        def pytest_runtest_logreport(report):
            if report.failed:
                sys.stderr.write(f"\\n==== {report.nodeid} failed ({report.when}):\\n{report.longreprtext}\\n")
                sys.stderr.flush()
        ''',
}

# What each rank runs: pytest on the file, with its report at $HVD_SUITE_JUNIT/rank$RANK.xml.
# It exits 0 after failed tests (they are in the report): a rank exiting non-zero makes
# torchrun's agent stop the others before they write theirs.
_RANK_MAIN = ("import os, sys, pytest; code = pytest.main(sys.argv[1:] + ['--junit-xml=' + "
              "os.path.join(os.environ['HVD_SUITE_JUNIT'], 'rank' + os.environ['RANK'] + '.xml')]); "
              "sys.exit(0 if code in (0, 1, 5) else code)")


def write_alias(directory: Path) -> None:
    """The alias package `horovod` in `directory`."""
    for relative, source in ALIAS.items():
        path = directory / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source).lstrip())


def missing_requirements() -> list[str]:
    """The modules Horovod's test files import that this interpreter lacks."""
    missing = []
    for module in ("pytest", "numpy", "packaging", "mock", "cloudpickle"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    return missing


def read_reports(directory: Path, ranks: int) -> dict[str, list[tuple[str, str]]]:
    """test name -> [(status, first line of the failure) per rank]; status pass/FAIL/skip/-
    ('-': no report or no entry from that rank, e.g. it crashed or hung)."""
    order = {"-": 0, "pass": 1, "skip": 2, "FAIL": 3}
    results: dict[str, list[tuple[str, str]]] = {}
    for rank in range(ranks):
        path = directory / f"rank{rank}.xml"
        if not path.exists():
            continue
        for name, status, why in _junit.outcomes(path):
            row = results.setdefault(name, [("-", "")] * ranks)
            if order[status] > order[row[rank][0]]:  # a teardown error after a pass counts
                row[rank] = (status, why.splitlines()[0][:160] if why else "")
    return results


def table(file: str, results: dict[str, list[tuple[str, str]]], ranks: int) -> tuple[str, list[str]]:
    """The printed table for one file, and the AT tests that did not pass on every rank."""
    at = AT.get(file, frozenset())
    width = max([len(n) for n in results] + [20])
    lines = [f"{'test':<{width}}  AT  " + " ".join(f"{'r' + str(r):>4}" for r in range(ranks)) + "  note"]
    bad_at = []
    for name in sorted(results):
        row = results[name]
        statuses = [s for s, _ in row]
        ok = all(s == "pass" for s in statuses)
        note = next((why for s, why in row if s in ("FAIL", "skip") and why), "") if not ok else ""
        if not ok and name in KNOWN:
            note = f"known ({KNOWN[name]}): {note}"
        if name in at and not ok and name not in KNOWN:
            bad_at.append(name)
        lines.append(f"{name:<{width}}  {'AT' if name in at else '  '}  "
                     + " ".join(f"{s:>4}" for s in statuses) + (f"  {note}" if note else ""))
    ran = [n for n in results if n in at]
    passed = [n for n in ran if all(s == "pass" for s, _ in results[n])]
    everywhere = sum(all(s == "pass" for s, _ in r) for r in results.values())
    lines.append(f"{file}: {len(results)} tests, {everywhere} passed on every rank; AT: {len(passed)} of "
                 f"{len(ran)} run passed ({len(at)} in the list"
                 + (f", {len(at - set(results))} not run" if at - set(results) else "") + ")")
    if bad_at:
        lines.append("AT tests not passing: " + " ".join(sorted(bad_at)))
    return "\n".join(lines), bad_at


def ranks_for(file: Path, np: int) -> int:
    """test/single files run standalone in Horovod's CI (test_elastic_sampler's counts hold
    only for one rank): 1 rank; the others `np`."""
    return 1 if file.parent.name == "single" else np


def run_file(args: argparse.Namespace, file: Path, work: Path, alias: Path) -> tuple[int, Path]:
    """Runs one test file under torchring-run; (launcher exit status, its reports' directory)."""
    junit = work / ("junit-" + file.stem)
    junit.mkdir()
    log = work / (file.stem + ".log")
    env = dict(os.environ, HVD_SUITE_JUNIT=str(junit), PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=os.pathsep.join([str(alias), str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env.setdefault("TORCHRING_TIMEOUT", str(args.op_timeout))
    env["HVD_SUITE_TEST_TIMEOUT"] = str(args.test_timeout)
    env["HVD_SUITE_HIDE_MUON"] = "1" if args.hide_muon else "0"
    pytest_args = [str(file), "-v", "-p", "no:cacheprovider", "-p", "hvd_suite_plugin",
                   "--continue-on-collection-errors",
                   "-o", "junit_family=xunit1", *(["-k", args.k] if args.k else []), *args.pytest_args]
    ranks = ranks_for(file, args.np)
    command = [sys.executable, "-m", "torchring.run", "-np", str(ranks),
               sys.executable, "-c", _RANK_MAIN, *pytest_args]
    print(f"== {file.name} at -np {ranks}: {shlex.join(command)}\n   log: {log}", flush=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"   timed out after {args.timeout:g} s; stopping the job", flush=True)
            code = _stop(proc)
        except BaseException:  # Ctrl-C, or SIGTERM (see main): stop the job, not only the launcher
            _stop(proc)
            raise
    return code, junit


def _stop(proc: subprocess.Popen) -> int:
    """Stops the launcher the way Ctrl-C would (its agent then stops every rank); kills it after 30 s."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--horovod-src", required=True, type=Path, help="a Horovod source tree (has test/)")
    p.add_argument("-np", type=int, default=2, help="ranks (default 2)")
    p.add_argument("-k", default=None, help="pytest -k expression")
    p.add_argument("--file", action="append", default=None,
                   help="test file under --horovod-src (repeatable; default test/parallel/test_torch.py)")
    p.add_argument("--all", action="store_true", help="the three acceptance files: " + ", ".join(ACCEPTANCE))
    p.add_argument("--timeout", type=float, default=3600, help="seconds for each file's whole run")
    p.add_argument("--test-timeout", type=float, default=300,
                   help="seconds per test before its stacks are dumped and it fails (0: no limit)")
    p.add_argument("--op-timeout", type=float, default=60,
                   help="TORCHRING_TIMEOUT for the ranks unless set (a hang fails instead of waiting)")
    p.add_argument("--hide-muon", action="store_true",
                   help="hide torch.optim.Muon (torch >= 2.9) from the tests that build every torch.optim "
                        "optimizer, to see whether they pass with the others (changes no test file)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, reports)")
    p.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _terminated)  # so that a killed runner stops its job too
    missing = missing_requirements()
    if missing:
        p.error(f"Horovod's test files need {', '.join(missing)}: pip install {' '.join(missing)}")
    chosen = (args.file or []) + (ACCEPTANCE if args.all else [])
    files = [args.horovod_src / f for f in chosen or ["test/parallel/test_torch.py"]]
    for file in files:
        if not file.is_file():
            p.error(f"{file}: no such test file (is --horovod-src a Horovod source tree?)")
    work = Path(tempfile.mkdtemp(prefix="hvd-suite-"))
    alias = work / "alias"
    write_alias(alias)
    failed = False
    for file in files:
        code, junit = run_file(args, file, work, alias)
        ranks = ranks_for(file, args.np)
        results = read_reports(junit, ranks)
        text, bad_at = table(file.name, results, ranks)
        print(text)
        reports = len(list(junit.glob("rank*.xml")))
        if reports < ranks or not results:
            print(f"   only {reports} of {ranks} ranks wrote a report (launcher exit {code}); "
                  f"see the log's end:\n" + textwrap.indent(_tail(work / (file.stem + ".log")), "   | "))
            failed = True
        failed = failed or bool(bad_at)
    if args.keep or failed:
        print(f"logs and reports kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


if __name__ == "__main__":
    sys.exit(main())
