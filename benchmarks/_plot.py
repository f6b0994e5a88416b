"""The plot of benchmarks/allreduce.py: time per call against message size, one line per
library, one panel per (world, dtype), log-log (matplotlib, the bench extra)."""

from __future__ import annotations

from typing import Any

COLORS = {"torchring": "C0", "torchring-shm": "C1", "gloo": "C2", "mpi": "C3", "deepspeed": "C4", "impi": "C5"}


def draw(rows: list[dict[str, Any]], libs: list[str], path: str, title: str) -> None:
    """Writes the PNG `path` from allreduce.py's rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["world"], r["dtype"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, (world, dtype) in zip(axes[0], panels):
        mine = sorted((r for r in rows if (r["world"], r["dtype"]) == (world, dtype)), key=lambda r: r["size"])
        for lib in libs:
            points = [(r["size"], r[lib]["time_us"]) for r in mine if lib in r]
            if points:
                ax.plot(*zip(*points), marker="o", markersize=3, label=lib, color=COLORS.get(lib),
                        linewidth=2.2 if lib.startswith("torchring") else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("time per allreduce (µs, median)")
        ax.set_title(f"world {world}, {dtype}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"allreduce, one host: {title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
