"""Median over repeated benchmark runs: one markdown table from several allreduce.py JSONs.

    python benchmarks/summarize.py bench-1.json bench-2.json bench-3.json

Each time cell is the median over the runs of that run's median time, with [min..max] over the
runs for torchring. best peer / torchring = the fastest peer's median over torchring's (above 1:
torchring is faster), taken per run and then the median over runs with [min..max]. Model
fraction: torchring's (plain, torchring.empty) share of the memory-bandwidth model of
allreduce.py (from 16 MiB). slowest/median: the worst over the runs of torchring's slowest trial
over its median."""

from __future__ import annotations

import json
import statistics
import sys

from _sizes import fmt_size  # benchmarks/ is on sys.path as the script's folder

ORDER = ("torchring", "torchring-shm", "gloo", "mpi", "deepspeed")


def main(paths: list[str]) -> None:
    runs = [json.load(open(p)) for p in paths]
    libs = [lib for lib in ORDER if any(lib in row for run in runs for row in run["rows"])]
    points: dict[tuple, list[dict]] = {}
    oversubscribed = set()
    for run in runs:
        for row in run["rows"]:
            points.setdefault((row["world"], row["dtype"], row["size"]), []).append(row)
            if row.get("oversubscribed"):
                oversubscribed.add(row["world"])
    machine = runs[0]["machine"]
    print(f"{len(runs)} runs; {machine.get('cpu')}, {machine.get('cores')} cores; {machine.get('versions', '')}; "
          f"load averages {[round(r['machine']['loadavg'][0], 2) for r in runs]}")
    print()
    head = ["world", "dtype", "size"] + [f"{lib} µs" for lib in libs]
    head += ["best peer / torchring [min..max]", "model fraction", "slowest/median", "#wrong"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for (world, dtype, size), rows in sorted(points.items()):
        cells = [f"{world}{' (over)' if world in oversubscribed else ''}", dtype, fmt_size(size)]
        for lib in libs:
            times = [r[lib]["time_us"] for r in rows if lib in r]
            if not times:
                cells.append("n/a")
            elif lib == "torchring":
                cells.append(f"{statistics.median(times):.1f} [{min(times):.1f}..{max(times):.1f}]")
            else:
                cells.append(f"{statistics.median(times):.1f}")
        ratios = []
        for r in rows:
            peers = [r[lib]["time_us"] for lib in libs if lib in r and not lib.startswith("torchring")]
            if peers and "torchring" in r:
                ratios.append(min(peers) / r["torchring"]["time_us"])
        cells.append(f"{statistics.median(ratios):.2f} [{min(ratios):.2f}..{max(ratios):.2f}]" if ratios else "")
        fractions = [statistics.median(r[lib]["model_fraction"] for r in rows if lib in r)
                     for lib in ("torchring", "torchring-shm") if any(lib in r for r in rows)]
        cells.append(", ".join(f"{f:.2f}" for f in fractions) if size >= 16 << 20 and fractions else "")
        worst = [r["torchring"]["slowest_over_median"] for r in rows if "slowest_over_median" in r.get("torchring", {})]
        cells.append(f"{max(worst):.2f}" if worst else "")
        cells.append(str(sum(r[lib]["wrong"] for r in rows for lib in libs if lib in r)))
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
