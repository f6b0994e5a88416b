"""Median over repeated benchmark runs: one markdown table from several allreduce.py JSONs.

    python benchmarks/summarize.py bench-1.json bench-2.json bench-3.json

Each time cell is the median over the runs of that run's median time, with [min..max] over the
runs for torchring. best peer / torchring = the fastest peer's median over torchring's (above 1:
torchring is faster; Intel MPI's over the torchring of its own world), taken per run and then the
median over runs with [min..max]; impi / torchring the same for Intel MPI alone, over the
torchring@impi column (torchring in Intel MPI's world). Model
fraction: torchring's (plain, torchring.empty) share of the memory-bandwidth model of
allreduce.py (from 16 MiB). slowest/median: the worst over the runs of torchring's slowest trial
over its median."""

from __future__ import annotations

import json
import statistics
import sys

from _sizes import fmt_size  # benchmarks/ is on sys.path as the script's folder

ORDER = ("torchring", "torchring-shm", "gloo", "mpi", "impi", "deepspeed")


def peer_ratio(row: dict, lib: str) -> float | None:
    """A peer's time over torchring's from the same processes (impi's world has its own
    torchring_us), above 1 where torchring is faster; None for torchring or a missing cell."""
    if lib.startswith("torchring") or lib not in row:
        return None
    mine = torchring_beside(row, lib)
    return row[lib]["time_us"] / mine if mine else None


def torchring_beside(row: dict, lib: str) -> float | None:
    """torchring's time (µs) in the processes that timed `lib`, a cell of the row."""
    return row[lib].get("torchring_us") or row.get("torchring", {}).get("time_us")


def time_columns(libs: list[str]) -> list[str]:
    """The time columns: each library, and after impi the torchring of impi's own world
    ('torchring@impi', what impi / torchring divides by)."""
    return [col for lib in libs for col in ([lib, "torchring@impi"] if lib == "impi" else [lib])]


def time_us(row: dict, column: str) -> float | None:
    """One time column's cell of a row (µs), None where it did not run."""
    if column == "torchring@impi":
        return torchring_beside(row, "impi") if "impi" in row else None
    return row[column]["time_us"] if column in row else None


def wrong_in(row: dict, libs: list[str]) -> int:
    """Wrong elements of one row's checks, over its libraries and impi's own torchring."""
    return sum(row[lib]["wrong"] + row[lib].get("torchring_wrong", 0) for lib in libs if lib in row)


def spread(values: list[float]) -> str:
    """'1.23 [1.01..1.40]': the median of `values` and their range ('' for none)."""
    return f"{statistics.median(values):.2f} [{min(values):.2f}..{max(values):.2f}]" if values else ""


def main(paths: list[str]) -> None:
    """Prints the table of the runs in `paths`."""
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
    head = ["world", "dtype", "size"] + [f"{col} µs" for col in time_columns(libs)]
    head += ["best peer / torchring [min..max]"] + (["impi / torchring [min..max]"] if "impi" in libs else [])
    head += ["model fraction", "slowest/median", "#wrong"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for (world, dtype, size), rows in sorted(points.items()):
        cells = [f"{world}{' (over)' if world in oversubscribed else ''}", dtype, fmt_size(size)]
        for col in time_columns(libs):
            times = [t for r in rows if (t := time_us(r, col)) is not None]
            if not times:
                cells.append("n/a")
            elif col == "torchring":
                cells.append(f"{statistics.median(times):.1f} [{min(times):.1f}..{max(times):.1f}]")
            else:
                cells.append(f"{statistics.median(times):.1f}")
        per_run = [[x for lib in libs if (x := peer_ratio(r, lib)) is not None] for r in rows]
        cells.append(spread([min(ratios) for ratios in per_run if ratios]))
        if "impi" in libs:
            cells.append(spread([x for r in rows if (x := peer_ratio(r, "impi")) is not None]) or "n/a")
        fractions = [statistics.median(r[lib]["model_fraction"] for r in rows if lib in r)
                     for lib in ("torchring", "torchring-shm") if any(lib in r for r in rows)]
        cells.append(", ".join(f"{f:.2f}" for f in fractions) if size >= 16 << 20 and fractions else "")
        worst = [r["torchring"]["slowest_over_median"] for r in rows if "slowest_over_median" in r.get("torchring", {})]
        cells.append(f"{max(worst):.2f}" if worst else "")
        cells.append(str(sum(wrong_in(r, libs) for r in rows)))
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
