"""A DLRM-style recommendation model: DDP on the torchring backend vs DDP on gloo, world 2.

    python benchmarks/dlrm.py                         # about 2 minutes on 2 cores
    python benchmarks/dlrm.py --json dlrm.json        # also the machine, commit and every round
    python benchmarks/dlrm.py --quick                 # smoke run: small tables, 2 rounds

The model (DLRM's shape, scaled to a 2-core machine): --tables embedding bags of --rows x --dim
with sparse=True (each sample looks up --lookups ids per table, sum pooling), a bottom MLP over
--dense dense features, the pairwise dot products of the pooled embeddings and the bottom
output, and a top MLP to one logit (BCE loss), SGD (sparse gradients update only the rows
looked up). Each rank (torch.set_num_threads(1)) joins torch.distributed with
init_process_group("torchring"), a second group of the same ranks with backend "gloo", and trains
two copies of one model (seed 0), DDP on each group, on the same per-rank batches:

  compute        no DDP: every rank steps its own copy (no communication at all)
  ddp_floor      DDP on the gloo group with a communication hook that returns each bucket
                 untouched: DDP's own cost (its sparse buckets too) with no communication
  ddp_gloo       DistributedDataParallel(model, process_group=<the gloo group>)
  ddp_torchring  DistributedDataParallel(model) on the default (torchring) group

DDP sends the embedding gradients as sparse allreduces (gloo: its sparse allreduce; torchring:
three allgathers, then coalesced) and the MLP gradients in dense buckets. Each round runs every
configuration for --warmup + --steps steps, in reverse order on odd rounds; a configuration's time
in a round is the median step on a rank, then the max over ranks, split into forward, backward
(DDP's communication included: backward returns once the gradients are averaged) and optimizer.
The table shows medians over rounds, samples/s (--batch x world / step) and the ratio to
ddp_gloo's step. Check: after the last round both DDP copies' parameters are equal to each other
(bitwise at world 2, where a sum of two numbers does not depend on the order) and on every rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _harness import (common_args, finish, machine_info, max_over_ranks, oversubscribed, parse_args,  # noqa: E402
                      print_header, rank_env, reporting, run_world)
from _sync_checks import no_comm  # noqa: E402

CONFIGS = ("compute", "ddp_floor", "ddp_gloo", "ddp_torchring")
PARTS = ("forward", "backward", "optimizer")


class Dlrm(nn.Module):
    """Sparse embedding bags + bottom MLP, pairwise interactions, top MLP."""

    def __init__(self, tables: int, rows: int, dim: int, dense: int) -> None:
        super().__init__()
        self.embs = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum", sparse=True) for _ in range(tables))
        self.bottom = nn.Sequential(nn.Linear(dense, 256), nn.ReLU(), nn.Linear(256, dim), nn.ReLU())
        pairs = (tables + 1) * tables // 2
        self.top = nn.Sequential(nn.Linear(dim + pairs, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                                 nn.Linear(256, 1))

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        feats = torch.stack([x] + [emb(ids[:, t]) for t, emb in enumerate(self.embs)], dim=1)
        dots = feats @ feats.transpose(1, 2)
        i, j = torch.triu_indices(feats.shape[1], feats.shape[1], offset=1)
        return self.top(torch.cat([x, dots[:, i, j]], dim=1))


def _batch(rank: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    dense = torch.randn(args.batch, args.dense, generator=g)
    ids = torch.randint(0, args.rows, (args.batch, args.tables, args.lookups), generator=g)
    label = torch.randint(0, 2, (args.batch, 1), generator=g).float()
    return dense, ids, label


def _steps(model: nn.Module, opt: Any, batch: tuple, n: int, barrier: Any) -> list[dict[str, float]]:
    """n timed steps: forward, backward, optimizer seconds each."""
    dense, ids, label = batch
    out = []
    for _ in range(n):
        barrier()
        t0 = time.perf_counter()
        loss = nn.functional.binary_cross_entropy_with_logits(model(dense, ids), label)
        t1 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        out.append({"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2, "step": t3 - t0})
    return out


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    os.environ.update(rank_env(rank, world, port))
    with reporting(rank, queue):
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        __import__("torchring")  # registers the "torchring" backend

        torch.set_num_threads(1)
        dist.init_process_group("torchring")
        gloo = dist.new_group(backend="gloo")
        torch.manual_seed(0)
        base = Dlrm(args.tables, args.rows, args.dim, args.dense)
        models = {"compute": Dlrm(args.tables, args.rows, args.dim, args.dense),
                  "ddp_floor": no_comm(DDP(Dlrm(args.tables, args.rows, args.dim, args.dense), process_group=gloo)),
                  "ddp_gloo": DDP(Dlrm(args.tables, args.rows, args.dim, args.dense), process_group=gloo),
                  "ddp_torchring": DDP(Dlrm(args.tables, args.rows, args.dim, args.dense))}
        for m in models.values():  # the same start everywhere (DDP's own broadcast came before)
            (m.module if isinstance(m, DDP) else m).load_state_dict(base.state_dict())
        opts = {k: torch.optim.SGD(m.parameters(), lr=0.05) for k, m in models.items()}
        batch = _batch(rank, args)
        barrier = lambda: dist.barrier(group=gloo)  # noqa: E731
        params = sum(p.numel() for p in base.parameters())
        for round_ in range(args.rounds):
            order = CONFIGS if round_ % 2 == 0 else CONFIGS[::-1]
            times: dict[str, dict[str, float]] = {}
            for name in order:
                _steps(models[name], opts[name], batch, args.warmup, barrier)
                steps = _steps(models[name], opts[name], batch, args.steps, barrier)
                keys = ("step",) + PARTS
                medians = max_over_ranks([statistics.median(s[k] for s in steps) for k in keys])
                times[name] = dict(zip(keys, medians))
            if rank == 0:
                queue.put(("row", {"round": round_, "params": params, "times": times}))
        # Both DDP copies took the same steps on the same batches: their parameters must agree.
        flat = {k: torch.cat([p.detach().reshape(-1) for p in models[k].parameters()])
                for k in ("ddp_gloo", "ddp_torchring")}
        diff = float((flat["ddp_gloo"] - flat["ddp_torchring"]).abs().max())
        low, high = flat["ddp_torchring"].clone(), flat["ddp_torchring"].clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=gloo)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=gloo)
        between = int((low != high).sum())
        (worst,) = max_over_ranks([diff])
        if rank == 0:
            queue.put(("row", {"check": True, "max_abs_diff": worst, "differing_between_ranks": between}))
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tables", type=int, default=8, help="embedding tables (default 8)")
    parser.add_argument("--rows", type=int, default=200_000, help="rows per table (default 200000)")
    parser.add_argument("--dim", type=int, default=64, help="embedding dim (default 64)")
    parser.add_argument("--lookups", type=int, default=8, help="ids per sample per table (default 8)")
    parser.add_argument("--dense", type=int, default=13, help="dense features (default 13, as Criteo)")
    parser.add_argument("--batch", type=int, default=256, help="per-rank batch (default 256)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration and round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--rounds", type=int, default=8, help="rounds (default 8)")
    common_args(parser, quick="small tables, 2 rounds")
    args = parse_args(parser)
    if args.quick:
        args.rows, args.tables, args.rounds, args.steps = 5000, 4, 2, 2
    info = machine_info()
    print_header(f"DLRM-style DDP step, world {args.world}{oversubscribed(args.world)}", info,
                 f"{args.tables} tables x {args.rows} x {args.dim}, batch {args.batch}/rank")
    rows: list[dict] = []
    run_world(args.world, args, rows.append, _rank_main)
    rounds = [r for r in rows if "times" in r]
    check = next(r for r in rows if r.get("check"))
    print(f"\nmodel: {rounds[0]['params'] / 1e6:.1f}M parameters; medians over {len(rounds)} rounds\n")
    print("| config | step (ms) | forward | backward (with comm) | optimizer | samples/s | vs ddp_gloo | vs ddp_floor |")
    print("|---|---|---|---|---|---|---|---|")
    summary: dict[str, Any] = {}
    for name in CONFIGS:
        med = {k: statistics.median(r["times"][name][k] for r in rounds) * 1e3 for k in ("step",) + PARTS}
        ratio = statistics.median(r["times"][name]["step"] / r["times"]["ddp_gloo"]["step"] for r in rounds)
        floor = statistics.median(r["times"][name]["step"] / r["times"]["ddp_floor"]["step"] for r in rounds)
        rate = args.batch * args.world / (med["step"] / 1e3)
        summary[name] = {**med, "samples_per_s": rate, "vs_ddp_gloo": ratio, "vs_ddp_floor": floor}
        print(f"| {name} | {med['step']:.1f} | {med['forward']:.1f} | {med['backward']:.1f} | "
              f"{med['optimizer']:.1f} | {rate:.0f} | {ratio:.3f}x | {floor:.3f}x |")
    ok = check["differing_between_ranks"] == 0 and (check["max_abs_diff"] == 0 or args.world > 2)
    print(f"\ncheck: ddp_torchring vs ddp_gloo max |diff| {check['max_abs_diff']:.3g}, elements differing "
          f"between ranks {check['differing_between_ranks']}: {'ok' if ok else 'FAILED'}")
    finish(args, info, rows, 0 if ok else 1, summary=summary)


if __name__ == "__main__":
    main()
