"""Simulated hosts for multi-host tests: one network, UTS, IPC, PID and mount namespace each.

    with hosts(3, rate="1gbit") as hs:
        p = hs[1].popen([sys.executable, "-c", "import socket; print(socket.gethostname())"])

Layout (every name starts with ``trt<test pid>-<n>``, so leftovers of a dead run are found):
- a "switch" network namespace holding a bridge; host i's cable is a veth pair whose one end
  (``eth0``) lives in host i's network namespace and whose other end is a bridge port in the
  switch. The machine's own network namespace is never touched.
- with ``latency_us=D``, the switch holds no bridge but a userspace router (latency_router.c,
  compiled once per version of its source into /var/tmp; _latency.py runs it, ``Host.router``),
  which holds every packet from one host to another for D microseconds: the kernel here has no
  netem, and so torchring, gloo and Open MPI all pay the same delay. The router creates one TUN
  device per host, which is moved into the host as ``eth0`` (point-to-point, no ARP, MTU 65000 so
  that packets are few and large; its /24 routes the other hosts through it); it reads the IPv4
  packets each host sends and writes them, D later, to the destination's device. A round trip
  takes 2*D plus the routing's own cost (on a 2-vCPU virtual machine, a median of 75-150 us at
  D = 0 against 50 us over veth). ``Host.link(False)`` has the router turn the host's carrier off
  and drop its packets both ways (``eth0`` stays up, as when a cable is pulled at the switch);
  ``Host.link(True)`` undoes it.
- host i: address ``198.18.<k>.<i+1>/24`` (198.18.0.0/15, the benchmarking range; ``k`` differs
  per fixture), loopback up, no default route, so nothing but loopback and the other test hosts
  is reachable. Hostname ``trh<i>``; a generated ``/etc/hosts`` names every host (and an empty
  ``/etc/resolv.conf`` keeps resolvers off the network); private tmpfs on ``/tmp`` and
  ``/dev/shm``; its own PID namespace, whose init (the "anchor", a sleeping process) holds the
  namespaces: killing it kills every process of the host.
- ``shared``: a directory visible at the same path to the test and to every host (the test's own
  ``/tmp`` is not: it is private per host). By default a fresh directory under ``/var/tmp``,
  removed at teardown; a caller's directory (e.g. pytest's ``tmp_path``) is bind-mounted into
  each host at the same path and left in place. Every ``Host.shared`` names it. This checkout,
  the interpreter's environment and ``TORCHRING_CACHE_DIR`` are bind-mounted back the same way
  when they live under ``/tmp`` (a CI checkout may).

Teardown (kill anchors and the router, delete namespaces) runs however the block is left; at
entry, namespaces left by test processes that no longer exist are deleted. Where namespaces cannot be made (not
root, no ``ip``/``unshare``/``nsenter``; for ``latency_us``, no /dev/net/tun or no C compiler),
``hosts()`` skips the test and says why.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Iterator

import pytest

from _latency import TUN_MTU, Router, can_route, router_binary

__all__ = ["Host", "hosts", "can_make_hosts", "parse_rate", "tbf_burst", "host_addr", "hosts_file"]

_PREFIX = "trt"
_counter = itertools.count()
_NS_RE = re.compile(rf"^{_PREFIX}(\d+)-\d+-(?:sw|h\d+)$")


class Host:
    """One simulated host: run commands in it, pull its cable, kill it."""

    def __init__(self, index: int, name: str, addr: str, netns: str, switch: str, port: str,
                 anchor: subprocess.Popen, anchor_pid: int, shared: str,
                 router: Router | None = None) -> None:
        self.index, self.name, self.addr = index, name, addr
        self.netns, self._switch, self._port, self.router = netns, switch, port, router
        self._anchor, self.anchor_pid, self.shared = anchor, anchor_pid, shared
        self._pidns = os.readlink(f"/proc/{anchor_pid}/ns/pid")

    def __repr__(self) -> str:
        return f"Host({self.index}, {self.name!r}, {self.addr!r})"

    def nsenter_prefix(self) -> list[str]:
        """The argv prefix that runs a command in this host (an "rsh agent" for launchers)."""
        return ["nsenter", f"--target={self.anchor_pid}", "--net", "--uts", "--ipc", "--pid",
                "--mount"]

    def popen(self, argv: list[str], env: dict | None = None, cwd: str | None = None,
              **popen_kwargs) -> subprocess.Popen:
        """Start ``argv`` in this host (env: a copy of os.environ by default; cwd: a shared path)."""
        prefix = self.nsenter_prefix() + ([f"--wd={cwd}"] if cwd else [])
        return subprocess.Popen(prefix + list(argv), env=dict(os.environ if env is None else env),
                                **popen_kwargs)

    def run(self, argv: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` in this host to completion (``kw`` as for subprocess.run, env/cwd as popen)."""
        env, cwd = kw.pop("env", None), kw.pop("cwd", None)
        prefix = self.nsenter_prefix() + ([f"--wd={cwd}"] if cwd else [])
        return subprocess.run(prefix + list(argv), env=dict(os.environ if env is None else env),
                              timeout=timeout, **kw)

    def link(self, up: bool) -> None:
        """Plug (True) or pull (False) this host's cable: its port on the switch goes up/down (with
        latency_us, the router turns its carrier on/off and passes/drops its packets)."""
        if self.router is not None:
            self.router.link(self.index, up)
        else:
            _ip("-n", self._switch, "link", "set", self._port, "up" if up else "down")

    def shape(self, rate: str) -> None:
        """Limit what this host sends to ``rate`` (tc on its ``eth0``): one link slower than the others."""
        parse_rate(rate)
        why = _shape(self.netns, "eth0", rate)
        if why:
            pytest.fail(f"could not shape {self.name}'s link to {rate}: {why}")

    def pids(self) -> list[int]:
        """Machine-side pids of this host's processes, the anchor (its PID 1) excluded."""
        out = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != self.anchor_pid:
                try:
                    if os.readlink(f"/proc/{entry}/ns/pid") == self._pidns:
                        out.append(int(entry))
                except OSError:
                    pass
        return sorted(out)

    def signal_all(self, sig: int) -> list[int]:
        """Send ``sig`` to every process of this host but the anchor; returns their pids."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids

    def kill_all(self) -> None:
        """Kill the host: SIGKILL its PID namespace's init, which takes every process with it."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.anchor_pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._anchor.wait(timeout=10)

    @property
    def alive(self) -> bool:
        """Whether the host's anchor still runs."""
        return self._anchor.poll() is None


def parse_rate(rate: str) -> int:
    """Bits per second of a tc-style rate ("1gbit", "500mbit", "100kbit", "10000bit")."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)bit\s*", rate.lower())
    if not m:
        raise ValueError(f"rate {rate!r}: expected a number and kbit, mbit, gbit or bit, e.g. '1gbit'")
    return int(float(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2)])


def host_addr(k: int, i: int) -> str:
    """Host i's address in fixture number k: 198.18.0.0/15 only (k < 512, i < 254)."""
    if not (0 <= k < 512 and 0 <= i < 254):
        raise ValueError(f"host_addr({k}, {i}): expected 0 <= k < 512 and 0 <= i < 254")
    return f"198.{18 + k // 256}.{k % 256}.{i + 1}"


def hosts_file(names: list[str], addrs: list[str]) -> str:
    """/etc/hosts text: localhost, then one line per test host."""
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    lines += [f"{a}\t{n}" for n, a in zip(names, addrs)]
    # Dual-stack servers (torch's TCPStore) see peers as ::ffff:a.b.c.d and look those up.
    lines += [f"::ffff:{a}\t{n}" for n, a in zip(names, addrs)]
    return "\n".join(lines) + "\n"


def can_make_hosts() -> str | None:
    """None if namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "test hosts need root (network namespaces, veth, bridge, mounts)"
    missing = [t for t in ("ip", "unshare", "nsenter") if shutil.which(t) is None]
    if missing:
        return f"test hosts need {', '.join(missing)} (Debian: apt-get install iproute2 util-linux)"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _netns_pids(ns: str) -> list[int]:
    r = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []


def _delete_netns(ns: str) -> None:
    for pid in _netns_pids(ns):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _ip("netns", "del", ns, check=False)


def _remove_leftovers() -> None:
    """Delete namespaces and state dirs of test processes that are gone."""
    r = _ip("netns", "list", check=False)
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NS_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _delete_netns(name)
    for entry in os.listdir("/var/tmp"):
        m = re.fullmatch(rf"{_PREFIX}(\d+)-\d+", entry)
        if m and not _pid_alive(int(m.group(1))):
            _unmount_under(os.path.join("/var/tmp", entry))
            shutil.rmtree(os.path.join("/var/tmp", entry), ignore_errors=True)


def _unmount_under(path: str) -> None:
    with open("/proc/self/mounts") as f:
        points = [line.split()[1] for line in f]
    for p in sorted(points, reverse=True):
        if p == path or p.startswith(path + "/"):
            subprocess.run(["umount", "-l", p], capture_output=True)


def tbf_burst(rate_bits: int, min_burst: int = 32 * 1024) -> int:
    """The bucket, in bytes, of the tbf that ``Host.shape`` puts on a link of ``rate_bits``: at
    least one timer tick (4 ms at HZ=250) of bytes (tbf drops packets larger than its burst). After a
    pause this many bytes leave at the unshaped speed (benchmarks/_scale_sim.py models it)."""
    return max(min_burst, rate_bits // 8 // 250)


def _shape(netns: str, dev: str, rate: str, min_burst: int = 32 * 1024) -> str | None:
    """Limit ``dev`` to ``rate`` with tbf (or netem rate); None if done, else why not."""
    burst = tbf_burst(parse_rate(rate), min_burst)
    tries = [["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"], ["netem", "rate", rate]]
    errors = []
    for qdisc in tries:
        r = _ip("netns", "exec", netns, "tc", "qdisc", "replace", "dev", dev, "root", *qdisc,
                check=False)
        if r.returncode == 0:
            return None
        errors.append(f"{qdisc[0]}: {r.stderr.strip()}")
    return "; ".join(errors)


_ANCHOR = r"""
set -e
hostname "$1"
mount --make-rprivate /
mount --bind /tmp "$2/oldtmp"
mount -t tmpfs -o mode=1777 tmpfs /tmp
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount --bind "$2/hosts" /etc/hosts
mount --bind "$2/resolv.conf" /etc/resolv.conf
host="$1"; dir="$2"; shift 2
for keep in "$@"; do  # the shared directory, the checkout, the interpreter, the engine cache
  case "$keep" in
    /tmp/*) mkdir -p "$keep"; mount --bind "$dir/oldtmp/${keep#/tmp/}" "$keep" ;;
  esac
done
umount -l "$dir/oldtmp"
echo ready
exec sleep infinity
"""


def _kept_visible(shared: str) -> list[str]:
    """Paths every host must see although its /tmp is private (those under /tmp are bind-mounted
    back): the shared directory, this checkout, the interpreter's environment and the engine's
    build cache (a CI checkout or TORCHRING_CACHE_DIR may well live under /tmp), parents first."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = {shared, repo, sys.prefix, os.path.realpath(sys.prefix)}
    if os.environ.get("TORCHRING_CACHE_DIR"):
        paths.add(os.path.abspath(os.environ["TORCHRING_CACHE_DIR"]))
    return sorted((p for p in paths if os.path.isdir(p)), key=len)


@contextlib.contextmanager
def hosts(n: int, rate: str | None = None, shared: str | None = None,
          latency_us: int | None = None) -> Iterator[list[Host]]:
    """Make ``n`` hosts joined by a switch (links shaped to ``rate``, each hop delayed by
    ``latency_us`` microseconds, if given); tear down on exit."""
    why = can_make_hosts() or (can_route() if latency_us is not None else None)
    if why:
        pytest.skip(why)
    if not 1 <= n <= 253:
        raise ValueError(f"hosts({n}): expected 1 to 253 hosts")
    if rate is not None:
        parse_rate(rate)
    if latency_us is not None:
        if not 0 <= latency_us <= 10**7:
            raise ValueError(f"hosts(latency_us={latency_us}): expected 0 to 10**7 microseconds")
        router_binary()  # compiled here: a compiler's error fails the test, it does not skip it
    _remove_leftovers()
    seq = next(_counter)
    tag = f"{_PREFIX}{os.getpid()}-{seq}"
    k = (os.getpid() * 7 + seq) % 512
    state = os.path.join("/var/tmp", tag)
    os.makedirs(state)
    shared = os.path.abspath(shared or os.path.join(state, "shared"))
    os.makedirs(shared, exist_ok=True)
    switch = f"{tag}-sw"
    made: list[str] = []
    anchors: list[subprocess.Popen] = []
    out: list[Host] = []
    router: Router | None = None
    try:
        try:
            _ip("netns", "add", switch)
            made.append(switch)
            names = [f"trh{i}" for i in range(n)]
            addrs = [host_addr(k, i) for i in range(n)]
            if latency_us is None:
                _ip("-n", switch, "link", "add", "br0", "type", "bridge")
                _ip("-n", switch, "link", "set", "br0", "up")
            else:
                router = Router(switch, latency_us, addrs, os.path.join(state, "router.log"))
            notes = []
            for i in range(n):
                ns, port = f"{tag}-h{i}", f"p{i}"
                _ip("netns", "add", ns)
                made.append(ns)
                if router is None:
                    _ip("-n", switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                        "netns", ns)
                    _ip("-n", switch, "link", "set", port, "master", "br0", "up")
                else:  # the router keeps the device's fd; the /24 routes the other hosts through it
                    _ip("-n", switch, "link", "set", router.device(i), "netns", ns, "name", "eth0")
                    _ip("-n", ns, "link", "set", "eth0", "mtu", str(TUN_MTU))
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "addr", "add", f"{addrs[i]}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                if rate is not None:
                    burst = 32 * 1024 if router is None else 2 * TUN_MTU
                    note = _shape(ns, "eth0", rate, min_burst=burst)
                    if note:
                        notes.append(f"trh{i}: {note}")
            if notes:
                print(f"hosts(): links not shaped to {rate} (the kernel refused): " + "; ".join(notes))
            for i in range(n):
                hdir = os.path.join(state, f"h{i}")
                os.makedirs(os.path.join(hdir, "oldtmp"))
                with open(os.path.join(hdir, "hosts"), "w") as f:
                    f.write(hosts_file(names, addrs))
                open(os.path.join(hdir, "resolv.conf"), "w").close()
                anchor = subprocess.Popen(
                    ["ip", "netns", "exec", f"{tag}-h{i}", "unshare", "--uts", "--ipc", "--pid",
                     "--mount", "--fork", "--kill-child=SIGKILL", "--mount-proc",
                     "--propagation", "private",
                     "sh", "-c", _ANCHOR, "anchor", names[i], hdir, *_kept_visible(shared)],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                    text=True, start_new_session=True, preexec_fn=_die_with_parent)
                anchors.append(anchor)
                line = anchor.stdout.readline()
                if line.strip() != "ready":
                    anchor.kill()
                    raise RuntimeError(f"host trh{i} did not start: {line}{anchor.stderr.read()}")
                pid = _child_of(anchor.pid)
                out.append(Host(i, names[i], addrs[i], f"{tag}-h{i}", switch, f"p{i}", anchor, pid,
                                shared, router))
        except RuntimeError as e:  # a kernel or tool that refuses (no bridge, no mounts, ...)
            pytest.skip(f"cannot build test hosts here: {e}")
        yield out
    finally:
        for a in anchors:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(a.pid, signal.SIGKILL)  # unshare and, with it gone, nothing else
        for h in out:
            with contextlib.suppress(ProcessLookupError):
                os.kill(h.anchor_pid, signal.SIGKILL)
        for a in anchors:
            with contextlib.suppress(subprocess.TimeoutExpired):
                a.wait(timeout=10)
            a.stdout.close()
            a.stderr.close()
        if router is not None:
            router.stop()
        for ns in reversed(made):
            _delete_netns(ns)
        _unmount_under(state)
        shutil.rmtree(state, ignore_errors=True)  # a caller's ``shared`` lies elsewhere: kept


def _die_with_parent() -> None:
    """In the anchor's unshare: SIGKILL when the test process dies (unshare then kills its child,
    the host's init, so a killed test run leaves no process behind, only namespaces)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _child_of(ppid: int, timeout: float = 10.0) -> int:
    """The pid of ``ppid``'s (only) child: unshare's forked child, the new PID namespace's init."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{ppid}/task/{ppid}/children") as f:
                kids = f.read().split()
            if kids:
                return int(kids[0])
        except FileNotFoundError:
            for entry in os.listdir("/proc"):
                if entry.isdigit():
                    with contextlib.suppress(OSError):
                        with open(f"/proc/{entry}/stat") as f:
                            if int(f.read().rsplit(")", 1)[1].split()[1]) == ppid:
                                return int(entry)
        time.sleep(0.01)
    raise RuntimeError(f"no child of pid {ppid} after {timeout} s (the host's anchor)")
