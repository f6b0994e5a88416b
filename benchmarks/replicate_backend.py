"""FSDP2's replicate() and fully_shard on the torchring backend vs on gloo vs with no communication.

    python benchmarks/replicate_backend.py                  # world 2 (about 3 minutes on 2 cores)
    python benchmarks/replicate_backend.py --json replicate-backend.json   # also the machine, commit, rounds
    python benchmarks/replicate_backend.py --quick          # smoke run: small MLP, 2 rounds of 2 steps
    python benchmarks/replicate_backend.py --configs compute,replicate_floor,replicate_gloo,replicate_torchring

replicate() is the FSDP2-based one, torch.distributed._composable.replicate_with_fsdp (torch's
successor to DDP; torch.distributed._composable.replicate is the older DDP-based one). Every rank
(spawned once, torch.set_num_threads(1)) joins torch.distributed with init_process_group("torchring")
as its default group, a gloo group of the same ranks, a gloo group of itself alone
(dist.new_subgroups(group_size=1)) and torchring itself (torchring.init(), for the barrier that
starts every step), all over the same agent store. Configurations, each its own copy of the MLP of
benchmarks/train_step.py (1024 -> 4x -> 4x -> 1024, 25.18M parameters at --width 1024; seed 0 on
every rank, as FSDP2 does not broadcast rank 0's parameters), the API applied to each Linear and
then to the root, each at FSDP2's defaults (float32: gradients averaged with ReduceOp.AVG):
  compute              the plain model, no communication: the floor of any data-parallel step
  replicate_floor      replicate() over the rank's one-rank gloo group: FSDP2's own work per step
                       (gradient copy-in and -out, hooks, DTensor parameters) with an all_reduce over
                       one rank, i.e. no communication: the floor of replicate() on any backend
  replicate_gloo       replicate() over a mesh of the gloo group (DeviceMesh.from_group)
  replicate_torchring  replicate() over init_device_mesh("cpu", (world,)): the torchring backend
  fsdp_floor, fsdp_gloo, fsdp_torchring   the same with fully_shard (all-gathers in forward and
                       again in backward, a reduce-scatter of the gradients)
The training step is benchmarks/_models.py's timed_steps (a fixed batch per rank, MSE loss, SGD
lr 1e-3, every step started together by a barrier, --warmup untimed steps first: FSDP2 sets itself
up in its first forward). Each round runs every configuration for --warmup + --steps steps on the
same batch (seeded per rank before each configuration), in reverse order on odd rounds so drift
of a shared machine hits all alike. A configuration's time in a round is the median of its steps
on a rank, then the max over ranks; the table shows the median over rounds, the ratios are medians
of per-round ratios. Goal: replicate_torchring / replicate_gloo <= 0.7.
Check (after the last round, every configuration having taken the same steps on the same data):
the full parameters of each configuration over the whole world bitwise equal on every rank
(elementwise MIN == MAX over the gloo group), each torchring configuration's equal to its gloo
twin's (allclose rtol 1e-5, atol 1e-7; bitwise reported), and as controls, compute's parameters
differing between ranks (else the batches were the same everywhere and the checks prove nothing).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _harness import (common_args, finish, machine_info, max_over_ranks, oversubscribed, parse_args,  # noqa: E402
                      print_header, rank_env, reporting, run_world)
from _models import mlp, timed_steps  # noqa: E402
from _sync_checks import differing_between_ranks, flat_params, ratio  # noqa: E402

CONFIGS = ("compute", "replicate_floor", "replicate_gloo", "replicate_torchring", "fsdp_floor", "fsdp_gloo",
           "fsdp_torchring")
SYNCED = ("replicate_gloo", "replicate_torchring", "fsdp_gloo", "fsdp_torchring")
TWINS = {"replicate_torchring": "replicate_gloo", "fsdp_torchring": "fsdp_gloo"}
RTOL, ATOL = 1e-5, 1e-7


def _apply(api: str, model: nn.Module, mesh: Any) -> nn.Module:
    """replicate() or fully_shard on each Linear of ``model``, then on the root, over ``mesh``."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import fully_shard

    fn = replicate if api == "replicate" else fully_shard
    for layer in model:
        if isinstance(layer, nn.Linear):
            fn(layer, mesh=mesh)
    return fn(model, mesh=mesh)


def _check(models: dict[str, nn.Module], gloo: Any) -> dict[str, Any]:
    """The parameter check of the docstring; the same dict on every rank."""
    import torch.distributed as dist

    flats = {name: flat_params(m) for name, m in models.items()}
    check: dict[str, Any] = {"section": "check", "differing_between_ranks": {}, "vs_gloo": {}}
    for name, flat in flats.items():
        if name.endswith("_floor"):
            continue  # each rank trained alone, like compute, but compute is the control
        check["differing_between_ranks"][name] = differing_between_ranks(flat, gloo)
    for name, twin in TWINS.items():
        if name in flats and twin in flats:
            a, b = flats[name], flats[twin]
            diff = torch.tensor([float((a - b).abs().max()), float(not torch.allclose(a, b, rtol=RTOL, atol=ATOL)),
                                 float(not torch.equal(a, b))], dtype=torch.float64)
            dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=gloo)
            check["vs_gloo"][name] = {"max_abs_diff": diff[0].item(), "allclose": diff[1].item() == 0,
                                      "bitwise": diff[2].item() == 0}
    bad = [n for n in flats if n in SYNCED and check["differing_between_ranks"][n]]
    bad += [n for n, v in check["vs_gloo"].items() if not v["allclose"]]
    blind = "compute" in flats and check["differing_between_ranks"]["compute"] == 0
    check.update(bad=bad, blind=blind, wrong=len(bad) + int(blind))
    return check


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    """One rank: the groups, every configuration's model, the rounds and the check."""
    os.environ.update(rank_env(rank, world, port))
    with reporting(rank, queue):
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        import torchring  # registers the "torchring" backend

        torch.set_num_threads(1)
        dist.init_process_group("torchring")
        gloo = dist.new_group(backend="gloo")
        alone, _ = dist.new_subgroups(group_size=1, backend="gloo")
        torchring.init()
        meshes = {"floor": DeviceMesh.from_group(alone, "cpu"), "gloo": DeviceMesh.from_group(gloo, "cpu"),
                  "torchring": init_device_mesh("cpu", (world,))}
        build: dict[str, Callable[[], nn.Module]] = {"compute": lambda: mlp(args.width)}
        for name in CONFIGS[1:]:
            api, where = name.split("_")
            build[name] = lambda api=api, where=where: _apply(api, mlp(args.width), meshes[where])
        models = {name: build[name]() for name in args.configs}
        params = sum(p.numel() for p in mlp(args.width).parameters())
        for round_ in range(args.rounds):
            step_s: dict[str, float] = {}
            faults: dict[str, float] = {}
            for name in args.configs if round_ % 2 == 0 else args.configs[::-1]:
                torch.manual_seed(1000 + rank)  # timed_steps draws the batch: per rank, same for every config
                times, fault = timed_steps(models[name], args.batch, args.width, args.steps, args.warmup,
                                           torchring.barrier)
                (step_s[name],) = max_over_ranks([statistics.median(times)])
                faults[name] = fault
            if rank == 0:
                queue.put(("row", {"section": "step", "round": round_, "params": params, "step_s": step_s,
                                   "rank0_faults": faults}))
        check = _check(models, gloo)
        if rank == 0:
            queue.put(("row", check))
        torchring.shutdown()
        dist.destroy_process_group()


def _summary(rows: list[dict], check: dict, names: list[str]) -> dict[str, Any]:
    """Prints the table over rounds, the ratios, the floors and the check; returns them for --json."""
    print(f"\nmodel: {rows[0]['params'] / 1e6:.2f}M parameters; medians over {len(rows)} rounds\n")
    print("| config | step (ms) | vs compute | vs its gloo config | rank-0 faults/step |")
    print("|---|---|---|---|---|")
    out: dict[str, Any] = {"step_ms": {}, "ratios": {}}
    for n in names:
        med = statistics.median(r["step_s"][n] for r in rows) * 1e3
        out["step_ms"][n] = med
        vs_c, vs_g = ratio(rows, n, "compute"), ratio(rows, n, n.split("_")[0] + "_gloo")
        faults = statistics.median(r["rank0_faults"][n] for r in rows)
        print(f"| {n} | {med:.1f} | {'' if vs_c is None else f'{vs_c:.3f}x'} | "
              f"{'' if vs_g is None or n == 'compute' else f'{vs_g:.3f}x'} | {faults:.0f} |")
    for api in ("replicate", "fsdp"):
        pairs = [(f"{api}_torchring", f"{api}_gloo"), (f"{api}_floor", f"{api}_gloo"),
                 (f"{api}_torchring", f"{api}_floor"), (f"{api}_gloo", "compute"), (f"{api}_floor", "compute")]
        for a, b in pairs:
            r = ratio(rows, a, b)
            if r is not None:
                out["ratios"][f"{a}/{b}"] = r
    print("\n" + ", ".join(f"{k} = {v:.3f}" for k, v in out["ratios"].items()) +
          " (step times, medians of per-round ratios)")
    goal = out["ratios"].get("replicate_torchring/replicate_gloo")
    if goal is not None:
        print(f"replicate() on the torchring backend {'meets' if goal <= 0.7 else 'MISSES'} the goal of <= 0.7x "
              "the replicate-on-gloo step")
    ms = out["step_ms"]
    for api in ("replicate", "fsdp"):
        floor, ring, gloo = (ms.get(f"{api}_{w}") for w in ("floor", "torchring", "gloo"))
        if None not in (floor, ring, gloo):
            added = {"gloo": gloo - floor, "torchring": ring - floor}
            out[f"{api}_over_floor_ms"] = added
            print(f"{api} over its floor (no communication, {floor:.1f} ms; {floor / gloo:.3f}x the gloo step): "
                  f"gloo adds {added['gloo']:.1f} ms, torchring {added['torchring']:.1f} ms"
                  + (f" ({added['torchring'] / added['gloo']:.2f}x gloo's)" if added["gloo"] > 0 else ""))
    between = ", ".join(f"{k} {v}" for k, v in check["differing_between_ranks"].items())
    vs = ", ".join(f"{k}: max |diff| {v['max_abs_diff']:.3g}, "
                   f"{'bitwise' if v['bitwise'] else 'allclose' if v['allclose'] else 'DIFFERENT'}"
                   for k, v in check["vs_gloo"].items())
    print(f"check: elements differing between ranks: {between} (compute should differ, the rest 0); "
          f"vs the gloo twin: {vs or 'n/a'}" + (f"; FAILED: {check['bad']}" if check["bad"] else "") +
          ("; BLIND: compute's parameters equal on every rank" if check["blind"] else ""))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--width", type=int, default=1024, help="MLP width (default 1024: 25.18M parameters)")
    parser.add_argument("--batch", type=int, default=64, help="per-rank batch (default 64)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per configuration and round (default 4)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them (default 2)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds (default 10)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {','.join(CONFIGS)}")
    common_args(parser, quick="smoke run: width 256, 2 rounds of 2 steps")
    args = parse_args(parser)
    if args.quick:
        args.width, args.rounds, args.steps = 256, 2, 2
    args.configs = [c for c in CONFIGS if c in args.configs.split(",")]
    if not args.configs:
        parser.error(f"--configs: choose from {','.join(CONFIGS)}")
    if min(args.world, args.width, args.batch, args.steps, args.rounds) < 1 or args.warmup < 1:
        parser.error("--world, --width, --batch, --steps and --rounds must be >= 1, --warmup >= 1 (FSDP2 sets "
                     "itself up in its first forward)")
    info = machine_info()
    print_header("replicate backend: FSDP2 replicate() and fully_shard on torchring vs gloo vs no communication",
                 info)
    print(f"world {args.world}{oversubscribed(args.world)}; MLP width {args.width}, batch {args.batch}/rank, "
          f"{args.steps} steps after {args.warmup} warm-up per round\n")
    names = args.configs
    print("| round | " + " | ".join(f"{n} (ms)" for n in names) + " |")
    print("|---|" + "---|" * len(names), flush=True)
    rows: list[dict] = []
    checks: list[dict] = []

    def on_row(row: dict) -> None:
        rows.append(row)
        if row["section"] == "step":
            print(f"| {row['round']} | " + " | ".join(f"{row['step_s'][n] * 1e3:.1f}" for n in names) + " |",
                  flush=True)
        else:
            checks.append(row)
            info["summary"] = _summary([r for r in rows if r["section"] == "step"], row, names)

    os.environ["TORCHRING_JOB_ID"] = f"replicate-backend-{os.getpid()}"
    run_world(args.world, args, on_row, target=_rank_main)
    finish(args, info, rows, sum(c["wrong"] for c in checks))


if __name__ == "__main__":
    main()
