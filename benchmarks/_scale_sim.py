"""The scale model's simulator: the engine's own cross-host schedules, replayed as messages over
modelled links (benchmarks/scale_model.py is the command line).

A plan is one list of steps per host leader, read from the engine's bindings, never
re-derived here: the header exchange every operation among hosts starts with (the schedule of
its shape, ``header_algo``: Doubling's, or Multiplying's where a group of transfers at once
costs less than Doubling's steps; each message one summary of the headers its sender knows:
the engine's rounds when every rank's header agrees), then the allreduce's own schedule
(``allreduce_schedule``), or, for an allreduce that rides on the header exchange
(``rides_on_headers``: Doubling or Rabenseifner on Doubling's shape, Multiplying or Radix4 on
Multiplying's, small enough), its own schedule whose first steps carry the summaries
(engine/fused.cpp). A step sends some bytes to
one leader and receives some from one (either may be absent) at the same time, as
torchring/csrc/schedule/schedule.h says, and a step marked ``with_next`` runs at the same time
as the next one (a group, as Radix4's three transfers of a level); a delay step is a local
stage (the host's shared-memory reduce before the leaders' part, its broadcast after).

Two engines run a plan and return every leader's finish time:
- ``simulate`` (the default): a discrete-event flow simulator written here. Each leader has one
  NIC, full duplex: an uplink and a downlink of ``bandwidth`` bytes/s into one non-blocking
  switch, or, with ``leaf`` hosts per leaf switch, a two-level tree whose leaf-to-spine links
  carry ``leaf * bandwidth / oversub`` each way. A step starts when the leader's previous one has
  ended (a group: all its transfers start together, and it ends when all have; its folds add
  up; it spends ``group_extra`` more software time before its messages, the cost model's
  alphaGroup - alpha); it spends ``overhead`` (s, software) on the leader, then its message spends
  ``latency`` (D, the wire) before it enters the links, and moves at the max-min fair share
  of every link on its route (flows sharing a link share its bandwidth; rates are recomputed
  whenever a flow starts or ends). Sends are eager (TCP's buffers): a message flows even if
  its receiver is still in an earlier step, and waits in the receiver's mailbox (``eager=False``:
  it flows once its receive is posted, the other end of what TCP's buffers allow). The step ends
  when its send has left and its receive has arrived, plus ``gamma`` per byte folded when it
  folds (the cost model's rule; the engine overlaps part of a fold with the transfer, so this
  is its upper end). A zero-byte send or receive is no message (the engine skips empty spans):
  such a step costs only s. Uncontended, a message of n bytes takes s + D + n/B = alpha + n*beta.
  With ``bucket`` > 0 each uplink is a token bucket, as tc's tbf shapes the test hosts' links
  (scale_model.py --validate on shaped runs): its tokens refill at ``bandwidth`` while the
  uplink carries no flow, up to ``bucket`` bytes, and a message that starts takes what tokens
  there are for its first bytes at once (a link that is busy neither gains nor loses them: it
  sends at the rate they refill). The buckets start empty, as in a loop of back-to-back
  operations (what benchmarks/scaleout.py times), which drains them: each refills only while
  its uplink idles within an operation. A real NIC has no bucket: the projection runs with none.
  With ``switch_a`` or ``switch_b`` > 0 the switch forwards one packet at a time, as the test
  hosts' router does on its one thread (scale_model.py --validate, with the router's own
  timing of its reads and writes: tests/support/_latency.forwarding_cost): a message is
  ceil(n / ``mss``) packets, each taking the switch ``switch_a`` + ``switch_b`` per byte; it
  reaches its receiver once the switch has forwarded all of them, in the order messages end on
  their links, and no earlier than one packet's time after its own end (the switch forwards a
  long message's packets while the rest are still on the wire). A switch that keeps up with
  its links, as a real one does, costs nothing: the projection runs with none.
- ``simulate_simgrid``: the same plan replayed by SimGrid's S4U actors (put/get on mailboxes,
  made eager with ``set_receiver`` unless ``eager=False``) on a cluster of split-duplex private
  links, under the CM02 flow model with no TCP corrections, so both engines mean the same thing
  and can check each other (tests/unit/test_scale_model.py). Star platform only, no token
  buckets, no switch time. Debian's python3-simgrid builds the module for the system Python,
  SimGrid allows one engine per process, and its Python bindings run every actor on an OS
  thread (contexts/factory: thread): so each run is a child process of /usr/bin/python3 (this
  file's ``__main__``), and it is slow: about 135 µs per leader-step on the 2-vCPU VM (a
  256-host ring of 1 MB, 130k leader-steps, took 17.6 s; a 1024-host ring, 2M leader-steps,
  would take about 5 minutes per point). The flow simulator does about 5 µs per leader-step:
  the projection's replayed points, about 9.5M leader-steps, take under a minute here and would
  take over 20 minutes under SimGrid. So the flow simulator is the default and SimGrid its check
  (and an alternative engine for small runs).
"""

from __future__ import annotations

import heapq
import json
import math
import shutil
import subprocess
import sys
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

# sizeof(torchring::OpHeader) (torchring/csrc/core/common.h) on x86-64, and of the summary each
# header-exchange message carries (transport/tcp/headers.cpp: a flag word and the sender's
# header). tests/unit/test_scale_model.py compiles the structs to check them.
HEADER_BYTES = 144
SUMMARY_BYTES = 8 + HEADER_BYTES

# One leader-step: (send_to, recv_from, send_bytes, recv_bytes, folded_bytes, delay_seconds,
# with_next). send_to / recv_from are leader indices or -1; a delay step has both -1 and only a
# delay; with_next 1: the step runs at the same time as the next one (schedule.h withNext).
Step = tuple[int, int, int, int, int, float, int]


@dataclass(frozen=True)
class Net:
    """The leaders' network and per-step costs (seconds, bytes/s)."""

    bandwidth: float  # B: bytes/s of each leader's NIC, each direction
    latency: float  # D: seconds a message spends on the wire before it flows
    overhead: float  # s: seconds of software per step, on the leader, before its message
    gamma: float = 0.0  # seconds per byte folded
    leaf: int = 0  # hosts per leaf switch; 0: one non-blocking switch
    oversub: float = 1.0  # leaf switches' oversubscription (1: full bisection)
    eager: bool = True  # a message flows when sent (TCP's buffers); False: once its receive is posted
    group_extra: float = 0.0  # seconds a group of steps that run at once costs beyond one step's s
    bucket: float = 0.0  # bytes of a token bucket on each uplink (tc's tbf on the test hosts); 0: none
    switch_a: float = 0.0  # seconds the switch spends on each packet it forwards, one at a time; 0: none
    switch_b: float = 0.0  # and per byte of it
    mss: int = 64960  # bytes of a message per packet (the test hosts' TUN MTU less the IP and TCP headers)

    @property
    def alpha(self) -> float:
        """The cost model's alpha: seconds per step whatever its size (D + s)."""
        return self.latency + self.overhead

    @property
    def alpha_group(self) -> float:
        """The cost model's alphaGroup: seconds per group of transfers at once (D + s + the extra)."""
        return self.alpha + self.group_extra

    @property
    def beta(self) -> float:
        """The cost model's beta: seconds per byte through one NIC."""
        return 1.0 / self.bandwidth


@dataclass(frozen=True)
class Shm:
    """The host's shared-memory stage: seconds a + n / bw, once before and once after."""

    a: float = 5e-6
    bw: float = 10e9

    def stage(self, nbytes: int, per_host: int) -> float:
        """Seconds of one stage for n bytes; a host of one rank has none."""
        return 0.0 if per_host <= 1 else self.a + nbytes / self.bw


# ---------------------------------------------------------------- plans, from the engine's bindings

def _bytes(ranges: list, unit: int) -> int:
    return sum(count for _, count in ranges) * unit


@lru_cache(maxsize=64)
def allreduce_steps(E: Any, algo: str, hosts: int, count: int, esize: int) -> tuple[tuple[Step, ...], ...]:
    """Every leader's steps of the engine's allreduce of `count` elements of `esize` bytes."""
    out = []
    for me in range(hosts):
        steps = E.allreduce_schedule(algo, hosts, me, count)["steps"]
        out.append(tuple((s["send_to"], s["recv_from"], _bytes(s["send"], esize), _bytes(s["recv"], esize),
                          _bytes(s["recv"], esize) if s["fold"] else 0, 0.0, int(s["with_next"])) for s in steps))
    return tuple(out)


def rides(E: Any, algo: str, hosts: int, count: int, esize: int, net: Net, per_host: int = 1) -> bool:
    """Whether the allreduce rides on the header exchange (engine/fused.cpp carriedPlan): its
    first steps are the header's shape and its copy into the leader's buffer (none with several
    ranks per host) costs less than the header exchange's steps (E.rides_on_headers, the
    engine's own rule)."""
    return bool(E.rides_on_headers(algo, hosts, count, esize, net.alpha, net.beta, net.gamma, net.alpha_group,
                                   staged=per_host > 1))


def header_shape(E: Any, hosts: int, net: Net) -> str:
    """The header exchange's schedule (E.header_algo): "doubling" or "multiplying"."""
    return str(E.header_algo(hosts, net.alpha, net.alpha_group))


@lru_cache(maxsize=256)
def header_steps(E: Any, hosts: int, shape: str = "doubling") -> tuple[tuple[Step, ...], ...]:
    """Every leader's steps of the header exchange (transport/tcp/headers.cpp) when the headers
    agree: `shape`'s steps, each message one SUMMARY_BYTES summary whatever the ranks per host."""
    out = []
    for me in range(hosts):
        steps = E.allreduce_schedule(shape, hosts, me, 1)["steps"]
        out.append(tuple((s["send_to"], s["recv_from"], SUMMARY_BYTES if s["send_to"] >= 0 else 0,
                          SUMMARY_BYTES if s["recv_from"] >= 0 else 0, 0, 0.0, int(s["with_next"])) for s in steps))
    return tuple(out)


@lru_cache(maxsize=256)
def carried_steps(E: Any, algo: str, hosts: int, count: int, esize: int,
                  shape: str = "doubling") -> tuple[tuple[Step, ...], ...]:
    """Every leader's steps of an allreduce riding on a header exchange of `shape`: its own
    schedule, whose first steps (the fold in and the core's groups) and fold out are the header
    exchange's and carry a summary each besides their data."""
    body, out = allreduce_steps(E, algo, hosts, count, esize), []
    rem = hosts - (1 << (hosts.bit_length() - 1))
    for me, (steps, head) in enumerate(zip(body, header_steps(E, hosts, shape))):
        folds = me < 2 * rem
        core = len(head) - (1 if folds else 0)
        marked = set(range(core)) | ({len(steps) - 1} if folds else set())
        out.append(tuple((to, frm, sb + (SUMMARY_BYTES if i in marked and to >= 0 else 0),
                          rb + (SUMMARY_BYTES if i in marked and frm >= 0 else 0), fb, delay, joined)
                         for i, (to, frm, sb, rb, fb, delay, joined) in enumerate(steps)))
    return tuple(out)


def _carry(E: Any, nbytes: int, net: Net, per_host: int) -> float:
    """Seconds of a riding allreduce's copy into the leader's buffer (E.carry_seconds)."""
    return float(E.carry_seconds(nbytes, net.alpha, net.beta, net.gamma, staged=per_host > 1))


def plan(E: Any, algo: str, hosts: int, per_host: int, count: int, esize: int, shm: Shm,
         net: Net) -> list[list[Step]]:
    """Every leader's steps of one allreduce as the engine runs it (engine/communicator.cpp run):
    the header exchange, the host's shared-memory reduce, `algo` among the leaders, the host's
    broadcast; an allreduce that rides on the header exchange copies its tensor into the leader's
    buffer on a host of one rank (E.carry_seconds; with several, the host's reduce writes it),
    reduces in the host, runs its schedule with the headers on its first steps
    (engine/fused.cpp), then the broadcast."""
    stage = shm.stage(count * esize, per_host)
    shm_step: list[Step] = [(-1, -1, 0, 0, 0, stage, 0)] if stage > 0 else []
    shape = header_shape(E, hosts, net)
    if rides(E, algo, hosts, count, esize, net, per_host):
        copy: list[Step] = [(-1, -1, 0, 0, 0, _carry(E, count * esize, net, per_host), 0)] if per_host <= 1 else []
        return [copy + shm_step + list(steps) + shm_step
                for steps in carried_steps(E, algo, hosts, count, esize, shape)]
    head, body = header_steps(E, hosts, shape), allreduce_steps(E, algo, hosts, count, esize)
    return [list(head[m]) + shm_step + list(body[m]) + shm_step for m in range(hosts)]


def groups(steps: tuple[Step, ...] | list[Step]) -> list[list[Step]]:
    """One leader's steps in their groups (steps joined by with_next run at once)."""
    out: list[list[Step]] = []
    joined = False
    for step in steps:
        if joined:
            out[-1].append(step)
        else:
            out.append([step])
        joined = bool(step[6])
    return out


def step_sum(steps: tuple[Step, ...] | list[Step], net: Net) -> float:
    """The cost model's rule along one leader's steps (schedule/cost.h scheduleSeconds): each
    group costs alpha + (the larger of its bytes sent and received)·beta + its folded bytes·gamma."""
    total = 0.0
    for group in groups(steps):
        to, frm, _, _, _, delay, _ = group[0]
        if len(group) == 1 and to < 0 and frm < 0:
            total += delay
            continue
        total += ((net.alpha_group if len(group) > 1 else net.alpha)
                  + max(sum(g[2] for g in group), sum(g[3] for g in group)) * net.beta
                  + sum(g[4] for g in group) * net.gamma)
    return total


def closed_form(E: Any, algo: str, hosts: int, per_host: int, count: int, esize: int, net: Net,
                shm: Shm) -> dict[str, float]:
    """The cost model's seconds by stage, summing to the whole: "allreduce" the algorithm's own
    (E.allreduce_seconds), "header" what the header exchange adds to it (the step rule along its
    slowest leader; for an allreduce riding on it, its summaries' bytes and its copy), "shm" the
    stages."""
    alone = E.allreduce_seconds(algo, hosts, count, esize, net.alpha, net.beta, net.gamma, net.alpha_group)
    shape = header_shape(E, hosts, net)
    if rides(E, algo, hosts, count, esize, net, per_host):
        head = (max(step_sum(s, net) for s in carried_steps(E, algo, hosts, count, esize, shape)) - alone
                + _carry(E, count * esize, net, per_host))
    else:
        head = max(step_sum(h, net) for h in header_steps(E, hosts, shape))
    return {"header": head, "allreduce": alone, "shm": 2 * shm.stage(count * esize, per_host)}


def lower_bound(hosts: int, nbytes: int, net: Net) -> float:
    """ceil(log2 H)·α + 2(H−1)/H·n·β + (H−1)/H·n·γ: allreduce among H hosts in the α-β-γ model."""
    if hosts <= 1:
        return 0.0
    f = (hosts - 1) / hosts
    return math.ceil(math.log2(hosts)) * net.alpha + 2 * f * nbytes * net.beta + f * nbytes * net.gamma


def plan_steps(plans: list[list[Step]]) -> int:
    """Leader-steps in a plan: what a simulation's run time grows with."""
    return sum(len(p) for p in plans)


# ---------------------------------------------------------------- the flow simulator

class _Flow:
    __slots__ = ("src", "dst", "links", "left", "rate", "since", "version", "size", "began")

    def __init__(self, src: int, dst: int, links: tuple[int, ...], nbytes: float) -> None:
        self.src, self.dst, self.links, self.left = src, dst, links, nbytes
        self.rate, self.since, self.version = 0.0, 0.0, 0
        self.size, self.began = nbytes, 0.0


def _links(hosts: int, net: Net) -> tuple[list[float], Any]:
    """Link capacities and the route function: link 2h is host h's uplink, 2h+1 its downlink,
    then (with leaves) 2H+2l and 2H+2l+1 leaf l's links to and from the spine."""
    caps = [net.bandwidth] * (2 * hosts)
    if net.leaf <= 0 or net.leaf >= hosts:
        return caps, lambda a, b: (2 * a, 2 * b + 1)
    leaves = -(-hosts // net.leaf)
    caps += [net.leaf * net.bandwidth / net.oversub] * (2 * leaves)

    def route(a: int, b: int) -> tuple[int, ...]:
        la, lb = a // net.leaf, b // net.leaf
        if la == lb:
            return (2 * a, 2 * b + 1)
        return (2 * a, 2 * hosts + 2 * la, 2 * hosts + 2 * lb + 1, 2 * b + 1)

    return caps, route


def _max_min(flows: list[_Flow], caps: list[float], on_link: list[set]) -> dict[_Flow, float]:
    """Max-min fair rates of a connected set of flows (progressive filling)."""
    room: dict[int, float] = {}
    users: dict[int, int] = {}
    for f in flows:
        for l in f.links:
            room[l] = caps[l]
            users[l] = users.get(l, 0) + 1
    rates: dict[_Flow, float] = {}
    while users:
        share, link = min((room[l] / n, l) for l, n in users.items())
        for f in on_link[link]:
            if f in rates:
                continue
            rates[f] = share
            for l in f.links:
                room[l] -= share
                users[l] -= 1
                if users[l] == 0:
                    del users[l]
    return rates


def simulate(plans: list[list[Step]], net: Net, starts: list[float] | None = None) -> list[float]:
    """Every leader's finish time (seconds) for `plans` on `net` (module docstring)."""
    hosts = len(plans)
    caps, route = _links(hosts, net)
    on_link: list[set] = [set() for _ in caps]
    events: list = []
    seq = 0

    def push(t: float, kind: int, a: Any, b: int = 0) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, a, b))

    STEP, START, END, ARRIVE = 0, 1, 2, 3
    switch_free = 0.0  # when the switch has forwarded every packet handed to it so far
    grouped = [groups(p) for p in plans]
    pos = [0] * hosts  # the current group
    post = [0.0] * hosts  # when the current step's message was posted (after s)
    done = [0.0] * hosts  # the latest of the current step's parts that have ended
    parts = [0] * hosts  # parts of the current group still running (a send and a receive per step)
    waiting: list[set[int]] = [set() for _ in range(hosts)]  # leaders the current group awaits a message from
    mail: dict[tuple[int, int], deque] = {}  # eager: arrival times of messages not yet received
    held: dict[tuple[int, int], tuple] = {}  # rendezvous: sends waiting for their receive
    finish = [0.0] * hosts
    dirty: set[int] = set()
    now = 0.0
    tokens = [0.0] * len(caps)  # each uplink's bucket, empty at the start (see the docstring)
    idle_since = [0.0] * len(caps)

    def part_done(m: int, t: float) -> None:
        done[m] = max(done[m], t)
        parts[m] -= 1
        if parts[m] == 0:
            folded = sum(step[4] for step in grouped[m][pos[m]])
            pos[m] += 1
            push(done[m] + net.gamma * folded, STEP, m)

    def arrive(f: _Flow, t: float) -> None:
        if f.src in waiting[f.dst]:
            waiting[f.dst].discard(f.src)
            part_done(f.dst, max(post[f.dst], t))
        else:
            mail.setdefault((f.src, f.dst), deque()).append(t)

    for m in range(hosts):
        push(starts[m] if starts else 0.0, STEP, m)
    while events or dirty:
        t = events[0][0] if events else math.inf
        if dirty and t > now:
            _reshare(dirty, on_link, caps, now, push, END)
            dirty.clear()
            continue
        t, _, kind, a, b = heapq.heappop(events)
        now = t
        if kind == STEP:
            m = a
            if pos[m] == len(grouped[m]):
                finish[m] = t
                continue
            group = grouped[m][pos[m]]
            to, frm, _, _, _, delay, _ = group[0]
            if len(group) == 1 and to < 0 and frm < 0:
                parts[m], done[m] = 1, t
                part_done(m, t + (delay if delay > 0 else net.overhead))
                continue
            post[m] = t0 = t + net.overhead + (net.group_extra if len(group) > 1 else 0.0)
            done[m], parts[m] = t0, 2 * len(group)
            # Every send first, then the receives: a part that ends at once must not end the
            # group before the others have started.
            parts[m] += 1
            for to, frm, sbytes, rbytes, _, _, _ in group:
                if to >= 0 and sbytes > 0:
                    flow = _Flow(m, to, route(m, to), sbytes)
                    if net.eager:
                        push(t0 + net.latency, START, flow)
                    elif m in waiting[to]:  # rendezvous: the receive is posted
                        push(max(t0, post[to]) + net.latency, START, flow)
                    else:
                        held[(m, to)] = (t0, flow)
                else:
                    part_done(m, t0)
            for to, frm, sbytes, rbytes, _, _, _ in group:
                if frm >= 0 and rbytes > 0:
                    box = mail.get((frm, m))
                    if box:
                        part_done(m, max(t0, box.popleft()))
                    else:
                        waiting[m].add(frm)
                        if (frm, m) in held:
                            t1, flow = held.pop((frm, m))
                            push(max(t0, t1) + net.latency, START, flow)
                else:
                    part_done(m, t0)
            part_done(m, t0)
        elif kind == START:
            f = a
            f.since = f.began = t
            if net.bucket > 0:  # the uplink's tokens send the message's first bytes at once
                up = f.links[0]
                if not on_link[up]:  # refilled while idle, up to now
                    tokens[up] = min(net.bucket, tokens[up] + caps[up] * (t - idle_since[up]))
                    idle_since[up] = t
                take = min(tokens[up], f.left)
                tokens[up] -= take
                f.left -= take
                if f.left <= 0:
                    push(t, END, f, f.version)
                    continue
            for l in f.links:
                on_link[l].add(f)
                dirty.add(l)
        elif kind == END:
            f = a
            if b != f.version:
                continue
            for l in f.links:
                on_link[l].discard(f)
                dirty.add(l)
            if not on_link[f.links[0]]:
                idle_since[f.links[0]] = t
            part_done(f.src, t)
            if net.switch_a > 0 or net.switch_b > 0:  # the switch forwards its packets in turn
                packets = max(1, math.ceil(f.size / net.mss))
                last = net.switch_a + net.switch_b * min(f.size, net.mss)
                switch_free = max(max(switch_free, f.began) + packets * net.switch_a + net.switch_b * f.size,
                                  t + last)
                push(switch_free, ARRIVE, f)
            else:
                arrive(f, t)
        else:  # ARRIVE: the message is in its receiver's host
            arrive(a, t)
    stuck = [m for m in range(hosts) if pos[m] < len(grouped[m])]
    if stuck:
        raise RuntimeError(f"the plan deadlocks: leaders {stuck[:8]} stopped at groups {[pos[m] for m in stuck[:8]]}")
    return finish


def _reshare(dirty: set[int], on_link: list[set], caps: list[float], now: float, push: Any, end: int) -> None:
    """New max-min rates for every flow connected to a link whose flows changed; each rate
    change moves the flow's end (a new version; the old END event is then ignored)."""
    seen: set = set()
    for link in dirty:
        for f in on_link[link]:
            if f in seen:
                continue
            group, stack = [], [f]
            seen.add(f)
            while stack:
                g = stack.pop()
                group.append(g)
                for l in g.links:
                    for h in on_link[l]:
                        if h not in seen:
                            seen.add(h)
                            stack.append(h)
            if len(group) == 1:
                rates = {f: min(caps[l] for l in f.links)}
            else:
                rates = _max_min(group, caps, on_link)
            for g, r in rates.items():
                if r == g.rate:
                    continue
                g.left -= g.rate * (now - g.since)
                g.since, g.rate = now, r
                g.version += 1
                push(now + max(g.left, 0.0) / r, end, g, g.version)


# ---------------------------------------------------------------- SimGrid (a child process)

SYSTEM_PYTHON = "/usr/bin/python3"


@lru_cache(maxsize=1)
def simgrid_python() -> str | None:
    """The interpreter that imports Debian's simgrid module, or None when it is not installed."""
    for exe in (SYSTEM_PYTHON, shutil.which("python3"), sys.executable):
        try:
            if exe and subprocess.run([exe, "-c", "import simgrid"], capture_output=True, timeout=60).returncode == 0:
                return exe
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


def simulate_simgrid(plans: list[list[Step]], net: Net, starts: list[float] | None = None,
                     timeout: float = 600) -> list[float]:
    """Every leader's finish time for `plans` on `net`, replayed by SimGrid (star platform)."""
    exe = simgrid_python()
    if exe is None:
        raise RuntimeError("SimGrid's Python module is not installed (Debian: apt-get install python3-simgrid)")
    if net.leaf and net.leaf < len(plans):
        raise ValueError("the SimGrid replay models one non-blocking switch only (leaf = 0)")
    if net.bucket > 0:
        raise ValueError("the SimGrid replay has no token buckets (bucket = 0)")
    if net.switch_a > 0 or net.switch_b > 0:
        raise ValueError("the SimGrid replay has no switch time (switch_a = switch_b = 0)")
    job = {"plans": plans, "bandwidth": net.bandwidth, "latency": net.latency, "overhead": net.overhead,
           "group_extra": net.group_extra,
           "gamma": net.gamma, "eager": net.eager, "starts": starts or [0.0] * len(plans)}
    out = subprocess.run([exe, __file__], input=json.dumps(job), capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"the SimGrid replay failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _simgrid_main() -> None:
    """The child: reads a job (JSON) on stdin, prints every leader's finish time (JSON)."""
    import os
    import tempfile

    import simgrid as sg

    job = json.load(sys.stdin)
    plans, hosts = job["plans"], len(job["plans"])
    s, gamma = job["overhead"], job["gamma"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "platform.xml")
        with open(path, "w") as f:  # each route: src's uplink + dst's downlink, D/2 each
            f.write("<?xml version='1.0'?>\n<!DOCTYPE platform SYSTEM \"https://simgrid.org/simgrid.dtd\">\n"
                    f"<platform version=\"4.1\"><cluster id=\"c\" prefix=\"h\" suffix=\"\" radical=\"0-{hosts - 1}\" "
                    f"speed=\"1Gf\" bw=\"{job['bandwidth']!r}Bps\" lat=\"{job['latency'] / 2!r}s\" "
                    "sharing_policy=\"SPLITDUPLEX\"/></platform>\n")
        engine = sg.Engine(["scale_sim", "--cfg=network/model:CM02", "--cfg=network/TCP-gamma:0",
                            "--cfg=network/crosstraffic:0", "--cfg=network/latency-factor:1",
                            "--cfg=network/bandwidth-factor:1", "--log=root.thres:critical"])
        engine.load_platform(path)
    finish = [0.0] * hosts

    def leader(me: int) -> None:
        if job["eager"]:  # a mailbox with a receiver set takes messages as they are sent
            for frm in sorted({step[1] for step in plans[me] if step[1] >= 0}):
                sg.Mailbox.by_name(f"{frm}>{me}").set_receiver(sg.Actor.self())
            sg.this_actor.yield_()  # every leader's mailboxes are eager before anyone sends
        if job["starts"][me] > 0:
            sg.this_actor.sleep_for(job["starts"][me])
        for group in groups(plans[me]):
            to, frm, _, _, _, delay, _ = group[0]
            if len(group) == 1 and to < 0 and frm < 0:
                sg.this_actor.sleep_for(delay if delay > 0 else s)
                continue
            busy = s + (job["group_extra"] if len(group) > 1 else 0.0)
            if busy > 0:
                sg.this_actor.sleep_for(busy)
            comms, landings = [], []
            for to, frm, sbytes, rbytes, _, _, _ in group:
                if to >= 0 and sbytes > 0:
                    comms.append(sg.Mailbox.by_name(f"{me}>{to}").put_async(me, sbytes))
            for to, frm, sbytes, rbytes, _, _, _ in group:
                if frm >= 0 and rbytes > 0:
                    comm, landing = sg.Mailbox.by_name(f"{frm}>{me}").get_async()  # landing: where the
                    comms.append(comm)  # payload lands; it must outlive the comm
                    landings.append(landing)
            for c in comms:
                c.wait()
            del landings
            folded = sum(step[4] for step in group)
            if folded > 0 and gamma > 0:
                sg.this_actor.sleep_for(gamma * folded)
        finish[me] = sg.Engine.clock

    by_index = sorted(engine.all_hosts, key=lambda h: int(h.name[1:]))
    for me, host in enumerate(by_index):
        sg.Actor.create(f"leader{me}", host, leader, me)
    engine.run()
    print(json.dumps(finish))


if __name__ == "__main__":
    _simgrid_main()
