"""Scale model: torchring's cross-host allreduce at 16-1024 hosts, from the engine's own schedules.

    python benchmarks/scale_model.py                  # the projection: 16..1024 hosts x 8 ranks, 10/100/400
                                                      # Gbit/s, D = 5/10/50 µs, 4 B..256 MiB; writes scale_model.png
    python benchmarks/scale_model.py --quick          # 16..128 hosts, every 16th size (under a minute)
    python benchmarks/scale_model.py --hosts 48,96,1000 --rates 100 --latency-us 10 --json proj.json
    python benchmarks/scale_model.py --straggler-us 500 --leaf 32 --oversub 4   # a late leader, a thin spine
    python benchmarks/scale_model.py --validate xh.json  # against benchmarks/scaleout.py's measurements
    python benchmarks/scale_model.py --engine simgrid --hosts 16,32 --sizes 1K,1M   # SimGrid replays instead

Method. benchmarks/_scale_sim.py reads every host leader's steps from the engine's bindings
(the header exchange every operation starts with: Doubling's steps, E.allreduce_schedule, each
message a 152-byte summary of the headers its sender knows; then E.allreduce_schedule for
the data, or, for a Doubling or Rabenseifner allreduce riding on the header exchange, its own
schedule carrying the summaries on its first steps and the copy E.carry_seconds), adds the host's
shared-memory stages (a + n/bw before, for the host's reduce, and after, for its broadcast; none at
one rank per host) and replays them as messages over one full-duplex NIC per leader (bandwidth B
each way, max-min fair sharing of every link, eager sends), a step costing s (software,
--overhead-us) + D (wire, --latency-us) + its bytes at the shared rate + gamma per byte folded.
So alpha = D + s and beta = 1/B, the cost model's terms (torchring/csrc/schedule/cost.h), and the
engine's choice is E.choose_allreduce("auto", ...) with that alpha, beta and gamma. Uncontended,
the replay equals the closed form E.allreduce_seconds (plus the stages' and the header exchange's,
the cost model's step rule along its steps), which is printed alongside; the two differ where messages share a link (stragglers, non-power-of-two folds,
--oversub), or where a step moves no byte (the engine skips empty spans: s only). The projection's
--latency-us values are D, so α = D + s (25, 30, 70 µs by default; --overhead-us 0 makes them α).
One caveat: the engine runs the ring as one stream (transport/tcp/ring.cpp), which hides part of
each step's α behind the transfer; the replay, like the cost model, charges it whole.

--validate reads benchmarks/scaleout.py's JSON (rows with library, algo, hosts, per_host, bytes,
seconds, latency_us, rate_bits, alpha, beta, gamma) and predicts each torchring row: B from
rate_bits (1/beta when null), D from latency_us, s = alpha - D (the measured α is one 8-byte
step) unless --overhead-us is given, the measured gamma; a shaped row's uplinks are the token
buckets tc's tbf makes of the test hosts' links (tests/support/_hosts.py tbf_burst: 100 KB at
200 Mbit/s, so after a pause a smaller message leaves at the unshaped speed; --no-bucket: none);
and its switch forwards one packet at a time (the latency router's one thread: a + b·bytes per
packet, switch_a and switch_b, from its own timing of its reads and writes during the run; at 16
hosts it carries a burst of 48 one-packet messages per Multiplying group; --no-switch: none; an
unshaped row has none either, its β being measured through the router already);
an "auto" row replays the algorithm it names as chosen (else what E.choose_allreduce picks from the measured α, β, γ). 16-bit rows count 4-byte
elements (the engine folds float32 partial sums; its 16-bit copy steps move half of that).

Engines: the flow simulator (_scale_sim.simulate) wherever a point has at most --sim-steps
leader-steps (every log-depth point up to 1024 hosts, the ring up to 128 hosts by default); past
that the closed form ("closed" in the rows) where the replay equals it: the ring always (a ring
step sends to the right and receives from the left, so no host link carries two flows, and a
leaf's spine link carries one), any algorithm on one non-blocking switch; a straggler's delay is
added whole there (every leader's result waits for the late one's data along a chain of steps).
An oversubscribed spine (--leaf, --oversub > 1) is always replayed for the log-depth algorithms.
SimGrid (--engine simgrid) replays the same plans and agrees with the flow simulator to 1e-9
(tests/unit/test_scale_model.py), but its Python actors run on OS threads: about 135 µs per
leader-step here, too slow for the projection (see _scale_sim's docstring).

The bound: allreduce among H hosts needs ceil(log2 H) steps (each at most doubles the hosts a value
has reached), sends and receives 2(H-1)/H·n bytes per host (reduce-scatter's share plus
allgather's; Chan et al. 2007) and folds (H-1)/H·n bytes per host; in the cost model's no-overlap
terms: ceil(log2 H)·α + 2(H-1)/H·n·β + (H-1)/H·n·γ. The ratios compare the cross-host time (header
exchange + the algorithm, the shared-memory stages excluded: the bound is among hosts) with it;
"data" ratios leave out what the header exchange adds (its steps, or for an allreduce riding on
it its header bytes). The goal: choice/bound <= 1.3 everywhere.

Defaults: s = 20 µs: torchring's TCP send/recv of 4 B over loopback (no wire) took 39-44 µs one
way on the 2-vCPU VM (benchmarks/RESULTS.md, exchange.py p2p tcp), which includes a Python call
and wake-ups on shared vCPUs that a leader's worker thread on a dedicated core mostly avoids;
gamma = 0.1 ns/B: one core summing float32 buffers that do not fit in cache (two reads and a write
per element; the engine's probe sums a cache-resident 1 MiB, 0.03 ns/B here); shared memory a =
5 µs, bw = 10 GB/s per stage (one-host allreduce, world 2: 1 µs at 4 B, 12-18 GB/s at 1-16 MiB,
benchmarks/RESULTS.md; eight ranks per host fan in more).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE), os.path.join(os.path.dirname(_HERE), "tests", "support")]

import _scale_sim as sim  # noqa: E402
from _harness import common_args, finish, machine_info, print_header  # noqa: E402
from _sizes import fmt_size, parse_size  # noqa: E402

# h: halving + doubling; q: radix 4; m: recursive multiplying (radix 4)
MARK = {"ring": "r", "doubling": "d", "rabenseifner": "h", "radix4": "q", "multiplying": "m"}
DTYPE_BYTES = {"fp32": 4, "float32": 4, "fp64": 8, "float64": 8, "bf16": 2, "bfloat16": 2, "fp16": 2,
               "float16": 2}
DEFAULT_SIZES = ",".join(str(4 ** k) for k in range(1, 15))  # 4 B .. 256 MiB
QUICK_SIZES = ",".join(str(4 * 16 ** k) for k in range(7))  # 4 B .. 64 MiB


def _mark(algo: str) -> str:
    """The table's letter for an algorithm: r, d, h (all halvings), hK (K halvings, then doubling), q (Radix4),
    m (Multiplying)."""
    word, _, levels = algo.partition(":")
    return MARK[word] + levels


def _engine() -> Any:
    from torchring._core import build

    return build.load()


def run_point(E: Any, a: argparse.Namespace, algo: str, hosts: int, per_host: int, count: int, esize: int,
              net: sim.Net, shm: sim.Shm) -> tuple[float, str]:
    """Seconds of one allreduce running `algo` among the leaders, and the engine that timed it."""
    steps = hosts * (len(E.allreduce_schedule(algo, hosts, 0, count)["steps"]) + 2 * (hosts - 1).bit_length() + 2)
    late = [0.0] * hosts
    if a.straggler_us:
        late[random.Random(a.seed * 100003 + hosts).randrange(hosts)] = a.straggler_us * 1e-6
    # Past the budget the closed form stands in where nothing can share a link: the ring (its
    # neighbours share no link, and a leaf's spine link carries at most one of its flows), or
    # any algorithm without an oversubscribed spine (a late leader's delay is then added whole).
    shared = algo != "ring" and a.leaf and a.oversub > 1
    if a.engine == "closed" or (steps > a.sim_steps and not shared):
        return sum(sim.closed_form(E, algo, hosts, per_host, count, esize, net, shm).values()) + max(late), "closed"
    plans = sim.plan(E, algo, hosts, per_host, count, esize, shm, net)
    if a.engine == "simgrid":
        return max(sim.simulate_simgrid(plans, net, late)), "simgrid"
    return max(sim.simulate(plans, net, late)), "flow"


def project(E: Any, a: argparse.Namespace) -> list[dict]:
    """Every (hosts, rate, D, size) point: the engine's choice, the ring, the bound."""
    rows, shm = [], sim.Shm(a.shm_a * 1e-6, a.shm_bw * 1e9)
    for hosts in map(int, a.hosts.split(",")):
        for rate in map(float, a.rates.split(",")):
            for lat in map(float, a.latency_us.split(",")):
                net = sim.Net(rate * 1e9 / 8, lat * 1e-6, a.overhead_us * 1e-6, a.gamma_ns * 1e-9, a.leaf,
                              a.oversub, not a.rendezvous, a.group_extra_us * 1e-6)
                for nbytes in map(parse_size, a.sizes.split(",")):
                    count = max(1, nbytes // a.esize)
                    bound = sim.lower_bound(hosts, count * a.esize, net)
                    row = {"hosts": hosts, "per_host": a.per_host, "rate_gbit": rate, "latency_us": lat,
                           "overhead_us": a.overhead_us, "alpha_us": net.alpha * 1e6, "bytes": count * a.esize,
                           "bound_s": bound}
                    choice = E.choose_allreduce("auto", hosts, count, a.esize, net.alpha, net.beta, net.gamma,
                                                net.alpha_group, staged=a.per_host > 1)
                    for label, algo in (("choice", choice), ("ring", "ring")):
                        secs, engine = run_point(E, a, algo, hosts, a.per_host, count, a.esize, net, shm)
                        closed = sim.closed_form(E, algo, hosts, a.per_host, count, a.esize, net, shm)
                        cross = secs - closed["shm"]
                        row[label] = {"algo": algo, "engine": engine, "seconds": secs, "closed_s": sum(closed.values()),
                                      "header_s": closed["header"], "shm_s": closed["shm"], "cross_s": cross,
                                      "ratio": cross / bound, "data_ratio": (cross - closed["header"]) / bound}
                    rows.append(row)
        print(f"  {hosts} hosts done", file=sys.stderr, flush=True)
    return rows


def print_projection(rows: list[dict], goal: float) -> None:
    """Ratio tables (choice, ring) per (hosts, rate, D) over sizes; worst ratios; misses."""
    sizes = sorted({r["bytes"] for r in rows})
    keys = sorted({(r["hosts"], r["rate_gbit"], r["latency_us"]) for r in rows})
    at = {(r["hosts"], r["rate_gbit"], r["latency_us"], r["bytes"]): r for r in rows}
    for label in ("choice", "ring"):
        print(f"\n{label} / bound (cross-host time: header exchange + algorithm; "
              f"{'letter = algorithm chosen: r ring, d doubling, h Rabenseifner, hK its K halvings, q radix4, m multiplying; ' if label == 'choice' else ''}"
              f"* = above {goal})")
        print("| hosts | Gbit/s | D µs | " + " | ".join(fmt_size(n) for n in sizes) + " |")
        print("|---|---|---|" + "---|" * len(sizes))
        for h, rate, lat in keys:
            cells = []
            for n in sizes:
                c = at[(h, rate, lat, n)][label]
                cells.append(f"{c['ratio']:.2f}{_mark(c['algo']) if label == 'choice' else ''}"
                             f"{'*' if c['ratio'] > goal else ''}")
            print(f"| {h} | {rate:g} | {lat:g} | " + " | ".join(cells) + " |")
    print("\nworst ratio per (hosts, rate, D) [size, algorithm]; data = without the header exchange")
    print("| hosts | Gbit/s | D µs | α µs | choice/bound | choice data/bound | ring/bound | sizes above goal |")
    print("|---|---|---|---|---|---|---|---|")
    for h, rate, lat in keys:
        mine = [at[(h, rate, lat, n)] for n in sizes]
        wc = max(mine, key=lambda r: r["choice"]["ratio"])
        wd = max(mine, key=lambda r: r["choice"]["data_ratio"])
        wr = max(mine, key=lambda r: r["ring"]["ratio"])
        miss = [fmt_size(r["bytes"]) for r in mine if r["choice"]["ratio"] > goal]
        print(f"| {h} | {rate:g} | {lat:g} | {wc['alpha_us']:g} | {wc['choice']['ratio']:.2f} "
              f"[{fmt_size(wc['bytes'])}, {wc['choice']['algo']}] | {wd['choice']['data_ratio']:.2f} "
              f"[{fmt_size(wd['bytes'])}, {wd['choice']['algo']}] | {wr['ring']['ratio']:.2f} "
              f"[{fmt_size(wr['bytes'])}] | {', '.join(miss) or '-'} |")
    print("\nworst choice/bound per (rate, D), over hosts and sizes")
    for rate, lat in sorted({(k[1], k[2]) for k in keys}):
        mine = [r for r in rows if (r["rate_gbit"], r["latency_us"]) == (rate, lat)]
        w = max(mine, key=lambda r: r["choice"]["ratio"])
        wd = max(mine, key=lambda r: r["choice"]["data_ratio"])
        n_miss = sum(r["choice"]["ratio"] > goal for r in mine)
        print(f"  {rate:g} Gbit/s, D {lat:g} µs (α {w['alpha_us']:g} µs): {w['choice']['ratio']:.2f} at "
              f"{w['hosts']} hosts, {fmt_size(w['bytes'])} ({w['choice']['algo']}); without the header "
              f"{wd['choice']['data_ratio']:.2f} at {wd['hosts']} hosts, {fmt_size(wd['bytes'])} "
              f"({wd['choice']['algo']}); {n_miss} of {len(mine)} points above {goal}")
    both = [(r[k]["seconds"], r[k]["closed_s"]) for r in rows for k in ("choice", "ring")
            if r[k]["engine"] != "closed"]
    if both:
        dev = max(abs(s / c - 1) for s, c in both)
        print(f"\nreplayed points: {len(both)}; largest |replay / closed form - 1| = {dev:.2e} (they differ "
              "where messages share a link, a leader is late or a step moves no byte)")


def plot(rows: list[dict], path: str, latency: float, goal: float) -> None:
    """Cross-host time against size: choice, ring, bound; one panel per (rate, hosts) at one D."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hosts = sorted({r["hosts"] for r in rows})
    hosts = sorted({hosts[0], hosts[len(hosts) // 2], hosts[-1]})
    rates = sorted({r["rate_gbit"] for r in rows})
    fig, axes = plt.subplots(len(rates), len(hosts), figsize=(4.4 * len(hosts), 3.4 * len(rates)), squeeze=False)
    for i, rate in enumerate(rates):
        for j, h in enumerate(hosts):
            ax = axes[i][j]
            mine = sorted((r for r in rows if (r["hosts"], r["rate_gbit"], r["latency_us"]) == (h, rate, latency)),
                          key=lambda r: r["bytes"])
            x = [r["bytes"] for r in mine]
            ax.plot(x, [r["choice"]["cross_s"] * 1e3 for r in mine], "o-", ms=3, lw=2, label="choice")
            for algo, mark in MARK.items():
                pts = [(r["bytes"], r["choice"]["cross_s"] * 1e3) for r in mine if r["choice"]["algo"] == algo]
                if pts:
                    ax.plot(*zip(*pts), "o", ms=5, label=f"  ({algo})", mfc="none")
            ax.plot(x, [(r["choice"]["cross_s"] - r["choice"]["header_s"]) * 1e3 for r in mine], "-.", lw=1,
                    color="C0", label="choice, no header")
            ax.plot(x, [r["ring"]["cross_s"] * 1e3 for r in mine], "--", label="ring")
            ax.plot(x, [r["bound_s"] * 1e3 for r in mine], ":", color="k", label="bound")
            ax.fill_between(x, [r["bound_s"] * 1e3 for r in mine], [r["bound_s"] * goal * 1e3 for r in mine],
                            color="grey", alpha=0.2, label=f"bound .. {goal:g}x")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{h} hosts, {rate:g} Gbit/s, D {latency:g} µs", fontsize=9)
            ax.set_xlabel("bytes")
            ax.set_ylabel("ms (cross-host)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle("torchring allreduce among hosts: the engine's choice, the ring, the α-β-γ bound", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def validate(E: Any, a: argparse.Namespace, measured: list[dict]) -> list[dict]:
    """Predicted against measured seconds for every torchring row of scaleout.py's JSON."""
    from _hosts import tbf_burst  # the test hosts' shaping (tests/support), for shaped rows
    from _latency import TUN_MTU  # the test hosts' packets, for the switch

    rows, shm = [], sim.Shm(a.shm_a * 1e-6, a.shm_bw * 1e9)
    for m in measured:
        if m.get("library", "torchring") != "torchring":
            continue
        hosts, per_host, nbytes = int(m["hosts"]), int(m["per_host"]), int(m["bytes"])
        dtype = m.get("dtype", "fp32")
        count = max(1, nbytes // DTYPE_BYTES.get(dtype, a.esize))
        esize = 4 if DTYPE_BYTES.get(dtype) == 2 else DTYPE_BYTES.get(dtype, a.esize)
        lat = (m.get("latency_us") or 0.0) * 1e-6
        s = a.overhead_us * 1e-6 if a.overhead_explicit else max(m["alpha"] - lat, 0.0)
        bw = m["rate_bits"] / 8 if m.get("rate_bits") else 1.0 / m["beta"]
        extra = max(m.get("alpha_group", m["alpha"]) - m["alpha"], 0.0)  # what a group costs beyond a step
        bucket = tbf_burst(int(m["rate_bits"])) if m.get("rate_bits") and not a.no_bucket else 0
        # Unshaped, the link is the router itself (β measured through it): no switch on top.
        shaped = bool(m.get("rate_bits")) and not a.no_switch
        switch = (m.get("switch_a") or 0.0, m.get("switch_b") or 0.0) if shaped else (0.0, 0.0)
        net = sim.Net(bw, lat, s, m["gamma"], 0, 1.0, not a.rendezvous, extra, bucket, *switch, TUN_MTU - 40)
        forced = m["algo"]
        algo = m.get("chosen") or E.choose_allreduce(forced, hosts, count, esize, m["alpha"], m["beta"], m["gamma"],
                                                     net.alpha_group, staged=per_host > 1)
        pred, engine = run_point(E, a, algo, hosts, per_host, count, esize, net, shm)
        closed = sum(sim.closed_form(E, algo, hosts, per_host, count, esize, net, shm).values())
        rows.append({"hosts": hosts, "per_host": per_host, "bytes": nbytes, "algo": forced, "ran": algo,
                     "engine": engine, "predicted_s": pred, "closed_s": closed, "measured_s": m["seconds"],
                     "ratio": pred / m["seconds"], "overhead_us": s * 1e6, "latency_us": lat * 1e6})
    return rows


def print_validation(rows: list[dict], tolerance: float) -> None:
    """The hosts x size x algorithm table and the summary line."""
    print("| hosts | per host | size | algo (ran) | predicted ms | closed form ms | measured ms | pred/meas |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["hosts"], r["per_host"], r["bytes"], r["algo"])):
        print(f"| {r['hosts']} | {r['per_host']} | {fmt_size(r['bytes'])} | {r['algo']} ({r['ran']}) | "
              f"{r['predicted_s'] * 1e3:.3f} | {r['closed_s'] * 1e3:.3f} | {r['measured_s'] * 1e3:.3f} | "
              f"{r['ratio']:.2f}{'' if abs(r['ratio'] - 1) <= tolerance else ' *'} |")
    within = sum(abs(r["ratio"] - 1) <= tolerance for r in rows)
    print(f"\n{within} of {len(rows)} predictions within {tolerance:.0%} of the measurement (* outside)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--project", action="store_true", help="the projection (the default without --validate)")
    p.add_argument("--validate", metavar="FILE.json", help="compare with benchmarks/scaleout.py's JSON rows")
    p.add_argument("--hosts", default="16,32,64,128,256,512,1024", help="host counts (default 16..1024)")
    p.add_argument("--per-host", type=int, default=8, help="ranks per host (default 8)")
    p.add_argument("--rates", default="10,100,400", help="link rates, Gbit/s (default 10,100,400)")
    p.add_argument("--latency-us", default="5,10,50", help="wire latency D per message, µs (default 5,10,50)")
    p.add_argument("--overhead-us", type=float, default=None,
                   help="software cost s per step, µs (default 20; --validate: the row's alpha - D)")
    p.add_argument("--gamma-ns", type=float, default=0.1, help="fold cost, ns per byte (default 0.1)")
    p.add_argument("--group-extra-us", type=float, default=0.0,
                   help="what a group of transfers at once costs beyond a step, µs (default 0: one alpha)")
    p.add_argument("--sizes", default=None, help="bytes, K/M/G suffixes (default 4 B..256 MiB, powers of 4)")
    p.add_argument("--esize", type=int, default=4, help="element bytes (default 4: float32)")
    p.add_argument("--shm-a", type=float, default=5.0, help="shared-memory stage, fixed µs (default 5)")
    p.add_argument("--shm-bw", type=float, default=10.0, help="shared-memory stage, GB/s (default 10)")
    p.add_argument("--straggler-us", type=float, default=0.0, help="one random leader starts this late")
    p.add_argument("--seed", type=int, default=1, help="picks the straggler (default 1)")
    p.add_argument("--leaf", type=int, default=0, help="hosts per leaf switch (default 0: one switch)")
    p.add_argument("--oversub", type=float, default=1.0, help="leaf-to-spine oversubscription (default 1)")
    p.add_argument("--rendezvous", action="store_true", help="a message flows once its receive is posted")
    p.add_argument("--engine", choices=("flow", "simgrid", "closed"), default="flow",
                   help="flow simulator (default; closed form past --sim-steps), SimGrid, or closed form only")
    p.add_argument("--sim-steps", type=int, default=40000, help="most leader-steps replayed per point")
    p.add_argument("--goal", type=float, default=1.3, help="the target choice/bound (default 1.3)")
    p.add_argument("--tolerance", type=float, default=0.15, help="--validate: 'within' (default 0.15)")
    p.add_argument("--no-bucket", action="store_true",
                   help="--validate: shaped rows' links without the test hosts' tbf bucket")
    p.add_argument("--no-switch", action="store_true",
                   help="--validate: no time for the test hosts' router to forward each packet")
    p.add_argument("--plot", default=os.path.join(_HERE, "scale_model.png"), help="the PNG ('none': no plot)")
    common_args(p, quick="16..128 hosts, sizes 4 B..64 MiB in steps of 16x")
    a = p.parse_args(argv)
    a.overhead_explicit = a.overhead_us is not None
    a.overhead_us = 20.0 if a.overhead_us is None else a.overhead_us
    if a.quick:
        a.hosts = "16,32,64,128"
    a.sizes = a.sizes or (QUICK_SIZES if a.quick else DEFAULT_SIZES)
    E = _engine()
    info = machine_info()
    if a.validate:
        with open(a.validate) as f:
            measured = json.load(f)["rows"]
        print_header("scale model against measurements", info, f"engine {a.engine}")
        rows = validate(E, a, measured)
        print_validation(rows, a.tolerance)
    else:
        print_header("scale model: allreduce among hosts", info, f"engine {a.engine}")
        print(f"{a.per_host} ranks per host; s {a.overhead_us:g} µs per step (α = D + s), γ {a.gamma_ns:g} ns/B, "
              f"fp{8 * a.esize}; shared memory {a.shm_a:g} µs + n / {a.shm_bw:g} GB/s per stage"
              + (f"; a straggler {a.straggler_us:g} µs late" if a.straggler_us else "")
              + (f"; leaves of {a.leaf} hosts, oversubscription {a.oversub:g}" if a.leaf else "")
              + ("; rendezvous sends" if a.rendezvous else "; eager sends"), flush=True)
        rows = project(E, a)
        print_projection(rows, a.goal)
        if a.plot != "none":
            lat = sorted(map(float, a.latency_us.split(",")))
            try:
                plot(rows, a.plot, lat[len(lat) // 2], a.goal)
                print(f"wrote {a.plot}")
            except ImportError as e:  # the tables and the JSON stand without the picture
                print(f"no plot: {e.name} is not installed (pip install matplotlib, or --plot none)", file=sys.stderr)
    finish(a, info, rows, 0)


if __name__ == "__main__":
    main()
