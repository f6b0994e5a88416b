"""The cross-host schedules (csrc/schedule/) run on plain numbers, in process, through the
``*_schedule`` bindings the scale model uses too: every member of every member count 1–33 ends
with every contribution exactly once, messages pair up (what one member sends in a step is what
its partner receives, unit for unit), a group of steps that run at once (``with_next``) sends
what its member held when the group started, steps only name members the links connect, depths
are the log-depth ones, and the cost model's closed forms equal the schedules' own step sums."""

from __future__ import annotations

import math

import pytest

from torchring._core import build as _build

ENGINE = _build.load()
MEMBERS = list(range(1, 18)) + [24, 31, 32, 33]
# "rabenseifner:K": K halvings, then doubling on the window (all of them when K is more than there are).
ALLREDUCE_ALGOS = ["ring", "doubling", "rabenseifner", "rabenseifner:1", "rabenseifner:2", "rabenseifner:3",
                   "radix4", "multiplying"]
# (the header exchange's shape, an allreduce that rides on it)
CARRIED = [("doubling", a) for a in ALLREDUCE_ALGOS if a.startswith(("doubling", "rabenseifner"))] + \
    [("multiplying", "multiplying"), ("multiplying", "radix4")]


def _levels(algo: str, members: int) -> int:
    """The halvings a Doubling or Rabenseifner schedule runs for `members` (schedule.h halvingsOf)."""
    log2p2 = (1 << (members.bit_length() - 1)).bit_length() - 1
    if algo in ("doubling", "multiplying"):
        return 0
    if algo == "radix4":
        return log2p2
    word, _, k = algo.partition(":")
    return min(int(k), log2p2) if k else log2p2


def _units(ranges: list[tuple[int, int]]) -> list[int]:
    return [u for first, count in ranges for u in range(first, first + count)]


def _group_end(steps: list[dict], i: int) -> int:
    """The index after step i's group (steps joined by with_next run at once)."""
    while i < len(steps) - 1 and steps[i]["with_next"]:
        i += 1
    return i + 1


def _groups(steps: list[dict]) -> list[list[dict]]:
    """Steps in their groups."""
    out, i = [], 0
    while i < len(steps):
        out.append(steps[i:_group_end(steps, i)])
        i = _group_end(steps, i)
    return out


def _run(schedules: list[dict], buffers: list[list[int]], fold: bool) -> None:
    """Runs every member's steps as messages: a group of steps posts all its sends (values as
    they are when the group starts), then each step waits for its receive from the partner's
    matching step. Each member's fold steps must all come before its copy steps, and a group is
    all one or the other."""
    for m, s in enumerate(schedules):
        phases = [st["fold"] for st in s["steps"]]
        assert phases == sorted(phases, reverse=True), f"member {m}: a fold step after a copy step"
        assert not s["steps"] or not s["steps"][-1]["with_next"], f"member {m}: the last step joins nothing"
        for i, st in enumerate(s["steps"][:-1]):
            assert not st["with_next"] or st["fold"] == s["steps"][i + 1]["fold"], f"member {m}: mixed group"
    members = len(schedules)
    mail: dict[tuple[int, int], list[tuple[list[int], list[int], bool]]] = {}
    pos = [0] * members
    posted_until = [0] * members  # steps whose sends are posted: the current group's
    while any(pos[m] < len(schedules[m]["steps"]) for m in range(members)):
        progressed = False
        for m in range(members):
            steps = schedules[m]["steps"]
            if pos[m] == len(steps):
                continue
            step = steps[pos[m]]
            if posted_until[m] <= pos[m]:
                posted_until[m] = _group_end(steps, pos[m])
                for st in steps[pos[m]:posted_until[m]]:
                    if st["send_to"] >= 0:
                        units = _units(st["send"])
                        mail.setdefault((m, st["send_to"]), []).append(
                            (units, [buffers[m][u] for u in units], st["fold"]))
            if step["recv_from"] >= 0:
                queue = mail.get((step["recv_from"], m), [])
                if not queue:
                    continue
                units, values, partial = queue.pop(0)
                assert units == _units(step["recv"]), \
                    f"member {m} step {pos[m]}: expects units {_units(step['recv'])}, partner sent {units}"
                # Partial results travel in the reduce phase's buffer (float32 for 16-bit floats),
                # results in the output's: both ends of a message must be in the same phase.
                assert partial == step["fold"], f"member {m} step {pos[m]}: phases differ from its partner's"
                for u, v in zip(units, values):
                    if step["fold"]:
                        assert fold and buffers[m][u] & v == 0, f"member {m}: unit {u} folded twice"
                        buffers[m][u] |= v
                    else:
                        buffers[m][u] = v
            pos[m] += 1
            progressed = True
        assert progressed, f"deadlock: members at steps {pos}"
    assert not any(mail.values()), f"messages nobody received: {mail}"


@pytest.mark.parametrize("algo", ALLREDUCE_ALGOS)
@pytest.mark.parametrize("members", MEMBERS)
def test_allreduce_every_contribution_once(algo: str, members: int) -> None:
    everyone = (1 << members) - 1
    for count in sorted({1, members - 1, members, 2 * members + 3, 37} - {0}):
        schedules = [ENGINE.allreduce_schedule(algo, members, m, count) for m in range(members)]
        buffers = [[1 << m] * count for m in range(members)]
        _run(schedules, buffers, fold=True)
        for m in range(members):
            assert buffers[m] == [everyone] * count, f"{algo}, {members} members, {count} elements: member {m}"
        owned = [u for s in schedules for u in _units(s["owned"])]
        # Before the copies every unit is complete on one member (ring, all halvings), or on
        # the 2^(log2 p2 - K) core members that share a window after K halvings.
        p2 = 1 << (members.bit_length() - 1)
        copies = 1 if algo == "ring" or members == 1 else p2 >> _levels(algo, members)
        assert sorted(owned) == sorted(list(range(count)) * copies), f"{algo}, {members}, {count}: owned {owned}"


@pytest.mark.parametrize("members", MEMBERS)
def test_reduce_scatter_owns_its_blocks(members: int) -> None:
    """Blocks of uneven sizes, some empty, some in two pieces (ranks of a host not adjacent)."""
    everyone = (1 << members) - 1
    count = 5 * members + 2
    blocks = [[(m * 3, 3 if m % 4 else 0)] for m in range(members)]
    taken = members * 3
    for m in range(0, members, 2):  # a second piece for every other member
        blocks[m].append((taken, 2))
        taken += 2
    schedules = [ENGINE.reduce_scatter_schedule(members, m, blocks) for m in range(members)]
    buffers = [[1 << m] * count for m in range(members)]
    _run(schedules, buffers, fold=True)
    for m in range(members):
        for u in _units(blocks[m]):
            assert buffers[m][u] == everyone, f"{members} members: member {m} unit {u}"
        assert _units(schedules[m]["owned"]) == _units(blocks[m])
        assert len(schedules[m]["steps"]) == members - 1


@pytest.mark.parametrize("shape", ["doubling", "multiplying"])
@pytest.mark.parametrize("members", MEMBERS)
def test_headers_ride_on_their_shape(shape: str, members: int) -> None:
    """The header exchange (carried_along over Doubling or Multiplying): every member ends with
    every member's header block, a group's steps send only blocks known when the group starts,
    and what a step sends is what its partner's matching step expects to receive."""
    along = [ENGINE.carried_along(shape, members, me) for me in range(members)]
    for me in range(members):
        steps = ENGINE.allreduce_schedule(shape, members, me, 1)["steps"]
        assert len(along[me]) == len(steps)
        known, i = {me}, 0
        for group in _groups(steps):
            for sent, _ in along[me][i:i + len(group)]:
                assert set(sent) <= known, f"{shape}, {members} members: member {me} sends {sent}, knows {known}"
            for _, received in along[me][i:i + len(group)]:
                known |= set(received)
            i += len(group)
        assert known == set(range(members)), f"{members} members: member {me} ends knowing {sorted(known)}"
    # Messages pair up: the k-th message from a to b is read by b's k-th step receiving from a.
    out: dict[tuple[int, int], list[list[int]]] = {}
    into: dict[tuple[int, int], list[list[int]]] = {}
    for me in range(members):
        for step, (sent, received) in zip(ENGINE.allreduce_schedule(shape, members, me, 1)["steps"], along[me]):
            if step["send_to"] >= 0:
                out.setdefault((me, step["send_to"]), []).append(sent)
            if step["recv_from"] >= 0:
                into.setdefault((step["recv_from"], me), []).append(received)
    assert out == into


@pytest.mark.parametrize(("shape", "algo"), CARRIED)
@pytest.mark.parametrize("members", MEMBERS)
def test_carried_schedules_begin_with_the_header_exchange(shape: str, algo: str, members: int) -> None:
    """Doubling and Rabenseifner (any halvings) ride on a header exchange of Doubling's shape,
    Multiplying and Radix4 on one of Multiplying's (transport/tcp/headers.cpp): each member's
    fold in and core steps are the header exchange's steps with the same partners in the same
    order and groups, and its fold out is the header exchange's last step; only the way back
    (Rabenseifner's, Radix4's) comes between."""
    p2 = 1 << (members.bit_length() - 1)
    log2p2 = p2.bit_length() - 1
    for me in range(members):
        head = ENGINE.allreduce_schedule(shape, members, me, 1)["steps"]
        plan = ENGINE.allreduce_schedule(algo, members, me, 40)["steps"]
        folds = me < 2 * (members - p2)
        core = len(head) - (1 if folds else 0)
        pairs = [(s["send_to"], s["recv_from"], s["with_next"]) for s in plan]
        assert pairs[:core] == [(s["send_to"], s["recv_from"], s["with_next"]) for s in head[:core]], \
            f"{algo}, {members}: {me}"
        if folds:
            assert pairs[-1] == (head[-1]["send_to"], head[-1]["recv_from"], False), f"{algo}, {members}: {me}"
        coreless = folds and me % 2 == 0  # sits out: sends in, receives out
        back = 3 * (log2p2 // 2) + log2p2 % 2 if algo == "radix4" else _levels(algo, members)
        between = 0 if coreless else back
        assert len(plan) == len(head) + between, f"{algo}, {members}: member {me}"
        assert all(s["fold"] for s in plan[:core]) or coreless


@pytest.mark.parametrize("members", MEMBERS)
def test_depths(members: int) -> None:
    p2 = 1 << (members.bit_length() - 1)
    log2p2, ceil_log2 = p2.bit_length() - 1, math.ceil(math.log2(members)) if members > 1 else 0
    fold = 2 if members > p2 else 0
    steps = {a: max(len(ENGINE.allreduce_schedule(a, members, m, 64)["steps"]) for m in range(members))
             for a in ALLREDUCE_ALGOS}
    assert steps["ring"] == 2 * (members - 1)
    assert steps["doubling"] == log2p2 + fold
    assert steps["rabenseifner"] == 2 * log2p2 + fold
    for k in (1, 2, 3):
        assert steps[f"rabenseifner:{k}"] == log2p2 + min(k, log2p2) + fold
    # Radix4: one group per level each way (a radix-2 level first when log2 p2 is odd), the
    # groups of radix 4 three steps each.
    radix_levels = (log2p2 + 1) // 2
    groups = max(len(_groups(ENGINE.allreduce_schedule("radix4", members, m, 64)["steps"])) for m in range(members))
    assert groups == 2 * radix_levels + fold
    assert steps["radix4"] == 2 * (3 * (log2p2 // 2) + log2p2 % 2) + fold
    # Multiplying: Radix4's first half on the whole buffer.
    groups = max(len(_groups(ENGINE.allreduce_schedule("multiplying", members, m, 64)["steps"]))
                 for m in range(members))
    assert groups == radix_levels + fold
    assert steps["multiplying"] == 3 * (log2p2 // 2) + log2p2 % 2 + fold
    assert max(len(ENGINE.allgather_schedule("bruck", members, m)["steps"]) for m in range(members)) == ceil_log2
    for root in {0, members // 2, members - 1}:
        depth = [len(ENGINE.broadcast_schedule("tree", members, m, root, 100)["steps"]) for m in range(members)]
        assert max(depth) <= ceil_log2 and (members == 1 or min(depth) >= 1)


@pytest.mark.parametrize("algo", ["ring", "bruck"])
@pytest.mark.parametrize("members", MEMBERS)
def test_allgather_every_block_everywhere(algo: str, members: int) -> None:
    schedules = [ENGINE.allgather_schedule(algo, members, m) for m in range(members)]
    buffers = [[(1 << b) if b == m else 0 for b in range(members)] for m in range(members)]
    _run(schedules, buffers, fold=False)
    for m in range(members):
        assert buffers[m] == [1 << b for b in range(members)], f"{algo}, {members}: member {m}"


@pytest.mark.parametrize("algo", ["ring", "tree"])
@pytest.mark.parametrize("members", MEMBERS)
def test_broadcast_reaches_everyone(algo: str, members: int) -> None:
    nbytes, segment = 10, 3
    for root in sorted({0, 1 % members, members - 1}):
        schedules = [ENGINE.broadcast_schedule(algo, members, m, root, nbytes, segment) for m in range(members)]
        buffers = [[7] * nbytes if m == root else [0] * nbytes for m in range(members)]
        _run(schedules, buffers, fold=False)
        assert all(b == [7] * nbytes for b in buffers), f"{algo}, {members} members, root {root}: {buffers}"


@pytest.mark.parametrize("members", MEMBERS)
def test_steps_only_name_partners(members: int) -> None:
    partners = [set(ENGINE.partners_of(members, m)) for m in range(members)]
    for m in range(members):
        assert m not in partners[m]
        assert all(m in partners[p] for p in partners[m]), f"{members}: partners of {m} not symmetric"
        schedules = [ENGINE.allreduce_schedule(a, members, m, 50) for a in ALLREDUCE_ALGOS]
        schedules += [ENGINE.allgather_schedule(a, members, m) for a in ("ring", "bruck")]
        schedules += [ENGINE.broadcast_schedule(a, members, m, r, 9, 4) for a in ("ring", "tree")
                      for r in range(members)]
        named = {p for s in schedules for st in s["steps"] for p in (st["send_to"], st["recv_from"]) if p >= 0}
        assert named <= partners[m], f"{members} members: member {m} talks to {named - partners[m]}"
    # Ring and distance-2^k neighbours both ways, the fold partner, one more per radix-4 level.
    ceil_log2 = max(1, math.ceil(math.log2(max(members, 2))))
    assert max(len(p) for p in partners) <= 2 * ceil_log2 + 2 + (ceil_log2 + 1) // 2


@pytest.mark.parametrize("algo", ALLREDUCE_ALGOS)
@pytest.mark.parametrize("members", [2, 3, 4, 5, 7, 8, 12, 16])
def test_closed_form_is_the_slowest_members_steps(algo: str, members: int) -> None:
    alpha, beta, gamma, group = 30e-6, 1e-9, 0.3e-9, 55e-6  # a group of three transfers: its own alpha
    for count in (members * 64, members * 64 + 5):
        steps = max(ENGINE.schedule_seconds("allreduce", algo, members, m, count, 4, alpha, beta, gamma, group)
                    for m in range(members))
        closed = ENGINE.allreduce_seconds(algo, members, count, 4, alpha, beta, gamma, group)
        if count % (1 << (members.bit_length())) == 0 or count % members == 0 and algo == "ring":
            assert closed == pytest.approx(steps, rel=1e-9), f"{algo}, {members}, {count}"
        assert closed >= steps * (1 - 1e-9), f"{algo}, {members}, {count}: closed {closed} < steps {steps}"
        assert closed <= steps * 1.05 + 1e-12, f"{algo}, {members}, {count}: closed {closed} >> steps {steps}"


def test_choice_follows_size_and_host_count() -> None:
    alpha, beta, gamma = 50e-6, 1 / 1.25e9, 0.2e-9  # 10 Gbit/s
    choose = ENGINE.choose_allreduce
    # The smallest: the whole buffer in the fewest steps, riding on the header exchange, whose
    # shape is Multiplying's where a group costs less than two steps, else Doubling's.
    assert choose("auto", 16, 2, 4, alpha, beta, gamma) == "multiplying"
    assert choose("auto", 16, 2, 4, alpha, beta, gamma, 2 * alpha) == "doubling"
    assert ENGINE.header_algo(16, alpha) == "multiplying" and ENGINE.header_algo(16, alpha, 2 * alpha) == "doubling"
    assert ENGINE.header_algo(2, alpha) == "doubling"  # one level: a group saves nothing
    # Near a tie (within the tenth alphaGroup's measurements spread), Doubling's shape stays.
    assert ENGINE.header_algo(16, alpha, 1.85 * alpha) == "doubling"
    assert ENGINE.header_algo(16, alpha, 1.75 * alpha) == "multiplying"
    assert ENGINE.header_seconds(16, alpha) == pytest.approx(2 * alpha)
    assert ENGINE.header_seconds(17, alpha, 1.5 * alpha) == pytest.approx(2 * alpha + 2 * 1.5 * alpha)
    # The middle and the large: Radix4 (Rabenseifner's bytes in half its steps: its groups of
    # three transfers cost one alpha each), riding on Multiplying's header up to where its copy
    # costs more than the header's groups; on 2 or 3 hosts Rabenseifner's one halving.
    assert choose("auto", 16, 1 << 16, 4, alpha, beta, gamma) == "radix4"
    assert choose("auto", 16, 1 << 22, 4, alpha, beta, gamma) == "radix4"
    assert choose("auto", 3, 1 << 22, 4, alpha, beta, gamma) in ("ring", "rabenseifner")
    assert choose("radix4", 16, 2, 4, alpha, beta, gamma) == "radix4"
    # Where a group of three costs what three steps do (a leader's CPU, not the wire, sets the
    # time: alpha_group measured at init), the header keeps Doubling's shape, Radix4 saves
    # nothing and Rabenseifner (fewer halvings than all in the middle) stays.
    assert choose("auto", 16, 1 << 16, 4, alpha, beta, gamma, 3 * alpha).startswith("rabenseifner")
    assert choose("auto", 1024, 1 << 14, 4, 10e-6, beta, gamma, 30e-6) not in ("doubling", "rabenseifner", "ring")
    assert choose("auto", 16, 1 << 22, 4, alpha, beta, gamma, 3 * alpha) == "rabenseifner"
    assert choose("auto", 16, 1 << 22, 4, alpha, beta, gamma, 1.5 * alpha) == "radix4"
    assert choose("rabenseifner:2", 16, 2, 4, alpha, beta, gamma) == "rabenseifner:2"
    assert choose("auto", 2, 1 << 24, 4, alpha, beta, gamma) in ("ring", "rabenseifner")
    assert choose("ring", 16, 2, 4, alpha, beta, gamma) == "ring"
    assert choose("doubling", 16, 1 << 24, 4, alpha, beta, gamma) == "doubling"
    assert list(ENGINE.ALGOS) == ["auto", "ring", "doubling", "rabenseifner", "tree", "bruck", "radix4",
                                  "multiplying"]
    # Only an allreduce whose first steps are the header's shape rides on it.
    assert ENGINE.rides_on_headers("radix4", 16, 2, 4, alpha, beta, gamma)
    assert not ENGINE.rides_on_headers("radix4", 16, 2, 4, alpha, beta, gamma, 2 * alpha)
    assert not ENGINE.rides_on_headers("rabenseifner", 16, 2, 4, alpha, beta, gamma)
    assert ENGINE.rides_on_headers("rabenseifner", 16, 2, 4, alpha, beta, gamma, 2 * alpha)
    # The copy into the leader's buffer: none where every host has several ranks (staged), so
    # a large allreduce rides there and not on hosts of one rank.
    big = 1 << 20  # 4 MiB: its copy (0.8 ms) costs more than the header's two groups
    assert not ENGINE.rides_on_headers("radix4", 16, big, 4, alpha, beta, gamma)
    assert ENGINE.rides_on_headers("radix4", 16, big, 4, alpha, beta, gamma, staged=True)
    assert ENGINE.carry_seconds(4 * big, alpha, beta, gamma, staged=True) == 0
    assert ENGINE.carry_seconds(4 * big, alpha, beta, gamma) == pytest.approx(4 * big * gamma)
    too_big = ENGINE.carried_limit_bytes() // 4 + 1
    assert not ENGINE.rides_on_headers("radix4", 16, too_big, 4, alpha, beta, gamma, staged=True)
    with pytest.raises(ValueError, match="no cross-host algorithm named 'tree-ish'"):
        choose("tree-ish", 4, 1, 4, alpha, beta, gamma)
    with pytest.raises(ValueError, match="only rabenseifner takes a count of halvings"):
        choose("doubling:2", 4, 1, 4, alpha, beta, gamma)
