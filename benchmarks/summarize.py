"""Median over repeated benchmark runs: one markdown table from several allreduce.py JSONs.

    python benchmarks/summarize.py bench-1.json bench-2.json bench-3.json

Each cell is the median over the runs of that run's median time; [min..max] shows the spread
between runs, ratio = gloo time / torchring time (both medians)."""

from __future__ import annotations

import json
import statistics
import sys


def main(paths: list[str]) -> None:
    runs = [json.load(open(p)) for p in paths]
    points: dict[tuple, dict[str, list[dict]]] = {}
    oversubscribed = set()
    for run in runs:
        for row in run["rows"]:
            key = (row["world"], row["dtype"], row["size"])
            if row.get("oversubscribed"):
                oversubscribed.add(row["world"])
            for lib in ("torchring", "gloo"):
                if lib in row:
                    points.setdefault(key, {}).setdefault(lib, []).append(row[lib])
    print(f"{len(runs)} runs; machine: {runs[0]['machine']}")
    print()
    print("| world | dtype | size | torchring µs [min..max] | torchring busbw GB/s | gloo µs [min..max] "
          "| gloo busbw GB/s | ratio | #wrong |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (world, dtype, size), libs in sorted(points.items()):
        cells = []
        for lib in ("torchring", "gloo"):
            times = [r["time_us"] for r in libs[lib]]
            cells.append(f"{statistics.median(times):.1f} [{min(times):.0f}..{max(times):.0f}]")
            cells.append(f"{statistics.median(r['busbw'] for r in libs[lib]):.3f}")
        ratio = statistics.median(r["time_us"] for r in libs["gloo"]) / statistics.median(
            r["time_us"] for r in libs["torchring"])
        wrong = sum(r["wrong"] for lib in libs.values() for r in lib)
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        over = " (oversubscribed)" if world in oversubscribed else ""
        print(f"| {world}{over} | {dtype} | {label} | {cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} "
              f"| {ratio:.1f}x | {wrong} |")


if __name__ == "__main__":
    main(sys.argv[1:])
