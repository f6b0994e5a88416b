"""torchring-run's elastic mode: --min-np/--max-np, with workers supervised here, not by torch's agent.

    torchring-run --min-np 2 --max-np 4 train.py                       # as many as -H/-np allow
    torchring-run -np 3 --min-np 2 --max-np 4 --host-discovery-script ./hosts.sh train.py

The script recovers in process (torchring.elastic.run or hvd.elastic.run) and joins with
torchring.elastic.init() or hvd.init() (HOROVOD_ELASTIC=1 makes hvd.init() join as a newcomer
when the job already runs). torch's elastic agent
cannot carry such a job: when one worker fails, its agent stops every worker of its host and
restarts the whole group (torch.distributed.elastic.agent.server.SimpleElasticAgent
_invoke_run: any FAILED worker group is restarted as a unit), so survivors never get to
re-form. Here the launcher supervises the workers itself:

- The store: a TCPStore served by this process (MASTER_ADDR/MASTER_PORT of every worker,
  TORCHELASTIC_USE_AGENT_STORE=True), outside the workers, so a worker's death never takes
  the rendezvous with it.
- A worker that exits with an error, or is killed, is reported and left alone: the others go
  on (torchring.elastic re-forms their world). With --max-restarts K, up to K failed workers are
  replaced by new processes, which join as newcomers at the members' next commit.
- Slots, per host: the host discovery script (horovodrun's --host-discovery-script: prints
  "host:slots" or "host slots=N" lines), polled every --discovery-interval seconds, else
  -H/--hostfile, else -np on this host. The first -np workers start together, filling the hosts
  in order; then each host keeps its slots' worth of workers (the hosts in order, --max-np in
  all), less the slots of its failed workers not replaced (until the script reports a change):
  more slots start newcomers there; fewer, or a host gone from the list, stop its newest
  workers, which the others see as lost ranks.
- Other hosts' workers start over ssh (torchring-run -H's ssh command and options), each
  under torchring/launch/worker.py, which stops it when its lifeline closes and relays its
  status files and dumps (written on its host, in a directory of its own under the run's trace
  directory) back over ssh (relay.py), so --status, the live view, the end-of-job report and a
  failed job's diagnosis cover every host, as with -H. The workers reach
  the store at this host's address on the route to the first other host known at the start; so a job started on this host alone cannot take
  in other hosts later (the launcher says so and leaves them out).
- Fewer than --min-np workers alive, for --elastic-timeout seconds: every worker is stopped and
  the job fails, saying so.
- The job ends when its workers have exited: 0 if one of them finished its script (exit 0) after
  the last failure, else the first failure's code. Once one finished, nothing new starts, and a
  newcomer still waiting to be let in ends (exit 0) instead of waiting for members that are gone.

Output lines carry the worker's start index "[w3]: ", which unlike ranks does not change
when the world re-forms.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

from .._core import context as _context
from . import relay as _relay, remote_env as _remote_env, ssh as _ssh
from .output import prefix_chunk, whole_lines

__all__ = ["ElasticPlan", "parse_slots", "placement", "run"]


@dataclass
class ElasticPlan:
    """What torchring-run's elastic mode was asked for."""

    command: list[str]                       # argv of one worker
    min_np: int
    max_np: int
    initial_np: int
    replacements: int = 0                    # --max-restarts: failed workers that may be replaced
    discovery: str | None = None             # the host discovery script
    fixed_slots: dict[str, int] | None = None  # -H/--hostfile's (or -np's, on localhost) slots, without a script
    interval: float = 1.0                    # --discovery-interval
    elastic_timeout: float = 600.0           # --elastic-timeout
    env: dict[str, str] = field(default_factory=dict)
    ssh_port: int | None = None              # --ssh-port, for other hosts' workers
    ssh_identity: str | None = None          # --ssh-identity-file
    env_deny: tuple[str, ...] = ()           # --env-deny: not given to other hosts' workers
    env_keep: frozenset[str] = frozenset()   # -x NAME: given to them even where denied
    trace_dir: str | None = None             # the run's TORCHRING_TRACE_DIR: other hosts' files relayed here


def parse_slots(text: str) -> dict[str, int]:
    """The slots per host, in order of first mention, of a discovery script's output
    ("host:slots", "host slots=N" or "host" per line; # comments; a host named twice adds up);
    ValueError naming a line it cannot read."""
    slots_of: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        host, slots = words[0], "1"
        if len(words) == 2 and words[1].startswith("slots="):
            slots = words[1].removeprefix("slots=")
        elif len(words) == 1 and words[0].count(":") == 1:
            host, slots = words[0].split(":")
        elif len(words) != 1:
            raise ValueError(f"line {number}: {line.strip()!r} is not 'host:slots' or 'host slots=N'")
        if not slots.isdigit():
            raise ValueError(f"line {number}: {line.strip()!r}: slots must be a whole number")
        slots_of[host] = slots_of.get(host, 0) + int(slots)
    return slots_of


def placement(slots: dict[str, int], lost: dict[str, int], max_np: int) -> dict[str, int]:
    """How many workers each host keeps: its slots less its lost ones, the hosts in order, max_np in all."""
    want, left = {}, max_np
    for host, count in slots.items():
        want[host] = max(0, min(count - lost.get(host, 0), left))
        left -= want[host]
    return want


@dataclass
class _Worker:
    index: int
    host: str
    proc: subprocess.Popen
    reader: threading.Thread


def _signal(worker: _Worker, signum: int) -> None:
    """`signum` to a worker on this host; for one on another host, its lifeline closed instead
    (launch/worker.py then gives its command SIGTERM)."""
    if worker.proc.stdin is None:
        worker.proc.send_signal(signum)
        return
    try:
        worker.proc.stdin.close()
    except OSError:
        pass


class _Driver:
    """The supervision loop of one elastic job (see the module docstring)."""

    def __init__(self, plan: ElasticPlan, is_this_host: Callable[[str], bool]) -> None:
        import torch.distributed as dist  # the store's class; the launcher imports torch anyway

        self.plan, self.is_this_host = plan, is_this_host
        self.slots: dict[str, int] = dict(plan.fixed_slots or {})  # a discovery script's come in run()
        self.lost: dict[str, int] = {}  # per host: failed workers not replaced, until the script reports anew
        # A TCPStore server listens on every interface: the other hosts' workers reach it too.
        self.store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=60),
                                   wait_for_workers=False)
        self.master = "127.0.0.1"  # where the workers reach the store; set in run() once the hosts are known
        self.job = plan.env.get("TORCHRING_JOB_ID") or f"elastic-{uuid.uuid4().hex[:12]}"
        self.workers: list[_Worker] = []
        self.started = 0
        self.replacements = plan.replacements
        self.launched: dict[str, int] = {}  # the workers each host starts with
        self.first_failure: int | None = None
        self.finished = False  # a worker finished its script after the last failure: the job ends
        self.stopping: set[int] = set()  # workers stopped here (fewer slots), not failed
        self.short_since: float | None = None
        self.refused: set[str] = set()  # other hosts a job on this host alone cannot take in
        self.out_lock = threading.Lock()

    # -- workers -------------------------------------------------------------------------
    def _start(self, host: str, newcomer: bool) -> None:
        index = self.started
        self.started += 1
        here = self.is_this_host(host)
        local = sum(1 for w in self.workers if w.host == host)
        world = sum(self.launched.values())
        worker_env = {"TORCHRING_JOB_ID": self.job, "MASTER_ADDR": self.master,
                      "MASTER_PORT": str(self.store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                      "TORCHELASTIC_RESTART_COUNT": "0", "LOCAL_RANK": str(local), "RANK": str(index),
                      "TORCHRING_MIN_NP": str(self.plan.min_np), "HOROVOD_ELASTIC": "1",
                      "HOROVOD_HOSTNAME": host,
                      # A newcomer's size is a placeholder: elastic.init() finds the job running and
                      # takes the rank and size the members give it.
                      "WORLD_SIZE": str(index + 1 if newcomer else world),
                      "LOCAL_WORLD_SIZE": str(local + 1 if newcomer else self.launched.get(host, 1))}
        relayed = None
        if here:
            proc = subprocess.Popen(self.plan.command, env={**os.environ, **self.plan.env, **worker_env},
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        else:
            relay: list[str] = []
            if self.plan.trace_dir:  # its own directory there: it relays only its own files
                worker_env["TORCHRING_TRACE_DIR"] = os.path.join(self.plan.trace_dir, f"w{index}")
                relay = [f"--relay={worker_env['TORCHRING_TRACE_DIR']}"]
                relayed = _relay.Receiver(self.plan.trace_dir)
            env = {**_remote_env.remote_env({**os.environ, **self.plan.env}, self.plan.env_deny, self.plan.env_keep),
                   **worker_env}
            remote = _ssh.remote_command([sys.executable, "-u", "-m", "torchring.launch.worker", "--env-stdin", *relay,
                                          "--", *self.plan.command], _remote_env.bootstrap_env(env), os.getcwd())
            argv = _ssh.client_argv(host, remote, port=self.plan.ssh_port, identity=self.plan.ssh_identity)
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                _remote_env.send(proc.stdin, env)  # type: ignore[arg-type]
            except OSError:
                pass  # ssh is already gone: its exit code says why
        reader = threading.Thread(target=self._copy, args=(proc, f"[w{index}]: ".encode(), relayed), daemon=True)
        reader.start()
        self.workers.append(_Worker(index, host, proc, reader))
        if newcomer:
            self._say(f"started worker w{index} on {host} (pid {proc.pid}); it joins at the members' next commit")

    def _copy(self, proc: subprocess.Popen, prefix: bytes, relayed: _relay.Receiver | None) -> None:
        """Copies a worker's output, each line after `prefix`; `relayed`: the files a worker on
        another host sends in it are taken out (in whole lines) and written."""
        at_start, pending = True, b""
        out = sys.stdout.buffer
        for chunk in iter(lambda: proc.stdout.read1(65536), b""):
            if relayed is not None:
                lines, pending = whole_lines(pending + chunk)
                chunk = relayed.take(lines) if lines else b""
            if chunk:
                text, at_start = prefix_chunk(chunk, prefix, at_start)
                with self.out_lock:
                    out.write(text)
                    out.flush()
        if pending:
            with self.out_lock:
                out.write(prefix_chunk(pending, prefix, at_start)[0])
                out.flush()

    def _say(self, message: str) -> None:
        with self.out_lock:
            print(f"torchring-run: {message}", file=sys.stderr, flush=True)

    def _stop(self, worker: _Worker, why: str) -> None:
        """Stops `worker`: SIGTERM here, its lifeline closed on another host; SIGKILL 10 s later."""
        self._say(f"stopping worker w{worker.index} on {worker.host} (pid {worker.proc.pid}): {why}")
        self.stopping.add(worker.index)
        _signal(worker, signal.SIGTERM)
        try:
            worker.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            worker.proc.kill()
            worker.proc.wait()

    def _reap(self) -> None:
        for worker in list(self.workers):
            code = worker.proc.poll()
            if code is None:
                continue
            worker.reader.join(timeout=5)
            self.workers.remove(worker)
            if worker.index in self.stopping:
                continue
            if code == 0:
                self.finished = True
                # Processes still waiting to be let in end now instead of waiting for members
                # that are gone (torchring.elastic.init reads this key).
                self.store.set(_context.elastic_ended_key(self.job, 0), "1")
                continue
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
            if code == 255 and worker.proc.stdin is not None:
                how += " (ssh's own: the host or its network stopped answering, or ssh failed)"
            if self.first_failure is None:
                self.first_failure = code if code > 0 else 128 - code
            self.finished = False
            self._say(f"worker w{worker.index} on {worker.host} (pid {worker.proc.pid}) exited with {how}; the "
                      f"other {len(self.workers)} go on (torchring.elastic re-forms their world)")
            if self.replacements > 0:
                self.replacements -= 1  # _balance() starts the newcomer in its slot
            else:
                self.lost[worker.host] = self.lost.get(worker.host, 0) + 1

    # -- slots ---------------------------------------------------------------------------
    def _discover(self) -> None:
        if not self.plan.discovery:
            return
        try:
            done = subprocess.run(self.plan.discovery, shell=True, capture_output=True, text=True,
                                  timeout=max(10.0, self.plan.interval))
            if done.returncode != 0:
                raise ValueError(f"exited with code {done.returncode}: {done.stderr.strip()[:200]}")
            slots = parse_slots(done.stdout)
        except (ValueError, subprocess.TimeoutExpired) as error:
            self._say(f"host discovery script {self.plan.discovery!r}: {error}; keeping {self._show(self.slots)}")
            return
        if self.started and self.master.startswith("127."):  # launched on this host alone
            for host in [h for h in slots if not self.is_this_host(h)]:
                if host not in self.refused:
                    self._say(f"host discovery: {host} left out: the job started on this host alone, so its "
                              "workers reach the store at a loopback address; list another host from the start")
                    self.refused.add(host)
                del slots[host]
        if slots != self.slots:
            self._say(f"host discovery: {self._show(self.slots)} -> {self._show(slots)}")
            self.slots = slots
            self.lost = {}

    @staticmethod
    def _show(slots: dict[str, int]) -> str:
        return ", ".join(f"{h}:{n}" for h, n in slots.items()) or "no slots"

    def _balance(self) -> None:
        want = placement(self.slots, self.lost, self.plan.max_np)
        for worker in reversed(list(self.workers)):  # the newest first
            host_count = sum(1 for w in self.workers if w.host == worker.host)
            if host_count > want.get(worker.host, 0):
                self._stop(worker, f"{want.get(worker.host, 0)} slot(s) left for the job on {worker.host}")
                self._reap()
        # Newcomers only once the launched workers have formed the job: one started before
        # would take its placeholder rank and size for the launch's.
        if self.finished or not self.store.check([_context.elastic_running_key(self.job, 0)]):
            return
        for host, count in want.items():
            while sum(1 for w in self.workers if w.host == host) < count:
                self._start(host, newcomer=True)

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> int:
        self._discover()
        deadline = time.monotonic() + self.plan.elastic_timeout
        while min(sum(self.slots.values()), self.plan.max_np) < self.plan.min_np:
            if time.monotonic() > deadline:
                self._say(f"the job needs --min-np {self.plan.min_np} workers, and the hosts give "
                          f"{self._show(self.slots)} after {self.plan.elastic_timeout:g} s (--elastic-timeout)")
                return 1
            time.sleep(self.plan.interval)
            self._discover()
        remote = next((h for h in self.slots if not self.is_this_host(h)), None)
        if remote is not None:
            self.master = _ssh.master_address(socket.gethostname(), True, remote)
        self.launched = placement(self.slots, {}, self.plan.initial_np)
        for host, count in self.launched.items():
            for _ in range(count):
                self._start(host, newcomer=False)
        next_discovery = time.monotonic() + self.plan.interval
        while self.workers:
            time.sleep(0.1)
            self._reap()
            if time.monotonic() >= next_discovery:
                self._discover()
                next_discovery = time.monotonic() + self.plan.interval
            if self.finished:
                continue
            self._balance()
            if len(self.workers) < self.plan.min_np:
                self.short_since = self.short_since or time.monotonic()
                if time.monotonic() - self.short_since > self.plan.elastic_timeout:
                    for worker in list(self.workers):
                        self._stop(worker, "too few workers")
                    self._say(f"the job failed: {len(self.workers)} worker(s) alive, fewer than --min-np "
                              f"{self.plan.min_np}, for {self.plan.elastic_timeout:g} s (--elastic-timeout); "
                              "add hosts through the discovery script, or lower --min-np")
                    return self.first_failure or 1
            else:
                self.short_since = None
        if self.finished:
            return 0
        self._say("the job failed: every worker exited, none finished its script")
        return self.first_failure or 1

    def stop_all(self, signum: int) -> None:
        for worker in self.workers:
            _signal(worker, signum)
        for worker in self.workers:
            try:
                worker.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                worker.proc.kill()


def run(plan: ElasticPlan, is_this_host: Callable[[str], bool]) -> int:
    """Runs the elastic job `plan` to its end; the exit code (see the module docstring)."""
    driver = _Driver(plan, is_this_host)

    def on_signal(signum: int, frame: Any) -> None:
        driver._say(f"stopped by signal {signal.Signals(signum).name}; stopping every worker")
        driver.stop_all(signum)
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return driver.run()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        deadline = time.monotonic() + 10  # stopped: their last output and relayed files, in full
        for worker in driver.workers:
            worker.reader.join(timeout=max(0.0, deadline - time.monotonic()))
