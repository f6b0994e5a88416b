"""How many CPU threads each rank torchring-run starts on this host may use (OMP_NUM_THREADS):
the CPUs this launcher may run on (its affinity mask, not the machine's count) shared among
the host's ranks, at least 1 each. torchrun instead sets 1 and prints a banner about it."""

from __future__ import annotations

from .._core import env as _env

__all__ = ["threads_per_rank", "set_rank_threads"]


def threads_per_rank(ranks: int, cpus: int) -> int:
    """`cpus` shared among `ranks` ranks, rounded down, at least 1."""
    return max(1, cpus // max(1, ranks))


def set_rank_threads(env: dict[str, str], ranks: int) -> str | None:
    """Sets OMP_NUM_THREADS in `env` for `ranks` ranks on this host unless it is set already;
    returns the one line that says so (None when the user's value stays)."""
    if env.get("OMP_NUM_THREADS"):
        return None
    cpus = _env.available_cpus()
    threads = threads_per_rank(ranks, cpus)
    env["OMP_NUM_THREADS"] = str(threads)
    return (f"torchring-run: OMP_NUM_THREADS={threads} for each of the {ranks} ranks on this host "
            f"({cpus} usable CPUs / {ranks}); set OMP_NUM_THREADS to choose another number")
