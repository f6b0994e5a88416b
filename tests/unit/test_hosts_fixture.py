"""The simulated-host fixture (tests/support/_hosts.py): its pure helpers (rates, addresses,
/etc/hosts) and, where root can make namespaces and TUN devices, its latency mode."""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import statistics
import subprocess
import sys

import pytest

from _hosts import Host, host_addr, hosts, hosts_file, parse_rate
from _latency import TUN_MTU, forwarding_cost


@pytest.mark.parametrize("text, bits", [("1gbit", 10**9), ("500mbit", 5 * 10**8),
                                        ("2.5Gbit", 25 * 10**8), ("100kbit", 10**5),
                                        ("8000bit", 8000)])
def test_parse_rate(text: str, bits: int) -> None:
    assert parse_rate(text) == bits


@pytest.mark.parametrize("bad", ["1gb", "fast", "", "1 gbps", "-1mbit"])
def test_parse_rate_refuses(bad: str) -> None:
    with pytest.raises(ValueError, match="expected a number"):
        parse_rate(bad)


def test_addresses_stay_in_the_benchmarking_range_and_differ() -> None:
    net = ipaddress.ip_network("198.18.0.0/15")
    seen = set()
    for k in (0, 1, 255, 256, 511):
        for i in (0, 1, 252, 253):
            a = ipaddress.ip_address(host_addr(k, i))
            assert a in net, a
            assert not str(a).endswith((".0", ".255")), a
            seen.add(a)
    assert len(seen) == 20
    for k, i in ((512, 0), (-1, 0), (0, 254)):
        with pytest.raises(ValueError):
            host_addr(k, i)


def test_hosts_file_names_every_host_once() -> None:
    text = hosts_file(["trh0", "trh1"], ["198.18.3.1", "198.18.3.2"])
    lines = [line.split() for line in text.splitlines()]
    assert ["198.18.3.1", "trh0"] in lines and ["198.18.3.2", "trh1"] in lines
    assert ["127.0.0.1", "localhost"] in lines
    assert ["::ffff:198.18.3.2", "trh1"] in lines  # how a dual-stack server sees the peer
    assert sum("trh1" in line for line in lines) == 2


# --- hosts(n, latency_us=D): each hop through the router (tests/support/latency_router.c) takes D.
# These need root, namespaces and /dev/net/tun; hosts() skips them where those are missing.

D_US = 200
# Measured on a shared 2-vCPU virtual machine: the routed path alone (D = 0) had median round trips
# of 25 to 150 us (veth: 20 to 50), and D = 200 medians of 2*D + 70 to 2*D + 200 us; the more idle
# the machine, the slower its virtual CPUs wake. No round trip can beat 2*D.
SLACK_US = 300
_TRANSFER = r"""
import socket, sys, time
pattern = bytes(range(256)) * 4096
if sys.argv[1] == "serve":
    n = int(sys.argv[3])
    srv = socket.create_server((sys.argv[2], 5201))
    print("listening", flush=True)
    conn, _ = srv.accept()
    buf, got, intact = bytearray(len(pattern)), 0, True
    while got < n:
        k = conn.recv_into(memoryview(buf)[: len(pattern) - got % len(pattern)])
        if k == 0:
            break
        intact = intact and buf[:k] == pattern[got % len(pattern):got % len(pattern) + k]
        got += k
    conn.sendall(b"!")
    print(got, intact, flush=True)
else:
    addr, n = sys.argv[2], int(sys.argv[3])
    conn = socket.create_connection((addr, 5201))
    start = time.monotonic()
    for off in range(0, n, len(pattern)):
        conn.sendall(pattern[: min(len(pattern), n - off)])
    conn.recv(1)
    print(time.monotonic() - start, flush=True)
"""


def _need_ping() -> None:
    """Skip unless ping exists."""
    if shutil.which("ping") is None:
        pytest.skip("the latency tests need ping (Debian: apt-get install iputils-ping)")


def _ping_us(src: Host, dst: Host, count: int = 20) -> list[float]:
    """Round-trip times (us) of ``count`` pings from src to dst, 10 ms apart."""
    r = src.run(["ping", "-n", "-c", str(count), "-i", "0.01", dst.addr], timeout=30,
                capture_output=True, text=True)
    times = [float(t) * 1000 for t in re.findall(r"time=([\d.]+) ms", r.stdout)]
    assert len(times) == count, f"ping {src.name} -> {dst.name} lost replies:\n{r.stdout}{r.stderr}"
    return times


def _check_rtts(times: list[float], what: str) -> None:
    """No round trip beats 2*D, and the median lies between 2*D and 2*D + SLACK_US."""
    median = statistics.median(times)
    assert min(times) >= 2 * D_US, f"{what}: a round trip took {min(times):.0f} us < 2*D: {times}"
    assert 2 * D_US <= median <= 2 * D_US + SLACK_US, f"{what}: median {median:.0f} us: {times}"


def _transfer(src: Host, dst: Host, nbytes: int) -> float:
    """Send ``nbytes`` of a known pattern over TCP from src to dst; returns bits per second."""
    server = dst.popen([sys.executable, "-c", _TRANSFER, "serve", dst.addr, str(nbytes)],
                       stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "listening"
        r = src.run([sys.executable, "-c", _TRANSFER, "send", dst.addr, str(nbytes)], timeout=60,
                    capture_output=True, text=True)
        assert r.returncode == 0, f"the sender on {src.name} failed: {r.stderr}"
        got, intact = server.stdout.readline().split()
        assert (int(got), intact) == (nbytes, "True"), \
            f"{dst.name} received {got} of {nbytes} bytes, intact: {intact}"
        return nbytes * 8 / float(r.stdout)
    finally:
        server.kill()
        server.wait()
        server.stdout.close()


def test_latency_round_trips_take_twice_the_delay() -> None:
    _need_ping()
    with hosts(2, latency_us=D_US) as hs:
        _check_rtts(_ping_us(hs[0], hs[1]), "trh0 -> trh1")
        _check_rtts(_ping_us(hs[1], hs[0]), "trh1 -> trh0")


def test_latency_four_hosts_pinging_at_once() -> None:
    _need_ping()
    with hosts(4, latency_us=D_US) as hs:
        pings = [hs[i].popen(["ping", "-n", "-c", "20", "-i", "0.01", hs[(i + 1) % 4].addr],
                             stdout=subprocess.PIPE, text=True) for i in range(4)]
        for i, p in enumerate(pings):
            out = p.communicate(timeout=30)[0]
            times = [float(t) * 1000 for t in re.findall(r"time=([\d.]+) ms", out)]
            assert len(times) == 20, f"trh{i} -> trh{(i + 1) % 4} lost replies:\n{out}"
            _check_rtts(times, f"trh{i} -> trh{(i + 1) % 4}")


def test_latency_tcp_arrives_intact() -> None:
    with hosts(2, latency_us=D_US) as hs:
        before = hs[0].router.stats()
        bps = _transfer(hs[0], hs[1], 32 << 20)
        assert bps > 200e6, f"32 MiB through the router at {bps / 1e6:.0f} Mbit/s"
        # The router timed what it forwarded: at least the 32 MiB in packets of at most the MTU,
        # each holding its thread up for some time (a + b * bytes).
        a, b, packets = forwarding_cost(before, hs[0].router.stats())
        assert packets >= (32 << 20) // TUN_MTU and a > 0 and b >= 0, (a, b, packets)
        assert a + b * TUN_MTU < 0.01, f"{(a + b * TUN_MTU) * 1e6:.0f} us to forward one packet"


def test_forwarding_cost_is_the_slower_stages_line() -> None:
    def sums(d: str, points: list[tuple[int, int]]) -> dict[str, int]:
        return {f"{d}_n": len(points), f"{d}_len": sum(x for x, _ in points), f"{d}_ns": sum(t for _, t in points),
                f"{d}_len2": sum(x * x for x, _ in points), f"{d}_len_ns": sum(x * t for x, t in points)}

    sizes = [100, 1500, 65000]
    slow_writes = {**sums("read", [(x, 1000 + x // 2) for x in sizes]), **sums("write", [(x, 5000 + x) for x in sizes])}
    zero = {k: 0 for k in slow_writes}
    a, b, packets = forwarding_cost(zero, slow_writes)
    assert packets == 3 and abs(a - 5e-6) < 1e-12 and abs(b - 1e-9) < 1e-15, (a, b)
    # Reads the slower at the mean packet (22200 bytes): theirs, though their fixed part is less.
    slow_reads = {**sums("read", [(x, 1000 + 2 * x) for x in sizes]), **sums("write", [(x, 5000 + x) for x in sizes])}
    a, b, _ = forwarding_cost(zero, slow_reads)
    assert abs(a - 1e-6) < 1e-12 and abs(b - 2e-9) < 1e-15, (a, b)
    assert forwarding_cost(zero, zero) == (0.0, 0.0, 0)  # nothing forwarded: no cost to tell


def test_latency_with_rate_still_shapes() -> None:
    with hosts(2, rate="200mbit", latency_us=D_US) as hs:
        bps = _transfer(hs[0], hs[1], 32 << 20)
        assert 160e6 <= bps <= 240e6, f"rate 200mbit, measured {bps / 1e6:.0f} Mbit/s"


def test_latency_link_down_stops_traffic_and_up_restores_it() -> None:
    _need_ping()

    def reaches(src: Host, dst: Host, within: int) -> bool:
        """Whether a ping (one every 0.1 s) gets through within ``within`` seconds."""
        argv = ["ping", "-n", "-c", "1", "-i", "0.1", "-w", str(within), dst.addr]
        return src.run(argv, timeout=30, capture_output=True).returncode == 0

    with hosts(2, latency_us=D_US) as hs:
        assert reaches(hs[0], hs[1], 3)
        hs[1].link(False)
        assert not reaches(hs[0], hs[1], 1) and not reaches(hs[1], hs[0], 1)
        assert hs[1].router.stats()["dropped_down"] > 0
        hs[1].link(True)  # the host's kernel applies a carrier change within a second
        assert reaches(hs[0], hs[1], 3) and reaches(hs[1], hs[0], 3)


def test_latency_teardown_leaves_nothing() -> None:
    with hosts(2, latency_us=D_US) as hs:
        router = hs[0].router
        names = [h.netns for h in hs] + [hs[0]._switch]
        assert os.path.exists(f"/proc/{router.pid}")
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [n for n in names if n in left.split()], left
    assert not os.path.exists(f"/proc/{router.pid}"), "the router outlived its hosts"
