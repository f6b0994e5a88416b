"""torchring-run: start N ranks of a training script on this host.

    torchring-run -np 4 train.py --epochs 3
    torchring-run -np 4 python train.py            # horovodrun's form works too
    torchring-run -H localhost:4 --timeline-filename t.json --fusion-threshold-mb 32 python train.py
    python -m torchring.run -np 2 --max-restarts 3 train.py --resume
    torchring-run --check-build

It is torch's own elastic launcher (torch.distributed.run, the engine behind torchrun) with
the horovodrun conveniences on top: the engine is built once before any rank starts, every
output line carries its rank (or only rank 0 prints, with --rank0-only), --check-build says
what the engine was built with, and the exit code is the first failing rank's. When a rank
fails or is killed, torch's agent stops all the others; with --max-restarts K the whole job
restarts (torchring re-initializes under a new restart count) up to K times. Ctrl-C stops
everything. With --min-np/--max-np (or --host-discovery-script) the job is elastic instead: this
launcher supervises the workers itself, a lost one leaves the others running, and they re-form
in process (launch/elastic.py), on this host and on others over ssh. -H host0:2,host1:2 (or
--hostfile) starts the ranks of other hosts over ssh.

horovodrun's common flags are accepted, so `horovodrun -np 4 python train.py` becomes
`torchring-run -np 4 python train.py`: -H/--hosts and --hostfile (in rank order, other
hosts over ssh; -np defaults to their slots), the HOROVOD_* settings flags (--fusion-threshold-mb,
--cycle-time-ms, --timeline-filename, ..., passed to the ranks as the variables horovodrun
sets), --start-timeout, --verbose; --gloo/--mpi/--network-interfaces are accepted with a note.
The command may start with `python` (or `python -m module`), or be any other program.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re
import shlex
import shutil
import socket
import sys
import uuid
from pathlib import Path
from typing import Any

import torch.distributed.run as torchrun

from .._core import build as _build
from . import elastic as _elastic_launch, failures as _failures, ssh as _ssh_launch, output as _output, \
    remote_env as _remote_env, status as _status, threads as _threads, trace_report as _trace_report
from .. import build
from .._core.settings import DEFAULT_TIMEOUT_S, Settings

__all__ = ["main", "torchrun_args", "rank_env", "parse_hosts", "local_slots"]

_MIB = 1024 * 1024
_MULTI_HOST = ("local_slots() counts this host's slots only; torchring-run -H starts the other hosts' "
               "ranks over ssh (README, 'Several hosts with torchring-run -H')")


def _at_least(lo: float, kind: type = float) -> Any:
    """An argparse type: a number of `kind` >= lo."""
    def parse(raw: str) -> Any:
        try:
            value = kind(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {raw!r}") from None
        if not value >= lo:  # also rejects nan
            raise argparse.ArgumentTypeError(f"expected a number >= {lo:g}, got {raw!r}")
        return value
    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchring-run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-np", "--num-proc", type=int, default=None,
                   help="ranks to start on this host (default with -H/--hostfile: their slots)")
    p.add_argument("--max-restarts", type=int, default=0, help="restart the job this many times on failure")
    p.add_argument("--rank0-only", action="store_true", help="show only rank 0's output")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with the rank")
    p.add_argument("--check-build", "-cb", action="store_true", help="build the engine, say what it has, exit")
    p.add_argument("--monitor-interval", type=float, default=0.1, help="seconds between health checks of ranks")
    p.add_argument("--status", type=int, nargs="?", const=0, default=None, metavar="PID",
                   help="print the running jobs' status (or the job whose launcher is PID) and exit")
    p.add_argument("--live", type=_at_least(0.5), default=None, metavar="SECONDS",
                   help="print the ranks' status every SECONDS while the job runs, and at once on "
                        "Enter when stdin is a terminal (kill -USR1 this launcher prints it once)")
    h = p.add_argument_group("horovodrun's flags")
    h.add_argument("-H", "--hosts", default=None,
                   help="host:slots,... in rank order; other hosts start over ssh (docs/multihost_launch.md)")
    h.add_argument("-hostfile", "--hostfile", default=None, help="file of 'host slots=N' lines (as -H)")
    h.add_argument("-p", "--ssh-port", type=int, default=None, help="the other hosts' sshd port (ssh -p)")
    h.add_argument("-i", "--ssh-identity-file", default=None, help="the private key ssh logs in with (ssh -i)")
    h.add_argument("-x", "--env", action="append", default=None, metavar="NAME[=VALUE]",
                   help="NAME: give the other hosts' ranks NAME although a deny pattern matches it; "
                        "NAME=VALUE: set it for every rank (repeatable; every other variable of this "
                        "environment reaches every host already, less a deny-list: README)")
    h.add_argument("--env-deny", action="append", default=None, metavar="PATTERN",
                   help="do not give the other hosts' ranks variables matching PATTERN (shell-style, "
                        "repeatable), e.g. --env-deny 'AWS_*'")
    h.add_argument("--start-timeout", type=_at_least(1e-3), default=None,
                   help="seconds ranks wait for each other at start (sets TORCHRING_TIMEOUT, which "
                        f"also bounds any collective that makes no progress; default {DEFAULT_TIMEOUT_S:g})")
    h.add_argument("--verbose", action="store_true",
                   help="say what the launcher does; ranks log at debug level (HOROVOD_LOG_LEVEL=debug)")
    h.add_argument("--fusion-threshold-mb", type=_at_least(0), default=None,
                   help="HOROVOD_FUSION_THRESHOLD in MiB (0: no fusion)")
    h.add_argument("--cycle-time-ms", type=_at_least(0), default=None, help="HOROVOD_CYCLE_TIME")
    h.add_argument("--cache-capacity", type=_at_least(0, int), default=None, help="HOROVOD_CACHE_CAPACITY")
    h.add_argument("--timeline-filename", default=None, help="HOROVOD_TIMELINE: rank 0 writes a Chrome trace")
    h.add_argument("--timeline-mark-cycles", action="store_true", help="HOROVOD_TIMELINE_MARK_CYCLES=1")
    h.add_argument("--no-stall-check", action="store_true", help="HOROVOD_STALL_CHECK_DISABLE=1")
    h.add_argument("--stall-check-warning-time-seconds", type=_at_least(0), default=None,
                   help="HOROVOD_STALL_CHECK_TIME_SECONDS")
    h.add_argument("--stall-check-shutdown-time-seconds", type=_at_least(0), default=None,
                   help="HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")
    h.add_argument("--log-level", type=str.lower, default=None,
                   choices=("trace", "debug", "info", "warning", "error", "fatal"), help="HOROVOD_LOG_LEVEL")
    e = p.add_argument_group("elastic (horovodrun's flags; the script recovers with torchring.elastic or "
                             "hvd.elastic; torchring/launch/elastic.py)")
    e.add_argument("--min-np", type=_at_least(1, int), default=None,
                   help="fewer workers than this for --elastic-timeout seconds fail the job (default: 1)")
    e.add_argument("--max-np", type=_at_least(1, int), default=None,
                   help="never more workers than this (default: -np, or the slots)")
    e.add_argument("--host-discovery-script", default=None,
                   help="prints the hosts' slots ('node1:4' per line), polled every --discovery-interval s; "
                        "other hosts' workers start over ssh")
    e.add_argument("--discovery-interval", type=_at_least(0.1), default=1.0,
                   help="seconds between runs of the discovery script (default 1)")
    e.add_argument("--elastic-timeout", type=_at_least(0), default=600.0,
                   help="seconds the job may stay below --min-np workers before it fails (default 600)")
    h.add_argument("--gloo", dest="controller", action="store_const", const="gloo",
                   help="accepted and ignored: torchring's engine carries the collectives")
    h.add_argument("--mpi", dest="controller", action="store_const", const="mpi",
                   help="accepted and ignored: torchring's engine carries the collectives")
    h.add_argument("--network-interfaces", "--network-interface", dest="nics", action="append", default=None,
                   help="accepted; no effect on one host (set TORCHRING_ADDR across hosts)")
    p.add_argument("script", nargs="?", help="the training script (or python script.py, or a program)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments of the script")
    return p


def parse_hosts(spec: str) -> list[tuple[str, int]]:
    """[(host, slots)] of horovodrun's -H value 'host:slots,...' (a bare host has 1 slot;
    an IPv6 address with slots is written [addr]:slots)."""
    out = []
    for item in (i.strip() for i in spec.split(",")):
        if not item:
            continue
        if item.startswith("["):
            host, _, tail = item[1:].partition("]")
            slots = tail.removeprefix(":") or "1"
        elif item.count(":") == 1:
            host, slots = item.split(":")
        else:  # a bare name, or a bare IPv6 address
            host, slots = item, "1"
        if not host or not slots.isdigit() or int(slots) < 1:
            raise ValueError(f"-H {spec!r}: {item!r} is not host:slots with slots >= 1 (e.g. localhost:4)")
        out.append((host, int(slots)))
    if not out:
        raise ValueError(f"-H {spec!r}: expected host:slots,... (e.g. localhost:4)")
    return out


def _read_hostfile(path: str) -> list[tuple[str, int]]:
    """[(host, slots)] of a hostfile: 'host slots=N' per line (or host:N, or a bare host); # comments."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ValueError(f"--hostfile {path!r}: cannot read it ({error.strerror})") from None
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        match = re.fullmatch(r"slots=(\d+)", words[1]) if len(words) == 2 else None
        if len(words) == 1:
            out += parse_hosts(words[0])
        elif match and int(match.group(1)) >= 1:
            out.append((words[0], int(match.group(1))))
        else:
            raise ValueError(f"--hostfile {path!r} line {number}: {line.strip()!r} is not 'host slots=N'")
    if not out:
        raise ValueError(f"--hostfile {path!r} names no host; write 'localhost slots=4'")
    return out


def _is_this_host(host: str) -> bool:
    names = {"localhost", socket.gethostname(), socket.gethostname().split(".")[0], socket.getfqdn()}
    if host.lower() in {n.lower() for n in names}:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_slots(hosts: list[tuple[str, int]]) -> int:
    """The slots of `hosts`, which must all be this host (ValueError naming the others)."""
    others = sorted({h for h, _ in hosts if not _is_this_host(h)})
    if others:
        raise ValueError(f"-H/--hostfile names other hosts ({', '.join(others)}): {_MULTI_HOST}")
    return sum(slots for _, slots in hosts)


def rank_env(args: argparse.Namespace) -> dict[str, str]:
    """The variables the ranks get from horovodrun's flags in `args` (horovodrun's names)."""
    env: dict[str, str] = {}
    if args.fusion_threshold_mb is not None:
        env["HOROVOD_FUSION_THRESHOLD"] = str(int(args.fusion_threshold_mb * _MIB))
    pairs = [("cycle_time_ms", "HOROVOD_CYCLE_TIME"), ("cache_capacity", "HOROVOD_CACHE_CAPACITY"),
             ("timeline_filename", "HOROVOD_TIMELINE"),
             ("stall_check_warning_time_seconds", "HOROVOD_STALL_CHECK_TIME_SECONDS"),
             ("stall_check_shutdown_time_seconds", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"),
             ("log_level", "HOROVOD_LOG_LEVEL"), ("start_timeout", "TORCHRING_TIMEOUT")]
    for field, var in pairs:
        value = getattr(args, field)
        if value is not None:
            env[var] = _number(value) if isinstance(value, float) else str(value)
    if args.timeline_mark_cycles:
        env["HOROVOD_TIMELINE_MARK_CYCLES"] = "1"
    if args.no_stall_check:
        env["HOROVOD_STALL_CHECK_DISABLE"] = "1"
    if args.verbose and args.log_level is None:
        env["HOROVOD_LOG_LEVEL"] = "debug"
    return env


def _number(value: float) -> str:
    """`value` as the variable's text: 30.0 -> '30', 0.5 -> '0.5' (no precision lost)."""
    return str(int(value)) if value.is_integer() else repr(value)


_PYTHON = re.compile(r"python[0-9.]*")


def _is_python_script(path: str) -> bool:
    """An existing file torchrun should run with Python: *.py, not executable, or a python #! line."""
    if path.endswith(".py") or not os.access(path, os.X_OK):
        return True
    with open(path, "rb") as f:
        first = f.readline(200)
    return first.startswith(b"#!") and b"python" in first


def _command(script: str, rest: list[str]) -> list[str]:
    """The tail of the torchrun command line that runs `script rest...` in each rank."""
    if _PYTHON.fullmatch(os.path.basename(script)):
        own = "/" not in script or os.path.realpath(script) == os.path.realpath(sys.executable)
        while rest and rest[0] == "-u":  # torchrun runs python -u already
            rest = rest[1:]
        if own and len(rest) >= 2 and rest[0] == "-m":
            return ["--module", rest[1], *rest[2:]]
        if own and rest and not rest[0].startswith("-"):
            return rest  # python script.py ...: the launcher's interpreter runs it
        return ["--no-python", script, *rest]  # other interpreter flags, or another interpreter
    if os.path.isfile(script):
        return [script, *rest] if _is_python_script(script) else ["--no-python", script, *rest]
    if shutil.which(script):
        return ["--no-python", script, *rest]  # a program on PATH (bash, pytest, ...)
    return [script, *rest]


def torchrun_args(args: argparse.Namespace) -> list[str]:
    """The torch.distributed.run command line that carries out `args`."""
    out = ["--standalone", f"--nproc-per-node={args.num_proc}", f"--max-restarts={args.max_restarts}",
           f"--monitor-interval={args.monitor_interval}", f"--rdzv-id={uuid.uuid4().hex[:12]}"]
    return out + _command(args.script, list(args.script_args))  # output: output.rank_output(args)


def _resolve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Checks `args`; -np from -H/--hostfile's slots; notes for the flags that change nothing."""
    slots = None
    try:
        hosts = (parse_hosts(args.hosts) if args.hosts else []) + \
            (_read_hostfile(args.hostfile) if args.hostfile else [])
        args.remote_hosts = hosts if any(not _is_this_host(h) for h, _ in hosts) else []
        slots = (sum(s for _, s in hosts) if args.remote_hosts else local_slots(hosts)) if hosts else None
        if args.remote_hosts and args.max_restarts and not _elastic(args):
            raise ValueError("--max-restarts works on one host: a job across -H hosts is not restarted")
        if args.start_timeout is not None:
            Settings.from_env({"TORCHRING_TIMEOUT": _number(args.start_timeout)})
    except ValueError as error:
        parser.error(str(error))
    if args.num_proc is None:
        args.num_proc = slots
    if not args.script or not (args.num_proc or _elastic(args)):
        parser.error("give -np N (or -H localhost:N) and a script, e.g. torchring-run -np 2 python train.py")
    if args.num_proc is not None and args.num_proc < 1:
        parser.error(f"-np must be at least 1, got {args.num_proc}")
    if slots is not None and args.num_proc > slots:
        parser.error(f"-np {args.num_proc} is more than the {slots} slots of -H/--hostfile; "
                     f"raise the slots or lower -np")
    if _PYTHON.fullmatch(os.path.basename(args.script)) and not args.script_args:
        parser.error(f"give the script after {args.script}, e.g. torchring-run -np 2 python train.py")
    if args.controller:
        print(f"torchring-run: --{args.controller} ignored: torchring's own engine carries the "
              "collectives (there is no Gloo or MPI controller)", file=sys.stderr)
    if args.nics:
        print(f"torchring-run: --network-interfaces {','.join(args.nics)} has no effect: ranks on one "
              "host talk over shared memory or loopback (across hosts, TORCHRING_ADDR chooses the "
              "address)", file=sys.stderr)


def _elastic(args: argparse.Namespace) -> bool:
    return args.min_np is not None or args.max_np is not None or args.host_discovery_script is not None


def _resolve_elastic(parser: argparse.ArgumentParser, args: argparse.Namespace) -> _elastic_launch.ElasticPlan:
    """The elastic job `args` ask for: -np, --min-np, --max-np and the slots made consistent."""
    fixed: dict[str, int] | None = None
    if args.host_discovery_script is None and args.remote_hosts:
        fixed = {}
        for host, slots in args.remote_hosts:
            fixed[host] = fixed.get(host, 0) + slots
    elif args.host_discovery_script is None and args.num_proc:
        fixed = {"localhost": args.num_proc}
    max_np = args.max_np or args.num_proc or args.min_np
    if args.host_discovery_script is None and not args.num_proc:
        parser.error("give -np N (or -H localhost:N) or --host-discovery-script for an elastic job")
    if max_np is None:
        parser.error("give -np N or --max-np M with --host-discovery-script: how many workers to start")
    initial = args.num_proc or max_np
    min_np = args.min_np or 1
    if not min_np <= initial <= max_np:
        parser.error(f"elastic: need --min-np ({min_np}) <= -np ({initial}) <= --max-np ({max_np})")
    tail = _command(args.script, list(args.script_args))
    if tail[0] == "--no-python":
        argv = tail[1:]
    elif tail[0] == "--module":
        argv = [sys.executable, "-u", "-m", *tail[1:]]
    else:
        argv = [sys.executable, "-u", *tail]
    return _elastic_launch.ElasticPlan(argv, min_np, max_np, initial, replacements=args.max_restarts,
                                       discovery=args.host_discovery_script, fixed_slots=fixed,
                                       interval=args.discovery_interval, elastic_timeout=args.elastic_timeout,
                                       ssh_port=args.ssh_port, ssh_identity=args.ssh_identity_file,
                                       env_deny=tuple(args.env_deny or ()),
                                       env_keep=frozenset(_remote_env.parse_settings(args.env or ())[0]))


def _be_verbose(env: dict[str, str], command: list[str]) -> None:
    """--verbose: what the ranks get, the torchrun command, and torch's agent logging at INFO."""
    for name, value in sorted(env.items()):
        print(f"torchring-run: ranks get {name}={value}", file=sys.stderr)
    print("torchring-run: running torch.distributed.run " + shlex.join(command), file=sys.stderr)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name == "torch.distributed.run":
            logging.getLogger(name).setLevel(logging.INFO)
    if not logging.root.handlers:
        logging.basicConfig(format="torchring-run: %(name)s: %(message)s")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.check_build:
        return build.main([])
    if args.status is not None:
        return _status.query(args.status or None)
    _resolve(parser, args)
    env = rank_env(args)
    try:
        env.update(_remote_env.parse_settings(args.env or ())[1])  # -x NAME=VALUE: every rank's
    except ValueError as e:
        parser.error(str(e))
    _status.enable(env, os.environ)
    os.environ.update(env)  # torch's agent starts the ranks with this process's environment
    chosen = bool(os.environ.get(_trace_report.VARIABLE, "").strip())
    trace_dir = _trace_report.choose_directory(os.environ)
    # An elastic job's world changes: the table takes it from the ranks' newest status (0).
    world = 0 if _elastic(args) else args.num_proc or sum(n for _, n in (args.remote_hosts or []))
    job = {"pid": os.getpid(), "trace_dir": trace_dir, "world": world,
           "command": [args.script, *args.script_args]}
    _status.register(trace_dir, world, job["command"])
    _status.answer_sigusr1(job)
    keys = sys.stdin if args.live and sys.stdin is not None and sys.stdin.isatty() else None
    live = _status.LiveView(job, args.live, keys=keys).start() if args.live else None
    try:
        code = _launch(parser, args, env, trace_dir)
    finally:
        if live is not None:
            live.stop()
    if code == 0:
        report = _status.end_report(trace_dir)
        if report:
            print(report, file=sys.stderr)
        _trace_report.clean_up(trace_dir, chosen)
    return code


def _said_on_failure(code: int, trace_dir: str) -> int:
    """`code`, after printing the diagnosis of the dumps in `trace_dir` when the job failed (the
    other hosts' dumps have been relayed there by then)."""
    said = _trace_report.report(trace_dir) if code != 0 else ""
    if said:
        print(said, file=sys.stderr)
    return code


def _launch(parser: argparse.ArgumentParser, args: argparse.Namespace, env: dict[str, str], trace_dir: str) -> int:
    """Runs the job `args` ask for (elastic, several hosts, or this host) and returns its exit code."""
    if _elastic(args):  # workers supervised here: a failed one does not stop the others
        plan = _resolve_elastic(parser, args)
        plan.env.update(env)
        plan.trace_dir = trace_dir
        fixed = plan.fixed_slots or {}
        here = sum(n for h, n in fixed.items() if _is_this_host(h)) if fixed else plan.max_np
        threads = _threads.set_rank_threads(os.environ, min(plan.max_np, max(here, 1)))
        if threads:
            print(threads, file=sys.stderr)
        _build.load()
        return _said_on_failure(_elastic_launch.run(plan, _is_this_host), trace_dir)
    if args.remote_hosts:  # other hosts: one torch agent per host, over ssh
        _build.load()
        return _said_on_failure(
            _ssh_launch.launch_args(args, _is_this_host, _command(args.script, list(args.script_args))), trace_dir)
    threads = _threads.set_rank_threads(os.environ, args.num_proc)
    if threads:
        print(threads, file=sys.stderr)
    command = torchrun_args(args)
    if args.verbose:
        _be_verbose(env, command)
    _build.load()  # build once here, not in N ranks at once
    launch = torchrun.get_args_parser().parse_args(command)
    where = "" if not args.rank0_only else " if it was rank 0 (--rank0-only)"
    return _failures.run_agent(
        launch, _output.rank_output(args),
        failed=lambda what: "\n".join(filter(None, [
            f"torchring-run: the job failed: {what}; its output is above{where}", _trace_report.report(trace_dir)])),
        stopped=lambda sig: "\n".join(filter(None, [
            f"torchring-run: stopped by signal {sig}; every rank was stopped", _trace_report.report(trace_dir)])))


if __name__ == "__main__":
    sys.exit(main())
