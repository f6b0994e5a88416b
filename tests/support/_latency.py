"""Link latency for the simulated hosts (``hosts(n, latency_us=D)`` in _hosts.py): the userspace
router of latency_router.c, compiled once per version of its source and run in the switch namespace.

netem would add the delay in tc, but kernels without it exist (this project's test machines among
them); the router adds it in userspace instead, so torchring, gloo and Open MPI all pay it alike.
It owns one TUN device per host; the fixture moves each into its host as ``eth0``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import select
import shutil
import signal
import subprocess
import time

__all__ = ["Router", "can_route", "forwarding_cost", "router_binary", "ROUTER_SOURCE", "TUN_MTU"]

ROUTER_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "latency_router.c")
# Large packets: few of them per byte, so the router's per-packet cost (two syscalls) stays small.
TUN_MTU = 65000


def forwarding_cost(before: dict[str, int], after: dict[str, int]) -> tuple[float, float, int]:
    """How long the router's one thread holds each packet of n bytes up, a + b * n (seconds,
    seconds per byte), from two ``Router.stats()`` taken around some traffic; and the packets.

    latency_router.c times every read() and write(); here each gets its least-squares line. A
    packet is read when it comes and written D later, so a burst's reads and writes pipeline
    across the wire delay: the last packet of k leaves about k times the slower stage's time
    after the first. That stage's line (the one costlier at the mean packet size) is the answer.
    """
    lines = []
    for d in ("read", "write"):
        n, x, t, xx, xt = (after[f"{d}_{k}"] - before[f"{d}_{k}"] for k in ("n", "len", "ns", "len2", "len_ns"))
        if n == 0:
            return 0.0, 0.0, 0
        spread = n * xx - x * x
        slope = max((n * xt - x * t) / spread if spread > 0 else 0.0, 0.0)  # a falling line is noise
        a = max((t - slope * x) / n, 0.0)
        lines.append((a + slope * x / n, a * 1e-9, slope * 1e-9))
    _, a, b = max(lines)
    return a, b, after["write_n"] - before["write_n"]


def can_route() -> str | None:
    """None if the router can run here, else why not."""
    if not os.path.exists("/dev/net/tun"):
        return "hosts(latency_us=...) needs TUN devices: /dev/net/tun is missing (modprobe tun)"
    if shutil.which("cc") is None:
        return ("hosts(latency_us=...) compiles tests/support/latency_router.c and needs a C "
                "compiler (Debian: apt-get install gcc)")
    return None


def router_binary() -> str:
    """The compiled router (cc -O2), built once per version of its source under /var/tmp."""
    with open(ROUTER_SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    path = f"/var/tmp/trt-latency-router-{digest}"
    if os.access(path, os.X_OK):
        return path
    tmp = f"{path}.{os.getpid()}.tmp"
    r = subprocess.run(["cc", "-O2", "-Wall", "-o", tmp, ROUTER_SOURCE], capture_output=True,
                       text=True, timeout=300)
    if r.returncode != 0:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise RuntimeError(f"cc -O2 {ROUTER_SOURCE} failed ({r.returncode}); fix the source or the "
                           f"compiler:\n{r.stdout}{r.stderr}")
    os.replace(tmp, path)  # atomic: concurrent test sessions may build it at once
    return path


class Router:
    """The running router: TUN device ``t<i>`` per host i, created in ``netns`` (the switch)."""

    def __init__(self, netns: str, delay_us: int, addrs: list[str], log: str,
                 priority: int = 1) -> None:
        # SCHED_FIFO (priority > 0): the hosts' busy processes must not hold the packets up
        argv = ["ip", "netns", "exec", netns, router_binary(), "-p", str(priority), str(delay_us)]
        argv += [f"{self.device(i)}={a}" for i, a in enumerate(addrs)]
        self._log = log
        with open(log, "wb") as err:
            self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=err, bufsize=0)
        try:
            line = self._readline(10.0)
        except RuntimeError:
            self.stop()
            raise
        if line != "ready":
            self.stop()
            raise RuntimeError(f"the latency router did not start ({line!r}): {self.log_text()}")

    @property
    def pid(self) -> int:
        """The router's process id."""
        return self._proc.pid

    @staticmethod
    def device(i: int) -> str:
        """The name of host i's TUN device in the switch namespace (before it moves)."""
        return f"t{i}"

    def log_text(self) -> str:
        """What the router wrote on stderr ("" once the fixture's state directory is gone)."""
        try:
            with open(self._log, errors="replace") as f:
                return f.read().strip()
        except FileNotFoundError:
            return ""

    def _readline(self, timeout: float) -> str:
        """One line of the router's stdout, without its newline."""
        deadline, data = time.monotonic() + timeout, b""
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._proc.stdout], [], [], left)[0]:
                raise RuntimeError(f"the latency router did not answer in {timeout} s: "
                                   f"{self.log_text()}")
            chunk = os.read(self._proc.stdout.fileno(), 1)
            if not chunk:
                raise RuntimeError(f"the latency router exited ({self._proc.poll()}): "
                                   f"{self.log_text()}")
            data += chunk
        return data.decode().strip()

    def command(self, line: str) -> str:
        """Send one control line ("up I", "down I", "stats"); returns the router's answer."""
        self._proc.stdin.write(line.encode() + b"\n")
        return self._readline(10.0)

    def link(self, i: int, up: bool) -> None:
        """Plug (True) or pull (False) host i's cable: carrier on/off, packets passed/dropped."""
        answer = self.command(f"{'up' if up else 'down'} {i}")
        if answer != "ok":
            raise RuntimeError(f"the latency router refused to set host {i}'s link: {answer}")

    def stats(self) -> dict[str, int]:
        """The router's packet counters (rx, tx, dropped_full, unroutable, dropped_down, ...)."""
        words = self.command("stats").split()
        return {k: int(v) for k, v in zip(words[::2], words[1::2])}

    def cpu_seconds(self) -> float:
        """User plus system CPU time the router has used."""
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        """End the router (SIGTERM, then SIGKILL); its TUN devices vanish with it."""
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
        for pipe in (self._proc.stdin, self._proc.stdout):
            with contextlib.suppress(OSError):
                pipe.close()
