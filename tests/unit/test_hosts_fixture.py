"""The pure helpers of the simulated-host fixture (tests/support/_hosts.py): rates, addresses, /etc/hosts."""

from __future__ import annotations

import ipaddress

import pytest

from _hosts import host_addr, hosts_file, parse_rate


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
