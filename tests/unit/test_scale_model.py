"""The scale model's simulator (benchmarks/_scale_sim.py) on cases small enough to time by hand:
one message costs s + D + n/B; a ring of 4 hosts with nothing shared equals the cost model's
closed form; a small Doubling allreduce rides on a header exchange of Doubling's shape, Radix4
and Multiplying on one of Multiplying's (groups of three at once); two flows into one
downlink take twice as long, and a flow speeds up when the other ends; a switch that forwards
one packet at a time (the test hosts' router) delays a burst; a thin spine is shared;
a late leader delays the ring by its lateness. The SimGrid replay, where Debian's
python3-simgrid is installed, agrees with the flow simulator; the header size and the riding
limit are the engine's; --validate reads a measurement file and counts what it matches."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from torchring._core import build as _build

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import _scale_sim as sim  # noqa: E402

ENGINE = _build.load()
B, D, S = 1e9, 5e-6, 15e-6  # 1 GB/s, 5 µs on the wire, 15 µs of software per step
NET = sim.Net(bandwidth=B, latency=D, overhead=S, gamma=0.0)
N = 1_000_000
# A group of transfers at once costing two steps: the header exchange keeps Doubling's shape
# (E.header_algo); with none extra (a group costs one step) it takes Multiplying's among 4 hosts.
TWO = S + D


def _doubling_shaped(**kw: float) -> sim.Net:
    net = sim.Net(bandwidth=B, latency=D, overhead=S, group_extra=TWO, **kw)
    assert sim.header_shape(ENGINE, 4, net) == "doubling"
    return net


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b))


def _sends(pairs: list[tuple[int, int, int]], hosts: int) -> list[list[sim.Step]]:
    """One message per (src, dst, bytes): the source sends, the destination receives, one step each."""
    plans: list[list[sim.Step]] = [[] for _ in range(hosts)]
    for src, dst, n in pairs:
        plans[src].append((dst, -1, n, 0, 0, 0.0, 0))
        plans[dst].append((-1, src, 0, n, 0, 0.0, 0))
    return plans


def test_one_message_costs_alpha_plus_n_beta() -> None:
    finish = sim.simulate(_sends([(0, 1, N)], 2), NET)
    assert _close(finish[1], S + D + N / B) and _close(finish[0], S + D + N / B)
    assert _close(NET.alpha, S + D) and _close(NET.beta, 1 / B)


def test_ring_of_four_equals_the_closed_form() -> None:
    net = _doubling_shaped(gamma=0.2e-9)
    count = 1000  # 250 elements a chunk: every leader moves the same bytes
    plans = sim.plan(ENGINE, "ring", 4, 1, count, 4, sim.Shm(), net)
    closed = sim.closed_form(ENGINE, "ring", 4, 1, count, 4, net, sim.Shm())
    by_hand = 6 * (S + D + 1000 / B) + 3 * 1000 * 0.2e-9  # 6 steps of 1 KB, 3 fold 1 KB
    assert _close(closed["allreduce"], by_hand)
    assert _close(closed["header"], 2 * (S + D) + 2 * sim.SUMMARY_BYTES / B)  # doubling: one summary a step
    assert all(_close(f, closed["header"] + closed["allreduce"]) for f in sim.simulate(plans, net))
    # Multiplying's shape: one group of three summaries at once, one alpha.
    fast = sim.Net(bandwidth=B, latency=D, overhead=S, gamma=0.2e-9)
    closed = sim.closed_form(ENGINE, "ring", 4, 1, count, 4, fast, sim.Shm())
    assert _close(closed["header"], (S + D) + 3 * sim.SUMMARY_BYTES / B)
    assert all(_close(f, closed["header"] + closed["allreduce"])
               for f in sim.simulate(sim.plan(ENGINE, "ring", 4, 1, count, 4, sim.Shm(), fast), fast))


def test_a_token_bucket_sends_a_messages_first_bytes_at_once_and_refills_while_idle() -> None:
    # The bucket starts empty (a loop of operations drains it) and refills while the uplink
    # idles: a first message finds what came in during its own s + D (B·(S + D) bytes).
    refill = B * (S + D)
    bucketed = sim.Net(bandwidth=B, latency=D, overhead=S, bucket=N / 4)
    small, large = sim.simulate(_sends([(0, 1, refill / 2)], 2), bucketed), sim.simulate(_sends([(0, 1, N)], 2), bucketed)
    assert _close(small[1], S + D)  # within what refilled: no time on the link
    assert _close(large[1], S + D + (N - refill) / B)
    # Back to back: the second finds again only what refilled through its own s + D...
    twice = sim.simulate(_sends([(0, 1, N), (0, 1, N)], 2), bucketed)
    assert _close(twice[0], 2 * (S + D + (N - refill) / B)), twice
    # ...a long pause fills the bucket up to its size and no further...
    paused = sim.simulate(_sends([(0, 1, N)], 2), bucketed, [1.0, 0.0])
    assert _close(paused[1], 1.0 + S + D + 0.75 * N / B), paused
    # ...and without a bucket nothing changes.
    assert _close(sim.simulate(_sends([(0, 1, N)], 2), NET)[1], S + D + N / B)


def test_a_switch_that_forwards_one_packet_at_a_time_delays_a_burst() -> None:
    # Two messages of one packet on separate links end on the wire together; the switch (the
    # test hosts' router) hands the first over after one packet's time, the second after two.
    # The senders are done once their bytes have left.
    n, a, b = 1000, 7e-6, 0.5e-9
    wire = S + D + n / B
    switched = sim.Net(bandwidth=B, latency=D, overhead=S, switch_a=a, switch_b=b)
    finish = sim.simulate(_sends([(0, 1, n), (2, 3, n)], 4), switched)
    assert _close(finish[0], wire) and _close(finish[2], wire)
    assert _close(min(finish[1], finish[3]), wire + a + b * n)
    assert _close(max(finish[1], finish[3]), wire + 2 * (a + b * n))
    # A message of three packets on a slow link: the switch forwards each as it comes, so only
    # the last one's time follows the message's end on the wire.
    slow = sim.Net(bandwidth=B, latency=D, overhead=S, switch_a=a, switch_b=b, mss=N // 3 + 1)
    assert _close(sim.simulate(_sends([(0, 1, N)], 2), slow)[1], S + D + N / B + a + b * (N // 3 + 1))
    # Without a switch's time nothing changes.
    assert sim.simulate(_sends([(0, 1, n), (2, 3, n)], 4), NET) == [wire] * 4


def test_two_flows_into_one_downlink_take_twice_as_long() -> None:
    apart = sim.simulate(_sends([(0, 2, N), (1, 3, N)], 4), NET)
    shared = sim.simulate(_sends([(0, 2, N), (1, 2, N)], 3), NET)
    assert _close(apart[0], S + D + N / B) and _close(apart[1], S + D + N / B)
    assert _close(shared[0], S + D + 2 * N / B) and _close(shared[1], S + D + 2 * N / B)
    # Host 2 received both by then; its second step (s) takes the waiting message at once.
    assert _close(shared[2], 2 * S + D + 2 * N / B)


def test_a_flow_speeds_up_when_the_other_ends() -> None:
    finish = sim.simulate(_sends([(0, 2, N), (1, 2, N // 2)], 3), NET)
    assert _close(finish[1], S + D + N / B)  # half the bytes at half the rate
    assert _close(finish[0], S + D + 1.5 * N / B)  # then the rest alone


def test_an_oversubscribed_spine_is_shared() -> None:
    # Leaves of 2 hosts, oversubscription 2: each leaf's spine link carries B; 0->2 and 1->3 share it.
    thin = sim.Net(bandwidth=B, latency=D, overhead=S, leaf=2, oversub=2.0)
    finish = sim.simulate(_sends([(0, 2, N), (1, 3, N)], 4), thin)
    assert _close(finish[0], S + D + 2 * N / B) and _close(finish[1], S + D + 2 * N / B)
    inside = sim.simulate(_sends([(0, 1, N), (2, 3, N)], 4), thin)  # within a leaf: no spine
    assert _close(inside[0], S + D + N / B)


def test_a_late_leader_delays_the_ring_by_its_lateness() -> None:
    plans = sim.plan(ENGINE, "ring", 4, 1, 1000, 4, sim.Shm(), NET)
    on_time = max(sim.simulate(plans, NET))
    late = max(sim.simulate(plans, NET, [0.0, 0.0, 300e-6, 0.0]))
    assert _close(late, on_time + 300e-6)


def test_a_small_doubling_rides_on_the_header_exchange() -> None:
    net = _doubling_shaped(gamma=0.2e-9)
    plans = sim.plan(ENGINE, "doubling", 4, 1, 100, 4, sim.Shm(), net)  # 400 B: log2(4) steps in all
    assert [len(p) for p in plans] == [1 + 2] * 4  # the copy, then the two steps
    copy = 400 * 0.2e-9  # the tensor copied into the leader's buffer
    by_hand = copy + 2 * (S + D) + 2 * sim.SUMMARY_BYTES / B + 2 * 400 / B + 2 * 400 * 0.2e-9
    assert all(_close(f, by_hand) for f in sim.simulate(plans, net))
    closed = sim.closed_form(ENGINE, "doubling", 4, 1, 100, 4, net, sim.Shm())
    assert _close(closed["header"], copy + 2 * sim.SUMMARY_BYTES / B) and _close(sum(closed.values()), by_hand)
    big = sim.plan(ENGINE, "doubling", 4, 1, ENGINE.carried_limit_bytes() // 4 + 1, 4, sim.Shm(), net)
    assert [len(p) for p in big] == [4] * 4  # past the limit: the header exchange, then the allreduce
    # Where copying the tensor costs more than the header exchange's two steps, it does not ride.
    n = int(2 * (S + D) / 0.2e-9) // 4 + 1
    assert sim.rides(ENGINE, "doubling", 4, n - 2, 4, net) and not sim.rides(ENGINE, "doubling", 4, n, 4, net)
    # With several ranks per host the host's reduce writes the leader's buffer: no copy, and
    # it rides up to the limit.
    assert sim.rides(ENGINE, "doubling", 4, n, 4, net, per_host=2)
    assert [len(p) for p in sim.plan(ENGINE, "doubling", 4, 2, n, 4, sim.Shm(), net)] == [1 + 2 + 1] * 4


def test_rabenseifner_carries_the_headers_on_its_halvings() -> None:
    """Four hosts, 4000 bytes: two halvings (2000 then 1000 bytes, each with a summary, folded),
    then two steps back (1000 then 2000 bytes): four steps, none for the header exchange alone."""
    net = _doubling_shaped(gamma=0.2e-9)
    plans = sim.plan(ENGINE, "rabenseifner", 4, 1, 1000, 4, sim.Shm(), net)
    assert [len(p) for p in plans] == [1 + 4] * 4  # the copy, then the four steps
    copy = 4000 * 0.2e-9
    by_hand = (copy + 4 * (S + D) + (2000 + 1000 + 2 * sim.SUMMARY_BYTES) / B + (1000 + 2000) / B
               + (2000 + 1000) * 0.2e-9)
    assert all(_close(f, by_hand) for f in sim.simulate(plans, net))
    closed = sim.closed_form(ENGINE, "rabenseifner", 4, 1, 1000, 4, net, sim.Shm())
    assert _close(closed["header"], copy + 2 * sim.SUMMARY_BYTES / B) and _close(sum(closed.values()), by_hand)
    # One halving, then doubling on the half window: three steps.
    assert [len(p) for p in sim.plan(ENGINE, "rabenseifner:1", 4, 1, 1000, 4, sim.Shm(), net)] == [1 + 3] * 4


def test_radix4_groups_share_the_links() -> None:
    """Four hosts, 4000 bytes under Radix4, the header exchange in Doubling's shape (a group
    costs two steps here): the header exchange (two steps), then one group that sends a quarter
    to each of the three others at once (their flows share the uplink and the downlink: 3000
    bytes through each) and folds the three quarters it receives, and one group back."""
    net = _doubling_shaped(gamma=0.2e-9)
    plans = sim.plan(ENGINE, "radix4", 4, 1, 1000, 4, sim.Shm(), net)
    assert [len(sim.groups(p)) for p in plans] == [2 + 2] * 4 and [len(p) for p in plans] == [2 + 6] * 4
    group = S + D + TWO
    by_hand = 2 * (S + D) + 2 * sim.SUMMARY_BYTES / B + 2 * group + 2 * 3000 / B + 3000 * 0.2e-9
    assert all(_close(f, by_hand) for f in sim.simulate(plans, net)), (sim.simulate(plans, net), by_hand)
    assert _close(sum(sim.closed_form(ENGINE, "radix4", 4, 1, 1000, 4, net, sim.Shm()).values()), by_hand)
    # With rendezvous sends too: each group's three flows start once all three receives are posted.
    lazy = _doubling_shaped(gamma=0.2e-9, eager=False)
    assert all(_close(f, by_hand) for f in sim.simulate(plans, lazy))


def test_radix4_and_multiplying_ride_on_multiplying_headers() -> None:
    """Four hosts where a group costs one step: the header exchange is one group of three
    summaries. Radix4 (4000 bytes) carries it on its first group (three quarters and three
    summaries out, three in, folded), then one group back; Multiplying (400 bytes) is that one
    group with the whole buffer. Each pays the copy into the leader's buffer, none with two
    ranks per host."""
    net = sim.Net(bandwidth=B, latency=D, overhead=S, gamma=0.2e-9)
    assert sim.header_shape(ENGINE, 4, net) == "multiplying"
    plans = sim.plan(ENGINE, "radix4", 4, 1, 1000, 4, sim.Shm(), net)
    assert [len(sim.groups(p)) for p in plans] == [1 + 2] * 4  # the copy, the two groups
    copy = 4000 * 0.2e-9
    by_hand = copy + 2 * (S + D) + (3000 + 3 * sim.SUMMARY_BYTES) / B + 3000 / B + 3000 * 0.2e-9
    assert all(_close(f, by_hand) for f in sim.simulate(plans, net)), (sim.simulate(plans, net), by_hand)
    closed = sim.closed_form(ENGINE, "radix4", 4, 1, 1000, 4, net, sim.Shm())
    assert _close(closed["header"], copy + 3 * sim.SUMMARY_BYTES / B) and _close(sum(closed.values()), by_hand)
    small = sim.plan(ENGINE, "multiplying", 4, 1, 100, 4, sim.Shm(), net)
    assert [len(sim.groups(p)) for p in small] == [1 + 1] * 4
    by_hand = 400 * 0.2e-9 + (S + D) + 3 * (400 + sim.SUMMARY_BYTES) / B + 3 * 400 * 0.2e-9
    assert all(_close(f, by_hand) for f in sim.simulate(small, net))
    shm = sim.Shm()
    staged = sim.plan(ENGINE, "multiplying", 4, 2, 100, 4, shm, net)
    stages = 2 * shm.stage(400, 2)
    assert all(_close(f, by_hand - 400 * 0.2e-9 + stages) for f in sim.simulate(staged, net))
    # Rabenseifner does not ride on Multiplying's shape: the header's group, then its own steps.
    assert not sim.rides(ENGINE, "rabenseifner", 4, 1000, 4, net)


def test_shared_memory_stages_bracket_the_leaders() -> None:
    shm = sim.Shm(a=5e-6, bw=10e9)
    alone = max(sim.simulate(sim.plan(ENGINE, "rabenseifner", 4, 1, 1000, 4, shm, NET), NET))
    eight = max(sim.simulate(sim.plan(ENGINE, "rabenseifner", 4, 8, 1000, 4, shm, NET), NET))
    # The header exchange's summaries do not grow with the ranks per host: only the stages differ.
    assert _close(eight - alone, 2 * (5e-6 + 4000 / 10e9))


def test_lower_bound_by_hand() -> None:
    net = sim.Net(bandwidth=B, latency=D, overhead=S, gamma=1e-10)
    assert _close(sim.lower_bound(4, N, net), 2 * (S + D) + 1.5 * N / B + 0.75 * N * 1e-10)
    assert _close(sim.lower_bound(5, N, net), 3 * (S + D) + 1.6 * N / B + 0.8 * N * 1e-10)


@pytest.mark.parametrize("eager", [True, False])
def test_simgrid_agrees(eager: bool) -> None:
    if sim.simgrid_python() is None:
        pytest.skip("SimGrid's Python module is not installed (Debian: apt-get install python3-simgrid)")
    net = sim.Net(bandwidth=B, latency=D, overhead=S, gamma=0.1e-9, eager=eager)
    # Five hosts fold in and out: with eager sends, core messages share the folding hosts' downlinks.
    plans = sim.plan(ENGINE, "doubling", 5, 2, 100_000, 4, sim.Shm(), net)
    flow, grid = sim.simulate(plans, net, [0, 40e-6, 0, 0, 0]), sim.simulate_simgrid(plans, net, [0, 40e-6, 0, 0, 0])
    assert all(_close(f, g) for f, g in zip(flow, grid)), (flow, grid)
    shared = _sends([(0, 2, N), (1, 2, N // 2)], 3)
    assert all(_close(f, g) for f, g in zip(sim.simulate(shared, net), sim.simulate_simgrid(shared, net)))
    if eager:
        return  # groups: below, with rendezvous sends
    # Radix4 and Multiplying on 6 hosts: groups of three transfers at once, a fold in and out,
    # riding on a header exchange of Multiplying's shape and not.
    for extra in (15e-6, 30e-6):
        net = sim.Net(bandwidth=B, latency=D, overhead=S, gamma=0.1e-9, eager=False, group_extra=extra)
        for algo in ("radix4", "multiplying"):
            groups = sim.plan(ENGINE, algo, 6, 1, 100_000, 4, sim.Shm(), net)
            flow, grid = sim.simulate(groups, net), sim.simulate_simgrid(groups, net)
            assert all(_close(f, g) for f, g in zip(flow, grid)), (algo, extra, flow, grid)


@pytest.mark.xfail(strict=True, reason="open: once a group spends group_extra before its messages, SimGrid's "
                   "eager replay times equal its rendezvous replay's (messages sent early, which share a downlink "
                   "with a fold in, do not flow before their receive), where the flow simulator's flow at once")
def test_simgrid_agrees_on_eager_groups() -> None:
    if sim.simgrid_python() is None:
        pytest.skip("SimGrid's Python module is not installed (Debian: apt-get install python3-simgrid)")
    net = sim.Net(bandwidth=B, latency=D, overhead=S, gamma=0.1e-9, group_extra=15e-6)
    body = [list(p) for p in sim.allreduce_steps(ENGINE, "radix4", 6, 100_000, 4)]
    flow, grid = sim.simulate(body, net), sim.simulate_simgrid(body, net)
    lazy = sim.Net(bandwidth=B, latency=D, overhead=S, gamma=0.1e-9, group_extra=15e-6, eager=False)
    assert not all(_close(f, g) for f, g in zip(sim.simulate(body, lazy), flow))  # eagerness shows here
    assert all(_close(f, g) for f, g in zip(flow, grid)), (flow, grid)


def test_constants_are_the_engines(tmp_path) -> None:
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    src = tmp_path / "sizes.cpp"
    src.write_text('#include "transport/tcp/links.h"\n#include <cstdio>\n'
                   'int main() { std::printf("%zu %zu", sizeof(torchring::OpHeader), sizeof(torchring::HeaderSummary)); }\n')
    exe = tmp_path / "sizes"
    subprocess.run([cxx, "-std=c++17", "-I", os.path.join(ROOT, "torchring", "csrc"), str(src), "-o", str(exe)],
                   check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()
    assert [int(x) for x in out] == [sim.HEADER_BYTES, sim.SUMMARY_BYTES]


def test_validate_counts_matches(tmp_path, capsys) -> None:
    import scale_model

    cost = {"alpha": 40e-6, "beta": 8e-10, "gamma": 1e-10}
    rows = [{"library": "torchring", "algo": algo, "hosts": 4, "per_host": 2, "bytes": n, "seconds": 1.0,
             "latency_us": 20.0, "rate_bits": 1e10, **cost}
            for algo in ("ring", "auto") for n in (4096, 1 << 20)]
    rows[3]["chosen"] = "doubling"  # what scaleout.py records the engine ran; else the model picks
    rows.append({**rows[0], "library": "gloo"})
    path = tmp_path / "measured.json"
    path.write_text(json.dumps({"rows": rows}))
    out = tmp_path / "out.json"
    scale_model.main(["--validate", str(path), "--json", str(out), "--plot", "none"])
    predicted = json.loads(out.read_text())["rows"]
    assert len(predicted) == 4 and {r["ran"] for r in predicted} <= set(ENGINE.ALGOS)
    ran = {(r["algo"], r["bytes"]): r["ran"] for r in predicted}
    assert ran[("auto", 1 << 20)] == "doubling" and ran[("ring", 4096)] == "ring"
    # With no alpha_group measured, a group costs alpha: the model's own choice for 4 KiB on 4
    # hosts is Multiplying (one group of three, riding on the header exchange of its shape).
    assert ran[("auto", 4096)] == "multiplying"
    assert all(_close(r["overhead_us"], 20.0) for r in predicted)  # s = alpha - D
    # Measurements 10 % and 40 % off the prediction: two of four within 15 %.
    for r, k in zip(rows, (1.1, 1.4, 0.9, 1.4)):
        r["seconds"] = next(p["predicted_s"] for p in predicted
                            if (p["algo"], p["bytes"]) == (r["algo"], r["bytes"])) * k
    path.write_text(json.dumps({"rows": rows}))
    capsys.readouterr()
    scale_model.main(["--validate", str(path), "--plot", "none"])
    assert "2 of 4 predictions within 15%" in capsys.readouterr().out
