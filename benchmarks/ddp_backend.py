"""DDP on the torchring backend vs DDP on gloo vs torchring.wrap, and what the backend adds per call.

    python benchmarks/ddp_backend.py                     # both sections, world 2 (about 2 minutes on 2 cores)
    python benchmarks/ddp_backend.py --json ddp-backend.json   # also the machine, commit and every round
    python benchmarks/ddp_backend.py --quick             # smoke run: small MLP, 2 rounds, 2 sizes
    python benchmarks/ddp_backend.py --only step --rounds 20
    python benchmarks/ddp_backend.py --only latency --sizes 4,64,1K --trials 15

Every rank (spawned once, torch.set_num_threads(1)) joins torch.distributed with
init_process_group("torchring") as its default group, a second group of the same ranks with
dist.new_group(backend="gloo"), and torchring itself (torchring.init()), all over the same
agent store. Sections:

  step     the training step of benchmarks/train_step.py (its MLP: 1024 -> 4x -> 4x -> 1024,
           25.18M parameters at --width 1024; its timed_steps: a fixed batch per rank, MSE loss,
           SGD lr 1e-3, every step started together by a barrier, --warmup steps untimed: DDP
           rebuilds its buckets in its second forward, so the default 2 keeps that out), for:
             compute        every rank steps its own copy, no communication (the floor)
             ddp_floor      DistributedDataParallel on the gloo group with a communication hook
                            that returns each bucket untouched: DDP's own cost (bucket copies,
                            hooks, bookkeeping) with no allreduce, the floor of any DDP backend
             ddp_gloo       DistributedDataParallel(model, process_group=<the gloo group>)
             ddp_torchring  DistributedDataParallel(model) on the default group: the torchring backend
             wrap           torchring.wrap(model)
           each its own copy of the same model (seed 0), each library at its defaults. Each round
           runs every configuration for --warmup + --steps steps on the same batch (seeded per rank
           right before each configuration), in reverse order on odd rounds so drift of a shared
           machine hits all alike. A configuration's time in a round is the median of its steps on
           a rank, then the max over ranks; the table shows the median over rounds, the ratios
           are medians of per-round ratios. Goal: ddp_torchring / ddp_gloo <= 0.7.
           Check (after the last round, every configuration having taken the same steps on the
           same data): each synchronized configuration's parameters bitwise equal on every rank
           (elementwise MIN == MAX over the gloo group), each equal to ddp_gloo's on every rank
           (allclose rtol 1e-5, atol 1e-7; bitwise reported), and, as controls, compute's
           parameters differing between ranks and from ddp_gloo's (else the batches were the same
           everywhere or the sync changed nothing, and the checks prove nothing).
  latency  per-call time of an in-place SUM allreduce of float32 tensors of --sizes bytes:
             direct         torchring.allreduce(t)
             backend        dist.all_reduce(t): the torchring backend through torch.distributed
             backend_raw    the backend object's allreduce([t], opts).wait() (no torch.distributed
                            Python layer: what the C++ backend itself adds)
             direct_async   torchring.allreduce_async(t).wait()
             backend_async  dist.all_reduce(t, async_op=True).wait() (as DDP calls it: completed
                            through the backend's completer thread)
             gloo           dist.all_reduce(t, group=<the gloo group>)
           Per size: a correctness check with integer data per library (#wrong, summed over
           ranks), a warm-up that calibrates each library's iters to about --trial-s seconds per
           trial, then --trials trials interleaved (every library once per trial, in reverse order
           on odd trials), each a torchring.barrier and iters back-to-back calls timed as the mean
           per call; a trial's time is the max over ranks, the table the median over trials.
           "added" = median over trials of (backend - direct) per call; "raw added" the same for
           backend_raw. Goal: added < 5 us.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _harness import (common_args, finish, machine_info, max_over_ranks, oversubscribed, parse_args,  # noqa: E402
                      print_header, rank_env, reporting, run_world, sum_over_ranks)
from _models import mlp, timed_steps  # noqa: E402
from _sync_checks import differing_between_ranks, flat_params, no_comm, ratio  # noqa: E402
from _sizes import fmt_size, parse_size  # noqa: E402

SECTIONS = ("step", "latency")
STEP_CONFIGS = ("compute", "ddp_floor", "ddp_gloo", "ddp_torchring", "wrap")
SYNCED = ("ddp_gloo", "ddp_torchring", "wrap")
LAT_LIBS = ("direct", "backend", "backend_raw", "direct_async", "backend_async", "gloo")
DEFAULT_SIZES = "4,64,1K,4K,16K,64K"
RTOL, ATOL = 1e-5, 1e-7


def step_section(rank: int, args: argparse.Namespace, gloo: Any, queue: Any) -> None:
    """Rounds of every step configuration, then the parameter check; rank 0 reports rows."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import torchring

    build: dict[str, Callable[[], nn.Module]] = {
        "compute": lambda: mlp(args.width),
        "ddp_gloo": lambda: DistributedDataParallel(mlp(args.width), process_group=gloo),
        "ddp_torchring": lambda: DistributedDataParallel(mlp(args.width)),
        "ddp_floor": lambda: no_comm(DistributedDataParallel(mlp(args.width), process_group=gloo)),
        "wrap": lambda: torchring.wrap(mlp(args.width)),
    }
    order = [c for c in STEP_CONFIGS if c in args.configs]
    models = {name: build[name]() for name in order}
    params = sum(p.numel() for p in models[order[0]].parameters())
    for round_ in range(args.rounds):
        step_s: dict[str, float] = {}
        faults: dict[str, float] = {}
        for name in order if round_ % 2 == 0 else order[::-1]:
            torch.manual_seed(1000 + rank)  # timed_steps draws the batch: per rank, same for every config
            times, fault = timed_steps(models[name], args.batch, args.width, args.steps, args.warmup,
                                       torchring.barrier)
            (step_s[name],) = max_over_ranks([statistics.median(times)])
            faults[name] = fault
        if rank == 0:
            queue.put(("row", {"section": "step", "round": round_, "params": params, "step_s": step_s,
                               "rank0_faults": faults}))
    # The check: every configuration has now taken the same steps on the same per-rank batches.
    check: dict[str, Any] = {"section": "step_check", "differing_between_ranks": {}, "vs_ddp_gloo": {}}
    ref = flat_params(models["ddp_gloo"]) if "ddp_gloo" in models else None
    for name in order:
        flat = flat_params(models[name])
        check["differing_between_ranks"][name] = differing_between_ranks(flat, gloo)
        if ref is not None and name != "ddp_gloo":  # compute: the control, which must differ
            diff = torch.tensor([float((flat - ref).abs().max()),
                                 float(not torch.allclose(flat, ref, rtol=RTOL, atol=ATOL)),
                                 float(not torch.equal(flat, ref))], dtype=torch.float64)
            dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=gloo)
            check["vs_ddp_gloo"][name] = {"max_abs_diff": diff[0].item(), "allclose": diff[1].item() == 0,
                                          "bitwise": diff[2].item() == 0}
        del flat
    control = check["vs_ddp_gloo"].pop("compute", None)
    check["vs_ddp_gloo"].pop("ddp_floor", None)  # unsynchronized by construction, like compute
    bad = [n for n in order if n in SYNCED and (check["differing_between_ranks"][n]
                                                or not check["vs_ddp_gloo"].get(n, {"allclose": True})["allclose"])]
    blind = "compute" in order and (check["differing_between_ranks"]["compute"] == 0
                                    or control is not None and control["bitwise"])
    check["compute_vs_ddp_gloo"] = control
    check["wrong"] = len(bad) + int(blind)
    check["bad"], check["blind"] = bad, blind
    if rank == 0:
        queue.put(("row", check))


def _lat_calls(t: torch.Tensor, gloo: Any) -> dict[str, Callable[[], Any]]:
    """One in-place SUM allreduce of `t` per library of the latency section."""
    import torch.distributed as dist

    import torchring

    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    opts.asyncOp = False
    return {
        "direct": lambda: torchring.allreduce(t),
        "backend": lambda: dist.all_reduce(t),
        "backend_raw": lambda: backend.allreduce([t], opts).wait(),
        "direct_async": lambda: torchring.allreduce_async(t).wait(),
        "backend_async": lambda: dist.all_reduce(t, async_op=True).wait(),
        "gloo": lambda: dist.all_reduce(t, group=gloo),
    }


def latency_point(rank: int, world: int, nbytes: int, args: argparse.Namespace, gloo: Any) -> dict[str, Any]:
    """Every latency library at one size, trials interleaved; the same dict on every rank."""
    import torchring

    count = max(1, nbytes // 4)
    t = torch.empty(count, dtype=torch.float32)
    calls = {k: v for k, v in _lat_calls(t, gloo).items() if k in args.libs}
    pattern = torch.arange(count, dtype=torch.int32) % 13
    expected = (pattern * world + world * (world - 1) // 2).to(torch.float32)
    row: dict[str, Any] = {"section": "latency", "size": count * 4, "count": count}
    wrong, iters = {}, {}
    for name, call in calls.items():
        t.copy_(pattern + rank)
        call()
        wrong[name] = sum_over_ranks(int((t != expected).sum()))
        t.zero_()  # sums of zeros stay zero: every later call does the same work
        for _ in range(3):
            call()
        torchring.barrier()
        start = time.perf_counter()
        for _ in range(20):
            call()
        (per_call,) = max_over_ranks([(time.perf_counter() - start) / 20])
        iters[name] = max(1, min(20000, round(args.trial_s / per_call)))
    names = list(calls)
    times: dict[str, list[float]] = {k: [] for k in names}
    for trial in range(args.trials):
        for name in names if trial % 2 == 0 else names[::-1]:
            call = calls[name]
            torchring.barrier()
            start = time.perf_counter()
            for _ in range(iters[name]):
                call()
            times[name].append((time.perf_counter() - start) / iters[name])
    for name in names:
        trial_us = [x * 1e6 for x in max_over_ranks(times[name])]
        row[name] = {"time_us": statistics.median(trial_us), "trial_us": trial_us, "iters": iters[name],
                     "wrong": wrong[name]}
    for added, lib, base in (("added_us", "backend", "direct"), ("raw_added_us", "backend_raw", "direct"),
                             ("async_added_us", "backend_async", "direct_async")):
        if lib in row and base in row:
            row[added] = statistics.median(a - b for a, b in zip(row[lib]["trial_us"], row[base]["trial_us"]))
    return row


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    """One rank: the torchring default group, a gloo group, torchring.init(); the chosen sections."""
    os.environ.update(rank_env(rank, world, port))
    with reporting(rank, queue):
        import torch.distributed as dist

        import torchring  # registers the "torchring" backend

        torch.set_num_threads(1)
        dist.init_process_group("torchring")
        gloo = dist.new_group(backend="gloo")
        torchring.init()
        if "step" in args.only:
            step_section(rank, args, gloo, queue)
        if "latency" in args.only:
            for nbytes in args.sizes:
                row = latency_point(rank, world, nbytes, args, gloo)
                if rank == 0:
                    queue.put(("row", row))
        torchring.shutdown()
        dist.destroy_process_group()


def _print_step_summary(rows: list[dict], check: dict | None, names: list[str]) -> dict[str, Any]:
    """The step table over rounds, the ratios and the check; returns the summary for --json."""
    print(f"\nmodel: {rows[0]['params'] / 1e6:.2f}M parameters; medians over {len(rows)} rounds\n")
    print("| config | step (ms) | vs compute | vs ddp_gloo | rank-0 faults/step |")
    print("|---|---|---|---|---|")
    summary: dict[str, Any] = {"step_ms": {}, "ratios": {}}
    for n in names:
        med = statistics.median(r["step_s"][n] for r in rows) * 1e3
        summary["step_ms"][n] = med
        vs_c, vs_g = ratio(rows, n, "compute"), ratio(rows, n, "ddp_gloo")
        faults = statistics.median(r["rank0_faults"][n] for r in rows)
        print(f"| {n} | {med:.1f} | {'' if vs_c is None else f'{vs_c:.3f}x'} | "
              f"{'' if vs_g is None else f'{vs_g:.3f}x'} | {faults:.0f} |")
    wanted = [("ddp_torchring", "ddp_gloo"), ("ddp_floor", "ddp_gloo"), ("wrap", "ddp_gloo"), ("ddp_torchring", "wrap"),
              ("ddp_torchring", "compute"), ("ddp_gloo", "compute"), ("wrap", "compute")]
    ratios = {f"{a}/{b}": ratio(rows, a, b) for a, b in wanted}
    summary["ratios"] = {k: v for k, v in ratios.items() if v is not None}
    print("\n" + ", ".join(f"{k} = {v:.3f}" for k, v in summary["ratios"].items()) +
          " (step times, medians of per-round ratios)")
    goal = summary["ratios"].get("ddp_torchring/ddp_gloo")
    if goal is not None:
        print(f"DDP on the torchring backend {'meets' if goal <= 0.7 else 'MISSES'} the goal of <= 0.7x "
              "the DDP-on-gloo step")
    ms = summary["step_ms"]
    if all(k in ms for k in ("ddp_floor", "ddp_gloo", "ddp_torchring")):
        # What each backend adds to DDP's own step: the communication it did not hide.
        added = {k: ms[k] - ms["ddp_floor"] for k in ("ddp_gloo", "ddp_torchring")}
        summary["over_ddp_floor_ms"] = added
        print(f"over the DDP floor (DDP with no communication, {ms['ddp_floor']:.1f} ms): gloo adds "
              f"{added['ddp_gloo']:.1f} ms, torchring {added['ddp_torchring']:.1f} ms"
              + (f" ({added['ddp_torchring'] / added['ddp_gloo']:.2f}x gloo's)" if added["ddp_gloo"] > 0 else ""))
    if check is not None:
        between = ", ".join(f"{k} {v}" for k, v in check["differing_between_ranks"].items())
        vs = ", ".join(f"{k}: max |diff| {v['max_abs_diff']:.3g}, "
                       f"{'bitwise' if v['bitwise'] else 'allclose' if v['allclose'] else 'DIFFERENT'}"
                       for k, v in check["vs_ddp_gloo"].items())
        control = check["compute_vs_ddp_gloo"]
        control_text = "" if control is None else f" (control: compute max |diff| {control['max_abs_diff']:.3g})"
        print(f"check: elements differing between ranks: {between} (compute should differ, the rest 0); "
              f"vs ddp_gloo: {vs or 'n/a'}{control_text}" + (f"; FAILED: {check['bad']}" if check["bad"] else "") +
              ("; BLIND: compute's parameters equal on every rank or equal to ddp_gloo's"
               if check["blind"] else ""))
    return summary


def _print_latency_header(libs: list[str]) -> None:
    cols = ["size"] + [f"{n} (us)" for n in libs] + ["added (us)", "raw added (us)", "async added (us)", "#wrong"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols), flush=True)


def _print_latency_row(row: dict, libs: list[str]) -> None:
    def opt(key: str) -> str:
        return f"{row[key]:.2f}" if key in row else ""
    cells = [fmt_size(row["size"])] + [f"{row[n]['time_us']:.2f}" for n in libs]
    cells += [opt("added_us"), opt("raw_added_us"), opt("async_added_us"), str(sum(row[n]["wrong"] for n in libs))]
    print("| " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"sections: subset of {','.join(SECTIONS)}")
    parser.add_argument("--width", type=int, default=1024, help="MLP width (default 1024: 25.18M parameters)")
    parser.add_argument("--batch", type=int, default=64, help="per-rank batch (default 64)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per configuration and round (default 4)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps before them (default 2: DDP rebuilds its buckets in the 2nd forward)")
    parser.add_argument("--rounds", type=int, default=12, help="rounds (default 12)")
    parser.add_argument("--configs", default=",".join(STEP_CONFIGS), help=f"subset of {','.join(STEP_CONFIGS)}")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help=f"latency sizes in bytes (default {DEFAULT_SIZES})")
    parser.add_argument("--libs", default=",".join(LAT_LIBS), help=f"latency: subset of {','.join(LAT_LIBS)}")
    parser.add_argument("--trials", type=int, default=9, help="latency trials per size (default 9)")
    parser.add_argument("--trial-s", type=float, default=0.05, help="latency: seconds per trial (default 0.05)")
    common_args(parser, quick="smoke run: width 256, 2 rounds of 2 steps, sizes 4,64K, 3 trials of ~0.01 s")
    args = parse_args(parser)
    if args.quick:
        args.width, args.rounds, args.steps, args.sizes, args.trials, args.trial_s = 256, 2, 2, "4,64K", 3, 0.01
    args.only = [s for s in args.only.split(",") if s]
    args.configs = [c for c in STEP_CONFIGS if c in args.configs.split(",")]
    args.libs = [n for n in LAT_LIBS if n in args.libs.split(",")]
    args.sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    if not args.only or any(s not in SECTIONS for s in args.only):
        parser.error(f"--only: choose from {','.join(SECTIONS)}")
    if "step" in args.only and "ddp_gloo" not in args.configs:
        parser.error("--configs must include ddp_gloo (the reference of the ratios and of the check)")
    if "latency" in args.only and not args.libs:
        parser.error(f"--libs: choose from {','.join(LAT_LIBS)}")
    if min(args.world, args.width, args.batch, args.steps, args.rounds, args.trials) < 1 or args.warmup < 0:
        parser.error("--world, --width, --batch, --steps, --rounds and --trials must be >= 1, --warmup >= 0")
    info = machine_info()
    print_header("ddp backend: DDP on torchring vs DDP on gloo vs torchring.wrap, and the backend's per-call "
                 "overhead", info)
    over = oversubscribed(args.world)
    print(f"world {args.world}{over}; step: MLP width {args.width}, batch {args.batch}/rank, {args.steps} "
          f"steps after {args.warmup} warm-up per round; latency: {args.trials} trials of ~{args.trial_s} s\n")
    rows: list[dict] = []
    step_rows: list[dict] = []
    checks: list[dict] = []
    names = args.configs
    if "step" in args.only:
        print("| round | " + " | ".join(f"{n} (ms)" for n in names) + " |")
        print("|---|" + "---|" * len(names), flush=True)
    lat_started = [False]

    def on_row(row: dict) -> None:
        rows.append(row)
        if row["section"] == "step":
            step_rows.append(row)
            cells = [f"{row['step_s'][n] * 1e3:.1f}" for n in names]
            print(f"| {row['round']} | " + " | ".join(cells) + " |", flush=True)
        elif row["section"] == "step_check":
            checks.append(row)
            info["step_summary"] = _print_step_summary(step_rows, row, names)
        else:
            if not lat_started[0]:
                lat_started[0] = True
                print("\n## latency: in-place SUM allreduce of float32, per call\n")
                _print_latency_header(args.libs)
            _print_latency_row(row, args.libs)

    os.environ["TORCHRING_JOB_ID"] = f"ddp-backend-{os.getpid()}"
    run_world(args.world, args, on_row, target=_rank_main)
    lat = [r for r in rows if r["section"] == "latency"]
    if lat and "added_us" in lat[0]:
        worst = max(r["added_us"] for r in lat)
        info["latency_added_max_us"] = worst
        print(f"\nthe backend adds at most {worst:.2f} us per dist.all_reduce over torchring.allreduce "
              f"({'meets' if worst < 5 else 'MISSES'} the goal of < 5 us)")
    wrong = sum(c["wrong"] for c in checks)
    wrong += sum(r[n]["wrong"] for r in lat for n in args.libs)
    finish(args, info, rows, wrong)


if __name__ == "__main__":
    main()
